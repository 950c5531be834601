"""Session: parameters + a compiled Executable + explicit state for prefill/decode/generate."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3ir.errors import K3RuntimeError
from k3ir.types import StateType

from .params import bound_params, check_seed, init_params


@dataclass
class State:
    """Per-sequence model state after some tokens: KDA conv + recurrent state per KDA layer and
    the MLA latent cache per MLA layer, in the order of the ``prefill``/``decode`` signature.
    ``values[name]`` is the backend's array: conv ``[B, H*D, K-1]``, recurrent ``f32[B,H,K,V]``,
    MLA cache ``[B, L, kv_lora_rank + rope]``. ``length`` counts tokens consumed."""
    values: dict[str, Any]
    length: int
    batch: int
    names: list[str] = field(default_factory=list)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]


def _check_shapes(module, params: dict[str, Any]) -> None:
    """K3RuntimeError naming the first parameter whose array shape differs from its declaration
    (packed 4-bit weights and their scales are stored in other shapes and are skipped)."""
    for name, decl in module.params.items():
        if decl.type.dtype in ("mxfp4", "int4") or decl.attrs.get("role") == "scale":
            continue
        shape = getattr(params[name], "shape", None)
        want = tuple(int(d) for d in decl.type.shape)
        if shape is not None and tuple(int(d) for d in shape) != want:
            raise K3RuntimeError(f"parameter '{name}' has shape {list(shape)}, the model declares {list(want)}")


class Session:
    """Run a compiled model.

    ``Session(executable, params=None, seed=0)``: ``params=None`` uses the weights bound to the
    module (a loaded checkpoint) or, if none, a deterministic random init from ``seed``.
    Token ids are ``LongTensor[B, T]``, integer arrays or nested lists; logits come back as torch
    tensors ``[B, T, vocab]`` (float32, float64 on the reference target). ``generate`` with
    ``max_new_tokens=0`` returns the ids unchanged. ``prefill_chunk``: ``prefill`` feeds longer inputs in
    segments of this many tokens (a positive multiple of the KDA chunk 64), the state carried between them,
    so activations stay bounded by one segment. K3RuntimeError for a non-integer ``seed`` or a bad
    ``prefill_chunk``."""

    def __init__(self, executable, params: dict[str, Any] | None = None, seed: int = 0, prefill_chunk: int = 2048):
        check_seed(seed)
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)) \
                or prefill_chunk <= 0 or prefill_chunk % 64:
            raise K3RuntimeError(f"prefill_chunk must be a positive multiple of the KDA chunk 64, got {prefill_chunk!r}")
        self.prefill_chunk = int(prefill_chunk)           # also when bound or given weights leave it unused: a bad seed is a caller bug
        if not (hasattr(executable, "module") and callable(getattr(executable, "run", None))):
            hint = (": use Session(k3ir.compile(k3ir.load(...))) or Session.load(DIR)"
                    if isinstance(executable, str) else "")
            raise K3RuntimeError(f"Session takes an Executable (from k3ir.compile), got "
                                 f"{type(executable).__name__}{hint}")
        if params is not None and not isinstance(params, dict):
            raise K3RuntimeError(f"Session: params must be a dict (name -> array) or None, got {type(params).__name__}")
        self.exe = executable
        self.module = executable.module
        if params is None and getattr(executable, "weights_inside", False):
            self.params = self.exe.prepare_params({})      # a loaded artifact that holds its weights
        else:
            if params is None:
                params = bound_params(self.module)
            if params is None:
                params = init_params(self.module, seed)
            missing = [k for k in self.module.params if k not in params]
            if missing:
                raise K3RuntimeError(f"{len(missing)} parameters missing, e.g. '{missing[0]}'")
            _check_shapes(self.module, params)
            self.params = self.exe.prepare_params({k: params[k] for k in self.module.params})
        self.vocab = int(self.module.attrs.get("vocab_size", 0))
        pre = self.module.functions.get("prefill")
        self.state_specs: list[tuple[str, StateType]] = (
            [(a.name, a.type) for a in pre.args[1:]] if pre is not None else [])

    @classmethod
    def load(cls, directory: str, params: dict[str, Any] | None = None, seed: int = 0) -> Session:
        """A Session over a compiled artifact directory (``k3ir compile ... -o DIR``) without
        recompiling: ``DIR/manifest.json`` names the registered target whose backend reopens the
        executable (``Backend.load_artifact``); weights stored in the artifact are used unless ``params``
        is given. A manifest is data: it never names code to run (docs/artifacts.md).
        Raises K3RuntimeError when DIR is not an artifact, is of another artifact format version (re-compile
        it), names an unknown target or a ``"loader"`` callable, or is damaged (manifest.json not JSON, a file
        missing, truncated or unreadable), naming the file and the problem; K3BackendError when its target
        cannot run here (a missing pip extra)."""
        import os

        from k3ir.backends.artifact import DAMAGED as redo
        from k3ir.backends.artifact import open_artifact

        from k3ir.errors import K3Error
        if not isinstance(directory, (str, os.PathLike)):
            raise K3RuntimeError(f"Session.load: directory must be a path (str), got {type(directory).__name__}")
        directory = os.fspath(directory)
        try:
            exe = open_artifact(directory)
        except (K3Error, ModuleNotFoundError):     # already clear / the CLI names the extra to install
            raise
        except FileNotFoundError as e:             # safetensors names the file only in its text
            name = e.filename or str(e).rpartition("No such file or directory: ")[2].strip() or directory
            raise K3RuntimeError(f"{name}: missing from the artifact; {redo}") from None
        except Exception as e:                     # truncated weights, an emptied .so, a bad manifest entry...
            raise K3RuntimeError(f"{directory}: cannot open the artifact ({type(e).__name__}: "
                                 f"{str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}); {redo}") from e
        return cls(exe, params=params, seed=seed)

    # ---- helpers -----------------------------------------------------------------
    def _ids(self, ids, what: str = "input_ids") -> np.ndarray:
        try:
            import torch
            if isinstance(ids, torch.Tensor):
                ids = ids.detach().cpu().numpy()
        except ImportError:
            pass
        if ids is None or isinstance(ids, (str, bytes)):
            raise K3RuntimeError(f"{what} must be token ids [B, T] (a LongTensor, an integer array or nested lists), "
                                 f"got {type(ids).__name__}")
        try:
            a = np.asarray(ids)
        except (ValueError, TypeError):
            a = None
        if a is None or a.dtype == object:
            lens = sorted({len(r) for r in ids if hasattr(r, "__len__")}) if isinstance(ids, (list, tuple)) else []
            raise K3RuntimeError(f"{what} must be a rectangular [B, T] array of token ids"
                                 + (f"; the rows have different lengths {lens}" if len(lens) > 1 else ""))
        if a.ndim != 2:
            raise K3RuntimeError(f"{what} must be [B, T], got shape {list(a.shape)}")
        if a.shape[0] < 1 or a.shape[1] < 1:
            raise K3RuntimeError(f"{what} is empty (shape {list(a.shape)})")
        if a.dtype.kind not in "iu":
            raise K3RuntimeError(f"{what} must be integer token ids, got {a.dtype}")
        if self.vocab and (a.min() < 0 or a.max() >= self.vocab):
            bad = int(a.max() if a.max() >= self.vocab else a.min())
            raise K3RuntimeError(f"{what} holds token id {bad} outside the vocabulary 0..{self.vocab - 1}")
        return a.astype(np.int64)

    def _out(self, x):
        import torch
        if isinstance(x, torch.Tensor):
            return x
        return torch.from_numpy(np.asarray(x))

    def empty_state(self, batch: int) -> State:
        from k3ir.ops.state import zero_state
        vals = {}
        for name, st in self.state_specs:
            z = zero_state(st, batch)
            vals[name] = z if self.exe.target == "reference" else self._to_backend_state(z)
        return State(vals, 0, batch, [n for n, _ in self.state_specs])

    def _to_backend_state(self, z):
        """The backend tensor of the zero state ``z`` (only its shape is used): float32 zeros allocated on the
        executable's device (a host array copied over would be a pageable copy per state, 8 MB per KDA layer at
        B8, that stalls the stream)."""
        import torch
        return torch.zeros(z.shape, dtype=torch.float32, device=getattr(self.exe, "tdev", None))

    # ---- API ------------------------------------------------------------------------
    def forward(self, input_ids, images=None):
        """Logits ``[B, T, vocab]`` for whole sequences (training path, no state). ``images``
        (kimi_k3 with a vision tower): ``[N, 3, H, W]`` or a list of ``[3, H, W]``, pixel values
        0..255; their features replace the media placeholder tokens in order (SPEC.md 8)."""
        ids = self._ids(input_ids)
        if images is not None:
            (logits,) = self.exe.run("forward_media", [ids, self.image_features(images)], self.params)[:1]
            return self._out(logits)
        (logits,) = self.exe.run("forward", [ids], self.params)[:1]
        return self._out(logits)

    def prefill(self, input_ids, state: State | None = None, images=None):
        """Consume ``input_ids [B, T]`` from ``state`` (None: empty), in segments of ``prefill_chunk``
        tokens when longer (without ``images``). Returns (logits ``[B, T, V]``, new state). ``images`` as in
        ``forward``."""
        ids = self._ids(input_ids)
        if images is not None:
            return self._step("prefill_media", ids, state, extra=[self.image_features(images)])
        if ids.shape[1] <= self.prefill_chunk:
            return self._step("prefill", ids, state)
        out = None                  # segments on the KDA chunk grid of a one-shot prefill: same results
        for s0 in range(0, ids.shape[1], self.prefill_chunk):
            logits, state = self._step("prefill", ids[:, s0:s0 + self.prefill_chunk], state)
            if out is None:         # filled in place: no second copy of the [B, T, V] logits
                out = logits.new_empty((ids.shape[0], ids.shape[1], logits.shape[-1]))
            out[:, s0:s0 + logits.shape[1]] = logits
        return out, state

    def image_features(self, images):
        """Projected image features ``[M, hidden]`` (backend array) for ``images`` (see ``forward``):
        the peer's preprocessing, then ``@encode_images`` per group of equal grids, concatenated
        in image order (each image gives ``GH/2 * GW/2`` rows, row-major). Raises K3RuntimeError
        when the model has no vision tower or an image is malformed."""
        from k3ir.frontend.vision import preprocess_images, vision_spec
        cfg = getattr(self.module, "config", None)
        if "encode_images" not in self.module.functions or cfg is None or cfg.vision is None:
            raise K3RuntimeError("this model has no vision tower (no vision_config): images are not accepted")
        spec = vision_spec(cfg.vision, cfg.hidden_size, cfg.path)
        grids = preprocess_images(images, spec)
        feats: list = [None] * len(grids)
        for shape in dict.fromkeys(g.shape for g in grids):
            idx = [i for i, g in enumerate(grids) if g.shape == shape]
            (out,) = self.exe.run("encode_images", [np.stack([grids[i] for i in idx])], self.params)
            for j, i in enumerate(idx):
                feats[i] = out[j].reshape(-1, out.shape[-1])
        if isinstance(feats[0], np.ndarray):
            return np.concatenate(feats, axis=0)
        import torch
        return torch.cat(feats, dim=0)

    def _device_ids(self, ids, what: str):
        """``ids`` unchanged (as int64) when it is an integer torch tensor already on the executable's accelerator
        (e.g. the argmax of the previous logits): it stays there, no host round trip and no host sync. Its shape
        and dtype are checked; its values are not (that would wait for the GPU). None for anything else."""
        dev = getattr(self.exe, "tdev", None)
        try:
            import torch
        except ImportError:
            return None
        if not (isinstance(ids, torch.Tensor) and ids.device.type != "cpu" and dev is not None
                and torch.device(dev).type == ids.device.type):
            return None
        if ids.dim() != 2:
            raise K3RuntimeError(f"{what} must be [B, T], got shape {list(ids.shape)}")
        if ids.shape[0] < 1 or ids.shape[1] < 1:
            raise K3RuntimeError(f"{what} is empty (shape {list(ids.shape)})")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise K3RuntimeError(f"{what} must be integer token ids, got {ids.dtype}")
        return ids.to(torch.int64)

    def decode(self, token_ids, state: State):
        """One token per row: ``token_ids [B, 1]`` (host ids are range-checked; an integer tensor on the
        executable's GPU stays there without a host sync and is not range-checked). Returns (logits ``[B,1,V]``,
        new state)."""
        ids = self._device_ids(token_ids, "token_ids")
        if ids is None:
            ids = self._ids(token_ids, "token_ids")
        if ids.shape[1] != 1:
            raise K3RuntimeError(f"decode takes one token per row ([B, 1]), got {list(ids.shape)}")
        if state is None:
            raise K3RuntimeError("decode needs the state returned by prefill")
        return self._step("decode", ids, state)

    def _check_state(self, state) -> None:
        """K3RuntimeError unless ``state`` is a State with this model's state names."""
        if not isinstance(state, State):
            raise K3RuntimeError(f"state must be the State returned by prefill/decode (or empty_state), "
                                 f"got {type(state).__name__}")
        want = [n for n, _ in self.state_specs]
        if list(state.names) != want or any(n not in state.values for n in want):
            missing = [n for n in want if n not in state.values or n not in state.names]
            extra = [n for n in state.names if n not in want]
            detail = f"missing '{missing[0]}'" if missing else f"unexpected '{extra[0]}'" if extra else "order differs"
            raise K3RuntimeError(f"state does not belong to this model ({detail}; want {len(want)} entries "
                                 f"{want[:2]}...)")

    def _step(self, fn: str, ids: np.ndarray, state: State | None, extra: list | None = None):
        B = ids.shape[0]
        if state is None:
            state = self.empty_state(B)
        self._check_state(state)
        if state.batch != B:
            raise K3RuntimeError(f"state holds batch {state.batch}, input has batch {B}")
        outs = self.exe.run(fn, [ids] + list(extra or []) + [state.values[n] for n in state.names], self.params)
        new = State(dict(zip(state.names, outs[1:])), state.length + ids.shape[1], B, state.names)
        return self._out(outs[0]), new

    def generate(self, input_ids, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 eos_token_id: int | None = None):
        """Prefill then decode ``max_new_tokens`` tokens per row; greedy when ``temperature == 0``
        (deterministic), else sampled from ``softmax(logits / temperature)`` with ``seed``.
        Returns ``LongTensor[B, T + new]``. Rows that emit ``eos_token_id`` keep emitting it."""
        import torch
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
            raise K3RuntimeError(f"max_new_tokens must be an integer, got {type(max_new_tokens).__name__} "
                                 f"{max_new_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.integer, np.floating)) \
                or np.isnan(temperature):
            raise K3RuntimeError(f"temperature must be a number >= 0, got {type(temperature).__name__} {temperature!r}")
        if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, (int, np.integer))):
            raise K3RuntimeError(f"eos_token_id must be an integer or None, got {type(eos_token_id).__name__} "
                                 f"{eos_token_id!r}")
        check_seed(seed)
        if max_new_tokens < 0:
            raise K3RuntimeError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise K3RuntimeError(f"temperature must be >= 0, got {temperature}")
        ids = self._ids(input_ids)
        out = torch.from_numpy(ids)
        if max_new_tokens == 0:
            return out
        gen = torch.Generator().manual_seed(seed)
        logits, state = self.prefill(ids)
        try:
            if temperature == 0:
                res = torch.cat([out, self._greedy(logits, state, max_new_tokens, eos_token_id)], dim=1)
            else:
                res = host_token_loop(self.decode, out, logits, state, max_new_tokens, temperature, eos_token_id, gen)
        except K3RuntimeError as e:        # non-finite logits: name the KDA gates behind them, if any
            bad = gate_flag_message(self.exe)
            if bad:
                raise K3RuntimeError(bad) from e
            raise
        bad = gate_flag_message(self.exe)  # the tokens are on the host: the device is idle, reading is cheap
        if bad:
            raise K3RuntimeError(bad)
        return res

    def _greedy(self, logits, state: State, steps: int, eos_token_id: int | None):
        """Greedy tokens ``LongTensor[B, steps]`` (CPU) after the prefill ``logits``: each token is the argmax of
        the last logits (lower index on ties), picked where the logits live, so on a GPU the ids go back into
        ``decode`` without a host round trip and the steps queue without waiting for each other (one copy to the
        host at the end). Rows that emitted ``eos_token_id`` keep emitting it. Same tokens as an argmax of the
        logits on the host (float64 holds every float32/bf16 value exactly: same order)."""
        import torch
        toks, peaks = [], []
        done = None
        for step in range(steps):
            peak, nxt = torch.max(logits[:, -1].detach(), dim=-1)     # one kernel: argmax and its value
            nxt = nxt.to(torch.int64)
            peaks.append(peak)
            if eos_token_id is not None:
                done = torch.zeros_like(nxt, dtype=torch.bool) if done is None else done
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done = done | (nxt == eos_token_id)
            toks.append(nxt)
            if step + 1 < steps:
                logits, state = self.decode(nxt[:, None], state)
        # a NaN anywhere in a row makes its max NaN, +inf makes it inf, an all -inf row -inf: one host check at the
        # end instead of a sync per step
        peaks = torch.stack(peaks, dim=1).cpu()
        finite = torch.isfinite(peaks)
        if not bool(finite.all()):
            step = int((~finite).any(dim=0).nonzero()[0, 0])
            _nonfinite_error(peaks[:, step:step + 1], finite[:, step], step, steps)
        return torch.stack(toks, dim=1).cpu()


