"""The triton target's lowering table for ``Backend.table`` / ``k3ir check`` / ``k3ir ops``: the torch table,
overridden by the Triton kernels (``executable.KERNELS``) and the MoE/MLA/linear lowerings (``lowering.table``),
the same merge ``TritonExecutable`` runs with. The merge is a ``LoweringTable``: an entry keeps the ``when``
condition of the table it comes from (a later table's entry replaces an earlier one with its own condition, or
none). Where a kernel's run-time condition fails (float64, more than 256 router experts, a grad-enabled input,
row counts), the op's torch implementation runs, which is native to this target as well."""
from __future__ import annotations

from typing import Any

from .. import TargetDescription
from ..lowering import LoweringTable, table_supports

#: what the triton target's kernels rely on (``k3ir check --target triton`` shows it)
TARGET = TargetDescription(
    kind="cuda", arch="sm_90 (Hopper: H100, H200)",
    toolchain="Triton >= 3.4, PTX through ptxas; TRITON_INTERPRET=1 runs the same kernels on the CPU, tiny sizes",
    features=(
        ("programmatic dependent launch: decode kernels start while the previous kernel finishes (griddepcontrol, "
         "compute capability >= 9.0; gemv.pdl_kwargs)"),
        ("wgmma: Hopper MMA v3 tensor-core dots in the chunked KDA forward and backward (kda_bwd compiles some "
         "launches without it)"),
        "CUDA graphs: decode replayed as one captured graph per batch size (graphs.py)",
    ),
    limits=(("shared_memory_per_block_bytes", 232448),),   # the H200's opt-in maximum; smem_fit drops stages above it
)


def table() -> LoweringTable:
    """op name -> implementation (``k3.mla`` as its factory ``lowering.make_mla``: the executable binds it), with
    the conditions of the merged tables."""
    from ..torch.ops import TABLE
    from . import lowering
    from .executable import KERNEL_FALLBACKS, KERNELS
    own = lowering.table(None)
    own["k3.mla"] = lowering.make_mla
    own["k3.mla_kv_norm"] = lowering.make_mla_kv_norm
    out = LoweringTable()
    for part in (TABLE, KERNELS, own):
        conditions, fallbacks = getattr(part, "conditions", {}), getattr(part, "fallbacks", {})
        for name, impl in part.items():
            out[name] = impl
            out.conditions.pop(name, None)
            out.fallbacks.pop(name, None)
            if name in conditions:
                out.conditions[name] = conditions[name]
            if name in fallbacks:
                out.fallbacks[name] = fallbacks[name]
    out.fallbacks.update(KERNEL_FALLBACKS)
    return out


def supports(op: Any) -> str | None:
    """None when ``table()`` lowers ``op`` (and the entry's condition, if any, holds), else why not."""
    return table_supports(table(), op)
