"""The triton target's lowering table for ``Backend.table`` / ``k3ir check``: the torch table, overridden by
the Triton kernels (``executable.KERNELS``) and the MoE/MLA/linear lowerings (``lowering.table``), the same
merge ``TritonExecutable`` runs with. No op is refused statically: where a kernel's run-time condition
fails (float64, more than 256 router experts, a grad-enabled input, row counts), the op's torch
implementation runs, which is native to this target as well."""
from __future__ import annotations

from typing import Any


def table() -> dict[str, Any]:
    """op name -> implementation (``k3.mla`` as its factory ``lowering.make_mla``: the executable binds it)."""
    from ..torch.ops import TABLE
    from . import lowering
    from .executable import KERNELS
    own = lowering.table(None)
    own["k3.mla"] = lowering.make_mla
    return {**TABLE, **KERNELS, **own}


def supports(op: Any) -> str | None:
    """None for every op of ``table()`` (see the module docstring), else why not."""
    return None if op.name in table() else f"no lowering for {op.name}"
