"""The ``reference`` target: every op runs its float64 NumPy reference (the test oracle).
Slow and exact; for small inputs."""
from __future__ import annotations

from typing import Any

import numpy as np

from k3ir.errors import K3BackendError
from k3ir.ir import Module
from k3ir.opdef import all_ops

from .. import Backend, Executable, register_backend
from ..interpreter import Interpreter


def reference_table(include: set[str] | None = None) -> dict:
    """op name -> ``inst.reference`` for every op (or only ``include``)."""
    return {name: (lambda inst, *a: inst.reference(*a)) for name in all_ops()
            if name != "k3.param" and (include is None or name in include)}


class ReferenceExecutable(Executable):
    def __init__(self, module: Module, dtype: str, device: str, core_only: bool = False):
        super().__init__(module, "reference", "float64", "cpu")
        ops = all_ops()
        self.table = reference_table({n for n, c in ops.items() if c.family == "core"} if core_only else None)

    def prepare_params(self, arrays: dict[str, Any]) -> dict[str, Any]:
        return {k: np.asarray(v, dtype=np.float64) for k, v in arrays.items()}

    def run(self, function: str, args: list[Any], params: dict[str, Any]) -> list[Any]:
        if "mesh" in self.module.attrs:      # one rank's program: its collectives need every rank's values
            raise K3BackendError(f"module '{self.module.name}' is sharded (mesh {self.module.attrs['mesh']}): run all "
                                 "ranks with k3ir.backends.reference.ranks.run_ranks / run_sharded")
        interp = Interpreter(self.module, self.table, params.__getitem__)
        args = [a if a is None else (np.asarray(a) if np.asarray(a).dtype.kind in "iub"
                                     else np.asarray(a, dtype=np.float64)) for a in args]
        return interp.run(function, args)

    def to_numpy(self, x: Any):
        return np.asarray(x)


def _build(module: Module, dtype: str = "float64", device: str = "cpu") -> ReferenceExecutable:
    return ReferenceExecutable(module, dtype, device)


register_backend(Backend(name="reference", description="float64 NumPy oracle (every op's reference)",
                         build=_build, pipeline=[], table=reference_table, dtypes=("float64",)))
