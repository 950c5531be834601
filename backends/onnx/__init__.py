"""The ``onnx`` target: export each entry function to a standard ONNX model (``export.py``,
lowering table in ``lowering.py``; opset 27 by default, ``OnnxExecutable.opset = 20`` for the
``Scan`` lowering of older runtimes) and run it with onnxruntime on CPU. Prefill/decode states are
graph inputs and outputs (``present.<state>``). ``save(dir)`` writes a reloadable artifact
(one ``.onnx`` per function sharing ``weights.bin``); ``load_executable`` (``load_artifact``) reads it back
without re-exporting (``Session.load``)."""
from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np

from k3ir.errors import K3BackendError
from k3ir.ir import Module

from .. import Backend, Executable, register_backend
from ..artifact import ARTIFACT, artifact_file, write_manifest  # noqa: F401 (re-exported)
from .export import LOGITS_TO_KEEP, OnnxExporter, check_opset
from .lowering import TABLE

FUNCTIONS = ("forward", "prefill", "decode")


def _ort():
    try:
        import onnxruntime
    except ImportError as e:  # pragma: no cover
        raise K3BackendError("target 'onnx' needs onnxruntime (pip install 'k3ir[onnx]')") from e
    return onnxruntime


def _to_numpy(a, dtype=None):
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    a = np.asarray(a)
    return a.astype(dtype) if dtype is not None and a.dtype != dtype else a


