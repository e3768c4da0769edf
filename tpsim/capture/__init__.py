from tpsim.capture.conventions import CONVENTIONS, Resolution, check_convention, default_ids, ids_for, resolve
from tpsim.capture.positions import Position, PositionKind
from tpsim.capture.recorder import Recorder

__all__ = ["CONVENTIONS", "Resolution", "check_convention", "default_ids", "ids_for", "resolve", "Position",
           "PositionKind", "Recorder"]
