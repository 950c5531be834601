"""Op families; importing this package registers every op. Families: core tensor ops, state
ops, model ops (nn, kda, mla, moe, residual; each with the fused ops the passes make from it), vision ops, collectives of sharded modules."""
from ..registration import import_builtin

#: the op-family modules of this package, imported (and so registered) in this order; every module here
#: that defines ops is listed (tests/test_layering.py checks it)
FAMILIES = ("core", "state", "nn", "kda", "mla", "moe", "residual", "vision", "collective")

for _name in FAMILIES:
    import_builtin(f"{__name__}.{_name}", "op family")