class OnnxExecutable(Executable):
    """Runs ``forward``/``prefill``/``decode`` as onnxruntime sessions (CPU provider, float32).
    Models are exported lazily per function once the weights are known (``prepare_params``), or
    read from an artifact directory (``weights_inside``: the weights are in the files).
    ``opset``: 27 or 20 (None: ``export.default_opset()``); ``ort_kernels`` (default True): opset 27's
    ``LinearAttention``/``CausalConvWithState`` in onnxruntime's ``com.microsoft`` domain, run by its
    native kernels (``OnnxExporter``); False keeps the standard ops; ``moe_form`` (None: by expert count)
    as in ``OnnxExporter``; ``session_config``: entries for ``SessionOptions.add_session_config_entry`` (e.g.
    ``{"session.intra_op.allow_spinning": "0"}`` beside other thread pools in one process). All settable until
    the first run. ``logits_to_keep`` (fed on every run; default 0): the trailing positions that get logits,
    0 for all of them, so ``prefill`` returns ``[B,T,V]`` like every target; 1 for generation (the last position
    only, the exported file's own default: ``OnnxExporter``)."""

    def __init__(self, module: Module, dtype: str = "float32", device: str = "cpu",
                 model_paths: dict[str, str] | None = None, opset: int | None = None):
        if dtype not in ("float32", "float16"):
            raise K3BackendError(f"target 'onnx' runs float32 or float16, not '{dtype}'")
        if device != "cpu":
            raise K3BackendError(f"target 'onnx' runs on the CPU (onnxruntime), not '{device}'")
        super().__init__(module, "onnx", dtype, device)
        self.model_paths = dict(model_paths or {})
        self.weights_inside = bool(model_paths)
        self._arrays: dict[str, np.ndarray] | None = None
        self._sessions: dict[str, Any] = {}
        self.threads = 0
        self.opset = check_opset(opset)
        self.ort_kernels = True
        self.moe_form: str | None = None
        self.session_config: dict[str, str] = {}
        self.logits_to_keep = 0
        self._keeps: dict[str, bool] = {}           # function -> its session has the logits_to_keep input

    def prepare_params(self, arrays: dict[str, Any]) -> dict[str, Any]:
        if self.weights_inside and not arrays:
            return {}
        self._arrays = {k: _to_numpy(v, np.float32 if np.asarray(_to_numpy(v)).dtype.kind == "f" else None)
                        for k, v in arrays.items()}
        self._sessions.clear()
        self.weights_inside = False
        return self._arrays

    def model(self, function: str):
        """The ``onnx.ModelProto`` of ``@function`` with the prepared weights embedded."""
        return OnnxExporter(self.module, self.dtype, weights="embedded", params=self._arrays,
                            opset=self.opset, ort_kernels=self.ort_kernels,
                            moe_form=self.moe_form).export_function(function)

    def session(self, function: str):
        if function not in self._sessions:
            ort = _ort()
            so = ort.SessionOptions()
            so.log_severity_level = 3
            if self.threads:
                so.intra_op_num_threads = self.threads
            for key, value in self.session_config.items():
                so.add_session_config_entry(key, value)
            if self.weights_inside:
                if function not in self.model_paths:
                    raise K3BackendError(f"artifact has no model for '@{function}'")
                src = self.model_paths[function]
            else:
                if self._arrays is None:
                    raise K3BackendError("onnx executable: call prepare_params before run")
                src = self.model(function).SerializeToString()
            sess = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
            inputs = [*sess.get_inputs(), *sess.get_overridable_initializers()]   # (earlier files: an initializer)
            self._keeps[function] = any(i.name == LOGITS_TO_KEEP for i in inputs)
            self._sessions[function] = sess
        return self._sessions[function]

    def feeds(self, function: str, args: list[Any]) -> dict[str, np.ndarray]:
        """The onnxruntime feeds of ``@function`` for ``args`` (as ``run`` takes them): each argument under its
        input's name as that input's dtype, and ``logits_to_keep`` where the model has that input."""
        sess = self.session(function)
        feeds = {}
        for spec, a in zip(sess.get_inputs(), args):
            want = np.int64 if spec.type == "tensor(int64)" else (np.float16 if "float16" in spec.type else np.float32)
            feeds[spec.name] = _to_numpy(a, want)
        if self._keeps.get(function):
            feeds[LOGITS_TO_KEEP] = np.asarray(self.logits_to_keep, np.int64)
        return feeds

    def run(self, function: str, args: list[Any], params: dict[str, Any]) -> list[Any]:
        return self.session(function).run(None, self.feeds(function, args))

    def to_numpy(self, x: Any):
        return np.asarray(x)

    def save(self, directory: str, params: dict[str, Any] | None = None) -> str:
        """Write the artifact: ``<fn>.onnx`` per function, weights in ``weights.bin`` (external
        data shared by all functions), ``module.k3`` and ``manifest.json``. ``params`` defaults
        to the prepared weights. Returns the directory."""
        import onnx

        params = params if params is not None else self._arrays
        if params is None:
            raise K3BackendError("onnx executable: no weights to save (pass params or call prepare_params)")
        os.makedirs(directory, exist_ok=True)
        x = OnnxExporter(self.module, self.dtype, weights="external", params=params, opset=self.opset,
                         ort_kernels=self.ort_kernels, moe_form=self.moe_form)
        files = {}
        with open(os.path.join(directory, "weights.bin"), "wb") as f:
            for fn in FUNCTIONS:
                if fn in self.module.functions:
                    model = x.export_function(fn, external_path="weights.bin", external_file=f)
                    onnx.save_model(model, os.path.join(directory, f"{fn}.onnx"))
                    files[fn] = f"{fn}.onnx"
        write_manifest(directory, self.module, "onnx", self.dtype, files, data_files=("weights.bin",))
        return directory


def load_executable(directory: str, man: dict, module: Module) -> OnnxExecutable:
    """Reopen an artifact written by ``OnnxExecutable.save`` from its checked manifest ``man`` and IR ``module``
    (``artifact.read_manifest``), no re-export."""
    paths = {fn: artifact_file(directory, man, fn) for fn in man["files"]}
    return OnnxExecutable(module, man["dtype"], "cpu", model_paths=paths)


def _build(module: Module, dtype: str = "float32", device: str = "cpu") -> OnnxExecutable:
    return OnnxExecutable(module, dtype, device)


def _table():
    return TABLE


def _available() -> str | None:
    for pkg, pip in (("onnx", "onnx"), ("onnxruntime", "onnxruntime")):
        if importlib.util.find_spec(pkg) is None:
            return f"{pip} is not installed (pip install 'k3ir[onnx]')"
    return None


register_backend(Backend(name="onnx", description="standard ONNX (opset 27, or 20) run by onnxruntime (CPU)",
                         build=_build, pipeline=["dce"], table=_table, available=_available,
                         functions=FUNCTIONS, dtypes=("float32", "float16"), load_artifact=load_executable))
