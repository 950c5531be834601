"""Pass infrastructure (see passes/manager.py)."""
from .manager import PASSES, Pass, PassResult, register_pass, run_pipeline

__all__ = ["PASSES", "Pass", "PassResult", "register_pass", "run_pipeline"]
