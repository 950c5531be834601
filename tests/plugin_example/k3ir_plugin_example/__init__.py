"""An out-of-tree k3ir backend: float32 NumPy on the CPU (the shape of a vendor backend).

A backend is a lowering table (op name -> implementation, with optional per-op conditions), a
pass pipeline and a ``build`` function returning an ``Executable``. This one lowers the core ops
and a few model ops natively (``TABLE``, a ``k3ir.backends.lowering.LoweringTable``); every other
model op falls back to its decomposition into core ops through k3ir's shared ``Interpreter``. One
entry is conditional: ``k3.lm_head`` is native for vocabularies up to ``LM_HEAD_MAX_VOCAB`` and
decomposes (transpose + matmul) above; the ``Interpreter`` and ``k3ir check`` read the same
condition, so what ``check`` says is what runs.

Its pipeline (``Backend.phases``) has a fusion of its own: phase ``fuse`` runs the plugin's pass
``numpy-example.fuse-rmsnorm-linear`` (``fusion.py``), which turns an RMSNorm read by one linear layer
into the plugin-declared op ``numpy_example.rmsnorm_linear`` (reference + decomposition, so every other
backend runs it too), lowered natively here; phase ``cleanup`` runs DCE. k3ir's own fusions do not run,
so ``k3ir check --target numpy-example`` lists KDA, MLA, MoE, ... as decompositions. Registered by
``pyproject.toml``::

    [project.entry-points."k3ir.backends"]
    numpy-example = "k3ir_plugin_example:backend"
"""
from __future__ import annotations

from typing import Any

import numpy as np
from k3ir.backends import Backend, Executable
from k3ir.backends.interpreter import Interpreter
from k3ir.backends.lowering import LoweringTable

from k3ir.opdef import all_ops

from .fusion import FUSED, PASS, rmsnorm_linear

F32 = np.float32


def _f32(x):
    a = np.asarray(x)
    return a.astype(F32) if a.dtype.kind == "f" else a


def _core_table() -> dict:
    """Core ops through their reference definitions, results rounded to float32."""
    def wrap(inst, *args):
        out = inst.reference(*args)
        return tuple(_f32(o) for o in out) if isinstance(out, tuple) else _f32(out)
    return {name: wrap for name, cls in all_ops().items() if cls.family == "core" and name != "k3.param"}


def _rmsnorm(inst, x, w):
    x = x.astype(F32)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(inst.eps)) * w.astype(F32)


#: the widest ``k3.lm_head`` this example computes natively (its logits row as one float32 block)
LM_HEAD_MAX_VOCAB = 16384


def _lm_head_fits(op) -> str | None:
    """``k3.lm_head`` condition: the vocabulary (rows of the weight) at most ``LM_HEAD_MAX_VOCAB``."""
    vocab = op.operands[1].type.shape[0]
    if not isinstance(vocab, int) or vocab > LM_HEAD_MAX_VOCAB:
        return f"vocabulary {vocab} > {LM_HEAD_MAX_VOCAB} columns"
    return None


TABLE = LoweringTable(_core_table())
TABLE.update({
    "k3.embedding": lambda inst, ids, table: table[np.asarray(ids, dtype=np.int64)],
    "k3.linear": lambda inst, x, w: x.astype(F32) @ w.astype(F32).T,
    "k3.rmsnorm": _rmsnorm,
    "k3.swiglu": lambda inst, g, u: g / (F32(1) + np.exp(-g)) * u,
    FUSED: rmsnorm_linear,
})


@TABLE.lowers("k3.lm_head", when=_lm_head_fits)
def _lm_head(inst, x, w):
    return x.astype(F32) @ w.astype(F32).T


class NumpyExecutable(Executable):
    def __init__(self, module, dtype: str = "float32", device: str = "cpu"):
        super().__init__(module, "numpy-example", "float32", "cpu")

    def prepare_params(self, arrays: dict[str, Any]) -> dict[str, Any]:
        return {k: _f32(v.detach().cpu().numpy() if hasattr(v, "detach") else v) for k, v in arrays.items()}

    def run(self, function: str, args: list[Any], params: dict[str, Any]) -> list[Any]:
        args = [_f32(a.detach().cpu().numpy() if hasattr(a, "detach") else a) for a in args]
        return Interpreter(self.module, TABLE, params.__getitem__).run(function, args)

    def to_numpy(self, x: Any):
        return np.asarray(x)


def backend() -> Backend:
    """The entry point: k3ir calls this and registers the returned Backend."""
    return Backend(name="numpy-example", description="example plugin: float32 NumPy (out of tree)",
                   build=lambda module, dtype="float32", device="cpu": NumpyExecutable(module, dtype, device),
                   phases=[("fuse", [PASS]), ("cleanup", ["dce"])], table=lambda: TABLE, aliases=("np-example",))
