"""Op families; importing this package registers every op. Families: core tensor ops, state
ops, model ops (nn, kda, mla, moe, residual), fused ops created by passes, vision ops, collectives of sharded modules."""
import importlib
import importlib.util

FAMILIES = ("core", "state", "nn", "kda", "mla", "moe", "residual", "fused", "vision", "collective")

for _name in FAMILIES:
    if importlib.util.find_spec(f"{__name__}.{_name}") is not None:
        importlib.import_module(f"{__name__}.{_name}")
