from tpsim.parallel.group import CollectiveRecord, TPGroup, Tracer

__all__ = ["CollectiveRecord", "TPGroup", "Tracer"]
