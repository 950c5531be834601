"""The ``triton`` target: our own Triton kernels for KDA (SPEC.md 3) on NVIDIA Hopper GPUs, on top
of the torch executable (ops without a kernel run as PyTorch or decompose).

Kernels: the fused chunked KDA forward (``kda_forward``; autograd through a recompute backward),
the short conv + SiLU prelude, the head RMSNorm + output gate epilogue and the one-launch decode
step on state slots in a pool (``kda_decode``). On a CPU machine they run under
``TRITON_INTERPRET=1`` at tiny sizes. Triton is imported lazily: ``k3ir inspect`` never pays for it.
"""
from __future__ import annotations

from .. import Backend, register_backend
from . import support
from .config import interpreting

__all__ = ["gated_rmsnorm", "kda_decode", "kda_forward", "short_conv"]


def __getattr__(name: str):
    if name == "kda_forward":
        from .kda.chunk import kda_forward
        return kda_forward
    if name in ("kda_decode", "short_conv", "gated_rmsnorm"):
        from .kda import layer
        return getattr(layer, name)
    raise AttributeError(name)


def _available() -> str | None:
    import importlib.util
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install 'k3ir[triton]')"
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if interpreting():
        return None
    if not torch.cuda.is_available():
        return "no CUDA GPU here (set TRITON_INTERPRET=1 to run the kernels on the CPU interpreter, tiny sizes)"
    return None


def _build(module, dtype: str = "bfloat16", device: str = "cuda", mesh=None):
    from .executable import TritonExecutable
    return TritonExecutable(module, dtype, device, mesh)


def _pipeline() -> list[str]:
    try:
        from k3ir.passes.pipelines import pipeline_for
        return pipeline_for("triton")
    except ImportError:
        return ["fuse-kda-chunks", "dce"]


register_backend(Backend(name="triton", description="Triton kernels for Hopper GPUs (fused KDA fwd/bwd, decode)",
                         build=_build, pipeline=_pipeline(), table=support.table, target_description=support.TARGET,
                         available=_available))
