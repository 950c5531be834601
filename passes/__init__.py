"""Pass infrastructure and the built-in passes (see passes/manager.py, passes/pipelines.py)."""
from .manager import PASSES, Pass, PassResult, known_passes, make_pass, register_pass, run_pipeline
from .pipelines import PHASES, PIPELINES, pipeline_for

__all__ = ["PASSES", "PHASES", "PIPELINES", "Pass", "PassResult", "known_passes", "make_pass", "pipeline_for",
           "register_pass", "run_pipeline"]
