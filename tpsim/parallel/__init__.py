from tpsim.parallel.group import CollectiveRecord, TPGroup, Tracer
from tpsim.parallel.ops import Op

__all__ = ["CollectiveRecord", "Op", "TPGroup", "Tracer"]
