"""tpsim: which tensor a tensor-parallel engine captures for an EAGLE-3 draft model."""

__version__ = "0.1.0"
