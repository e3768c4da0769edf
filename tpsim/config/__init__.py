"""Model configs: the dataclass (model), the families, the checks, loading (loader)."""