def gate_flag_message(exe) -> str | None:
    """The error for the non-finite KDA gates the triton executable ``exe`` reported on a device since it was
    last asked (``TritonExecutable.take_gate_flags``; a copy to the host, so call it where the host waits anyway);
    None when there are none (or ``exe`` does not report them)."""
    take = getattr(exe, "take_gate_flags", None)
    return gate_flag_text(take() if take is not None else [])


def gate_flag_text(hits) -> str | None:
    """The message for ``(launch, row, head)`` hits of ``take_gate_flags``; None for none."""
    if not hits:
        return None
    where = ", ".join(f"launch {i} row {n} head {h}" for i, n, h in hits[:4]) + (" ..." if len(hits) > 4 else "")
    return (f"a KDA layer's gate inputs are not finite (NaN, or a positive precomputed log-decay) at {where} "
            f"(KDA launches of the model's calls, batch row, head): its outputs are NaN")


def host_token_loop(decode, out, logits, state, steps: int, temperature: float, eos_token_id: int | None, gen):
    """The token loop of ``generate`` on the host: ``steps`` tokens picked from the last ``logits`` (greedy when
    ``temperature == 0``, lower index on ties; else sampled from ``softmax(logits / temperature)`` with the
    ``torch.Generator`` ``gen``), each fed back through ``decode(ids, state) -> (logits, state)``; rows that emit
    ``eos_token_id`` keep emitting it. ``out`` (``LongTensor[B, T]``, CPU) gains ``steps`` columns. Raises
    K3RuntimeError naming the step when a row's logits are not finite."""
    import torch
    done = torch.zeros(out.shape[0], dtype=torch.bool)
    for step in range(steps):
        last = logits[:, -1].detach().to("cpu", torch.float64)
        finite = torch.isfinite(last.max(dim=-1).values)            # NaN or +inf anywhere, or all -inf
        if not bool(finite.all()):
            _nonfinite_error(last, finite, step, steps)
        if temperature == 0:
            nxt = torch.argmax(last, dim=-1)
        else:
            nxt = torch.multinomial(torch.softmax(last / temperature, dim=-1), 1, generator=gen)[:, 0]
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
            done |= nxt == eos_token_id
        out = torch.cat([out, nxt[:, None]], dim=1)
        if step + 1 < steps:
            logits, state = decode(nxt[:, None].numpy(), state)
    return out


def _nonfinite_error(last, finite_rows, step: int, steps: int):
    """Raise K3RuntimeError for non-finite logits at 0-based ``step`` (``last``: the step's logits ``[B, V]`` or
    their row maxima ``[B, 1]``; ``finite_rows``: bool ``[B]``)."""
    import torch
    row = int((~finite_rows).nonzero()[0, 0])
    vals = last[row]
    kind = "nan" if bool(torch.isnan(vals).any()) else "inf" if bool(torch.isposinf(vals).any()) else "-inf everywhere"
    raise K3RuntimeError(f"the model's logits are not finite ({kind}) at generation step {step + 1} of {steps} "
                         f"(batch row {row}): the weights or the config give NaN/inf; no token was sampled")
