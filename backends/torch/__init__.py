"""The ``torch`` target: eager PyTorch on CPU or CUDA, float32/bfloat16/float64, autograd
through every op (the training backend)."""
from __future__ import annotations

from typing import Any

from k3ir.errors import K3BackendError
from k3ir.ir import Module, Operation
from k3ir.types import TensorType

from .. import Backend, Executable, register_backend
from ..interpreter import Interpreter


def _torch():
    import torch
    return torch


class TorchExecutable(Executable):
    """Runs the module op by op with PyTorch kernels. IR ``bf16`` tensors compute in the
    compile dtype; IR ``f32`` tensors (gates, router, state, logits) stay fp32 (fp64 when the
    compile dtype is float64). A sharded module (``passes/shard.py``) needs ``mesh``, the DeviceMesh of
    ``k3ir.runtime.distributed.init_mesh`` (its collectives run on it, ``collectives.py``); K3BackendError
    without one, with one whose sizes differ from the module's, or with one for an unsharded module."""

    def __init__(self, module: Module, dtype: str, device: str, mesh: Any = None):
        super().__init__(module, "torch", dtype, device)
        torch = _torch()
        from .ops import TABLE
        self.table = TABLE
        self.mesh = mesh
        if mesh is not None or "mesh" in module.attrs:
            from .collectives import bind, check_mesh
            check_mesh(module, mesh)
            self.table = {**TABLE, **bind(mesh)}
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise K3BackendError(f"device '{device}' requested but no CUDA GPU is available")
        self.tdev = torch.device(device)
        self.compute = getattr(torch, dtype)
        self.f32 = torch.float64 if dtype == "float64" else torch.float32
        self._map = {"bf16": self.compute, "f16": self.compute, "f32": self.f32, "f64": torch.float64,
                     "i64": torch.int64, "i32": torch.int32, "u8": torch.uint8, "i8": torch.int8,
                     "bool": torch.bool, "mxfp4": torch.uint8, "int4": torch.int32}   # packed experts

    def torch_dtype(self, ir_dtype: str):
        return self._map.get(ir_dtype, self.compute)

    def prepare_params(self, arrays: dict[str, Any]) -> dict[str, Any]:
        torch = _torch()
        out = {}
        for name, a in arrays.items():
            decl = self.module.params.get(name)
            dt = self.torch_dtype(decl.type.dtype) if decl is not None else self.compute
            t = a if isinstance(a, torch.Tensor) else torch.as_tensor(a)
            out[name] = t.to(device=self.tdev, dtype=dt)
        return out

    def _post(self, op: Operation, outs: list) -> list:
        torch = _torch()
        res = []
        for r, x in zip(op.results, outs):
            if isinstance(r.type, TensorType) and isinstance(x, torch.Tensor):
                want = self.torch_dtype(r.type.dtype)
                if x.dtype != want:
                    x = x.to(want)
            elif isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.f32:
                x = x.to(self.f32)           # states stay fp32
            res.append(x)
        return res

    def run(self, function: str, args: list[Any], params: dict[str, Any]) -> list[Any]:
        torch = _torch()
        targs = []
        for a, spec in zip(args, self.module.functions[function].args):
            t = a if isinstance(a, torch.Tensor) else torch.as_tensor(a)
            if isinstance(spec.type, TensorType):
                t = t.to(device=self.tdev, dtype=self.torch_dtype(spec.type.dtype))
            else:
                t = t.to(device=self.tdev, dtype=self.f32)
            targs.append(t)
        interp = Interpreter(self.module, self.table, params.__getitem__, post=self._post)
        return interp.run(function, targs)

    def to_numpy(self, x: Any):
        return x.detach().to("cpu", _torch().float64 if x.is_floating_point() else x.dtype).numpy()


def _build(module: Module, dtype: str = "float32", device: str = "cpu", mesh: Any = None) -> TorchExecutable:
    return TorchExecutable(module, dtype, device, mesh)


def _table() -> dict:
    from .ops import TABLE
    return TABLE


def _pipeline() -> list[str]:
    from k3ir.passes.pipelines import pipeline_for
    return pipeline_for("torch")


def _available() -> str | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        return "PyTorch is not installed (pip install torch)"
    return None


register_backend(Backend(name="torch", description="eager PyTorch (CPU/CUDA), autograd", build=_build,
                         pipeline=_pipeline(), table=_table, available=_available))
