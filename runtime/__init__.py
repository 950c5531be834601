"""Runtime: Session (forward/prefill/decode/generate) over compiled executables."""
from .params import init_params
from .session import Session, State

__all__ = ["Session", "State", "init_params"]
