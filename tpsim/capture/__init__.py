from tpsim.capture.positions import Position, PositionKind
from tpsim.capture.recorder import Recorder

__all__ = ["Position", "PositionKind", "Recorder"]
