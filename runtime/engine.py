"""Serving engine: continuous batching of prefill and decode over a Session, backed by one paged
state pool with a prefix cache (SPEC.md 9).

Design (simplest correct one; see bench/SERVING.md):
- Every running request owns a block table in the ``StatePool``: its MLA latents live in pool
  pages, its KDA states (fixed size) are kept per request and snapshotted into the pool at every
  block boundary. Full blocks are published under chained hashes; a new request whose prompt
  starts with cached blocks retains them and resumes from the last one's snapshot.
- Prefill is chunked at block boundaries (a segment never crosses one, so the snapshot there is
  exact) and every segment starts on the 64-token KDA chunk grid of a fresh prefill (a segment cut by
  ``max_prefill_tokens`` ends on it), so a prefill in segments rounds like a one-shot one; a decode
  step feeds one token. Each ``step()`` runs every running request once: prefill segments grouped by
  length ``T`` and MLA cache length (a cache right-padded to a longer row's changes the float32 sums),
  all decode rows in one call.
- Decode rows of one call have different MLA cache lengths: with the module's ``@prefill_varlen``
  (``frontend.model.add_varlen_function``; ``build_engine`` adds it) caches are right-padded to
  the longest and ``k3.mla`` masks each row at its own length. Without it, rows are grouped by
  equal cache length (correct, less batching).
- The prefix cache holds only states a chunked prefill computed: a block holding generated tokens
  (whose states came from decode steps, rounded otherwise) is published when its request ends
  (``stop`` or ``length``), after its generated tokens were prefilled again from the last state on the
  chunk grid (``stats["cache_prefill_tokens"]``), so a hit equals a fresh prefill of the whole text.
- Requests join between steps (admission reserves the blocks their prompt + ``max_tokens`` can
  need, so a running request never runs out) and leave when they hit a stop token or
  ``max_tokens``; their blocks are released (cached prefixes stay, LRU-evictable).
- With a host tier (``host_cache_bytes`` > 0) evicted cached blocks move to host memory, and a
  finished request leaves its tails there: the rows of a partial block up to the last KDA chunk
  boundary (a multiple of 64 tokens) of its prompt and of the tokens it fed, with the KDA states there
  (the prompt's is kept by ending a prefill segment on that boundary), so the next turn of a chat
  resumes at most 63 tokens before where it stopped, on the chunk grid of a fresh prefill.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3ir.errors import K3RuntimeError

from .pool import KDA_CHUNK, StatePool, block_hashes
from .sampler import SamplingParams, make_generator, sample
from .session import gate_flag_text

log = logging.getLogger("k3ir.engine")
VARLEN = "prefill_varlen"
_ids = itertools.count()


def engine_size_problem(block_size: Any = 512, num_blocks: Any = None, max_batch: Any = 32,
                        max_prefill_tokens: Any = 4096, names: dict[str, str] | None = None,
                        host_cache_bytes: Any = 0) -> str | None:
    """Why these ``Engine`` sizes cannot work (None when they can): ``block_size`` a positive
    multiple of the KDA chunk (64), ``num_blocks`` (None = default) / ``max_batch`` /
    ``max_prefill_tokens`` integers >= 1, ``host_cache_bytes`` an integer >= 0. ``names`` renames the arguments in the message
    (the CLI passes its flags)."""
    from .pool import KDA_CHUNK
    names = names or {}

    def bad_int(v) -> bool:
        return isinstance(v, bool) or not isinstance(v, (int, np.integer))

    n = names.get("block_size", "block_size")
    if bad_int(block_size) or block_size <= 0 or block_size % KDA_CHUNK:
        return f"{n} must be a positive multiple of the KDA chunk {KDA_CHUNK} (pool block in tokens), got {block_size!r}"
    for key, v in (("num_blocks", num_blocks), ("max_batch", max_batch), ("max_prefill_tokens", max_prefill_tokens)):
        if key == "num_blocks" and v is None:
            continue
        if bad_int(v) or v < 1:
            return f"{names.get(key, key)} must be an integer >= 1, got {v!r}"
    if bad_int(host_cache_bytes) or host_cache_bytes < 0:
        return f"{names.get('host_cache_bytes', 'host_cache_bytes')} must be an integer >= 0, got {host_cache_bytes!r}"
    return None


def max_positions(module) -> int | None:
    """``max_position_embeddings`` of ``module``'s config (top level or ``text_config``) when a positive
    integer, else None."""
    raw = getattr(getattr(module, "config", None), "raw", None) or {}
    for d in (raw, raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}):
        v = d.get("max_position_embeddings")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


@dataclass(eq=False)
class Request:
    """One generation request. ``prompt`` token ids; ``output`` grows as tokens are sampled;
    ``finish_reason`` is ``stop`` (stop token), ``length`` (max_tokens), ``abort`` or ``error``.
    ``on_event(request, token)`` is called from the engine's thread for every new token and once
    more with ``token=None`` when the request finishes."""
    prompt: list[int]
    params: SamplingParams
    id: str = ""
    on_event: Callable[[Request, int | None], None] | None = None
    keep_logits: bool = False
    output: list[int] = field(default_factory=list)
    status: str = "waiting"
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0
    logits: list[Any] = field(default_factory=list)        # [V] rows sampled from (keep_logits)
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    cancelled: bool = False
    # engine internals
    length: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    reserve: int = 0
    kda: dict[str, Any] | None = None
    prompt_kda: dict[str, Any] | None = None
    generator: Any = None

    @property
    def done(self) -> bool:
        return self.status == "finished"

    def fed_token(self, pos: int) -> int:
        return self.prompt[pos] if pos < len(self.prompt) else self.output[pos - len(self.prompt)]


class Engine:
    """Continuous-batching engine over ``session`` (a ``runtime.Session``).

    ``block_size`` tokens per pool block (multiple of 64; default 512); ``num_blocks`` pool size
    (default: enough for ``max_batch`` requests of 2048 tokens); ``max_batch`` running requests;
    ``max_prefill_tokens`` prompt tokens per step (segments it cuts end on the 64-token KDA chunk grid;
    the first prefill segment of a step runs at least one chunk);
    ``stop_token_ids`` end every request (default: the model's ``eos_token_id``);
    ``host_cache_bytes``: byte budget of the prefix cache's host tier (0: none; see ``StatePool``).
    ``observers``: callables ``(request, token | None)`` called like each request's ``on_event``
    (metrics). Single-threaded: call ``add_request``/``step`` from one thread (``EngineThread`` does).
    Raises K3RuntimeError for bad sizes (``engine_size_problem``) or a session without states."""

    def __init__(self, session, block_size: int = 512, num_blocks: int | None = None, max_batch: int = 32,
                 max_prefill_tokens: int = 4096, stop_token_ids: Sequence[int] | None = None,
                 host_cache_bytes: int = 0):
        import torch
        why = engine_size_problem(block_size, num_blocks, max_batch, max_prefill_tokens,
                                  host_cache_bytes=host_cache_bytes)
        if why:
            raise K3RuntimeError(why)
        self.session = session
        self.exe = session.exe
        self.specs = list(session.state_specs)
        if not self.specs:
            raise K3RuntimeError("the compiled module has no @prefill function with state arguments")
        self.names = [n for n, _ in self.specs]
        self.varlen = VARLEN in self.exe.module.functions
        self.device = getattr(self.exe, "tdev", None) or torch.device("cpu")
        self.dtype = torch.float64 if self.exe.target == "reference" else torch.float32
        if num_blocks is None:
            num_blocks = max_batch * max(1, -(-2048 // block_size)) + 8
        self.pool = StatePool(self.specs, num_blocks, block_size, self.device, self.dtype,
                              salt=str(session.module.name).encode(), host_bytes=host_cache_bytes)
        self.observers: list[Callable[[Request, int | None], None]] = []
        self.bs = block_size
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        eos = session.module.attrs.get("eos_token_id")
        self.stop_ids = set(stop_token_ids if stop_token_ids is not None else ([] if eos is None else [eos]))
        self.vocab = session.vocab
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved = 0
        self._recent: list[Request] = []
        self.stats = {"steps": 0, "calls": 0, "rows": 0, "prefill_tokens": 0, "decode_tokens": 0,
                      "finished": 0, "aborted": 0, "failed": 0,     # aborted: cancelled (client gone, stop string)
                      "cache_prefill_tokens": 0}    # generated tokens prefilled again for the prefix cache
        zero = session.empty_state(1)
        self._zero = {n: self._t(zero.values[n]) for n in self.pool.kda_names}

    def _t(self, x):
        import torch
        return torch.as_tensor(x).to(self.device, self.dtype)

    # ---- requests ----------------------------------------------------------------------
    def make_request(self, prompt: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None,
                     on_event=None, keep_logits: bool = False) -> Request:
        """Validate and wrap a request (no engine state is touched: safe from any thread).
        Raises K3RuntimeError for an empty prompt, ids outside the vocabulary, or a request
        longer than the whole pool."""
        params = params or SamplingParams()
        ids = [int(t) for t in prompt]
        if not ids:
            raise K3RuntimeError("prompt is empty: give at least one token")
        bad = [t for t in ids if t < 0 or (self.vocab and t >= self.vocab)]
        if bad:
            raise K3RuntimeError(f"prompt holds token id {bad[0]} outside the vocabulary 0..{self.vocab - 1}")
        need = -(-(len(ids) + params.max_tokens) // self.bs)
        if need > self.pool.num_blocks:
            room = self.pool.num_blocks * self.bs
            raise K3RuntimeError(f"prompt {len(ids)} + max_tokens {params.max_tokens} tokens do not fit the pool of "
                                 f"{room} tokens ({self.pool.num_blocks} blocks of {self.bs}): max_tokens can be at "
                                 f"most {max(room - len(ids), 0)} for this prompt (or give the pool more blocks)")
        return Request(ids, params, request_id or f"req-{next(_ids)}", on_event, keep_logits)

    def enqueue(self, req: Request) -> Request:
        self.waiting.append(req)
        return req

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None, **kw) -> Request:
        """``make_request`` + ``enqueue``."""
        return self.enqueue(self.make_request(prompt, params, **kw))

    def prompt_limit(self) -> int:
        """The longest prompt served by default: the model's ``max_position_embeddings`` (its config or
        ``text_config``) bounded by the pool's capacity less one token (one must be generated), the capacity
        alone when the config has none."""
        cap = max(1, self.pool.num_blocks * self.bs - 1)
        mpe = max_positions(self.session.module)
        return min(cap, mpe) if mpe else cap

    def block_accounting(self) -> dict[str, int]:
        """Pool references by holder: ``block_refs`` (sum of the pool's reference counts),
        ``request_blocks`` (blocks in running requests' tables), ``leaked_blocks`` (their difference:
        references no request holds), ``reserved`` (blocks set aside for admitted requests' future
        tokens) and ``leaked_reserve`` (reserved minus what running requests still claim). Exact when
        the engine is idle; while it steps in another thread the numbers may be mid-update."""
        running = list(self.running)
        refs = sum(self.pool.refcount)
        held = sum(len(r.blocks) for r in running)
        return {"block_refs": refs, "request_blocks": held, "leaked_blocks": refs - held,
                "reserved": self.reserved, "leaked_reserve": self.reserved - sum(r.reserve for r in running)}

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self, requests: Sequence[Request] | None = None) -> list[Request]:
        """Step until ``requests`` (default: everything queued) are finished; returns them."""
        reqs = list(requests) if requests is not None else list(self.waiting) + list(self.running)
        while any(not r.done for r in reqs):
            if not self.has_work():
                raise K3RuntimeError("requests are not queued on this engine")
            self.step()
        return reqs

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 keep_logits: bool = False) -> list[Request]:
        """Queue ``prompts`` (one ``params`` or one per prompt) and run them to completion."""
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        return self.run([self.add_request(p, sp, keep_logits=keep_logits) for p, sp in zip(prompts, plist)])

    # ---- scheduling --------------------------------------------------------------------
    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.status == "running":
            self.running.remove(req)
        elif req.status == "waiting":
            self.waiting.remove(req)
        if req.blocks and reason != "error":
            if req.prompt_kda is not None:
                self._keep_prompt_tail(req)
            if reason in ("stop", "length"):
                try:
                    self._cache_generated(req)
                except Exception:       # the answer is complete: only its caching is lost
                    log.exception("request %s: caching its generated tokens failed", req.id)
        self.pool.release(req.blocks)
        self.reserved -= req.reserve
        req.blocks, req.reserve, req.kda, req.prompt_kda = [], 0, None, None
        req.status, req.finish_reason, req.error = "finished", reason, error
        req.finished_at = time.perf_counter()
        self.stats["finished"] += 1
        if reason in ("abort", "error"):
            self.stats["aborted" if reason == "abort" else "failed"] += 1
        self._emit(req, None)

    def _prompt_chunk_end(self, req: Request) -> int | None:
        """The last KDA chunk boundary of ``req``'s prompt when a host tier keeps a tail there (it lies
        inside a block: a block boundary is the block's own snapshot), else None."""
        if not self.pool.host_bytes:
            return None
        c = len(req.prompt) - len(req.prompt) % KDA_CHUNK
        return c if c % self.bs else None

    def _keep_prompt_tail(self, req: Request) -> None:
        """Leave ``req``'s prompt-end tail in the host tier: the prompt's rows of its last partial block up
        to the prompt's last KDA chunk boundary and the states there (``req.prompt_kda``, from a prefill)."""
        c = self._prompt_chunk_end(req)
        k = c // self.bs
        if k < len(req.blocks):
            self.pool.keep_tail(req.hashes[:k], req.prompt[k * self.bs:c], req.blocks[k], req.prompt_kda)

    def _cache_generated(self, req: Request) -> None:
        """Prefill ``req``'s fed generated tokens again, for the prefix cache only (the answer is done):
        from the last prompt state on the KDA chunk grid (the prompt-end tail's, else the snapshot at the
        start of the prompt's last block) up to the last block boundary (with a host tier: the last chunk
        boundary) of the tokens fed, in block segments, writing the rows and snapshots over the decode
        steps' in ``req``'s own blocks; then publish the full blocks and, with a host tier, keep the tail.
        A chunked prefill's states, so a hit on them equals a fresh prefill of the whole text."""
        P, bs, pool = len(req.prompt), self.bs, self.pool
        end = req.length - req.length % (KDA_CHUNK if pool.host_bytes else bs)
        if end <= P:                            # no generated token in a block or tail the cache would keep
            return
        if req.prompt_kda is not None:
            pos, kda = self._prompt_chunk_end(req), req.prompt_kda
        else:
            pos = P - P % bs
            kda = pool.read_snapshot(req.blocks[pos // bs - 1]) if pos else {n: z.clone() for n, z in self._zero.items()}
        while pos < end:
            stop = min(end, (pos // bs + 1) * bs)
            logits, new, flagged = self._run_rows([(req.blocks, pos, [req.fed_token(p) for p in range(pos, stop)], kda)])
            if flagged or not bool(logits[:, -1].isfinite().all()):
                log.warning("request %s: its generated tokens were not cached (non-finite states)", req.id)
                return
            blk = req.blocks[pos // bs]
            for name in pool.mla_names:
                pool.write_latents(name, blk, pos % bs, self._t(new[name])[0, pos:stop])
            kda = {n: self._t(new[n])[0:1] for n in pool.kda_names}
            self.stats["cache_prefill_tokens"] += stop - pos
            pos = stop
            if pos % bs == 0:
                self._publish(req, blk, pos, kda)
        if pos % bs:
            k = pos // bs
            pool.keep_tail(req.hashes[:k], [req.fed_token(p) for p in range(k * bs, pos)], req.blocks[k], kda)

    def _emit(self, req: Request, token: int | None) -> None:
        for fn in [*self.observers, req.on_event]:
            if fn is not None:
                try:
                    fn(req, token)
                except Exception:                       # a broken listener must not stop the engine
                    log.exception("request %s: event callback failed", req.id)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            need = -(-(len(req.prompt) + req.params.max_tokens) // self.bs)
            hit = self.pool.lookup(req.prompt, len(req.prompt) - 1, keep_available=self.reserved)
            fresh = need - len(hit.blocks)
            if self.pool.available() - self.reserved < fresh:
                self.pool.release(hit.blocks)
                break
            self.waiting.popleft()
            req.blocks, req.hashes, req.reserve = hit.blocks, hit.hashes, fresh
            self.reserved += fresh
            req.length = req.cached_tokens = hit.length
            req.kda = hit.kda if hit.kda is not None else {n: z.clone() for n, z in self._zero.items()}
            if req.length and req.length == self._prompt_chunk_end(req):
                req.prompt_kda = {n: t.clone() for n, t in req.kda.items()}
            req.generator = make_generator(req.params.seed)
            req.status = "running"
            self.running.append(req)

    def _work(self) -> list[tuple[Request, list[int]]]:
        items, budget = [], self.max_prefill_tokens
        for req in self.running:
            P = len(req.prompt)
            if req.length >= P:
                items.append((req, [req.output[-1]]))
                continue
            end = min(P, (req.length // self.bs + 1) * self.bs)
            c = self._prompt_chunk_end(req)
            if c is not None and req.length < c < end:
                end = c                         # the prompt-end tail's state is taken there
            n = end - req.length
            if n > budget:                      # cut on the KDA chunk grid; one chunk at least per step
                n = budget - budget % KDA_CHUNK or (KDA_CHUNK if budget == self.max_prefill_tokens else 0)
            if n <= 0:
                continue
            budget -= n
            items.append((req, req.prompt[req.length:req.length + n]))
        return items

    def step(self) -> list[Request]:
        """Admit waiting requests, run one prefill segment or decode token for every running
        request, sample, and retire finished ones. Returns the requests finished in this step."""
        for req in [r for r in [*self.waiting, *self.running] if r.cancelled]:
            self._finish(req, "abort")
        self._admit()
        done: list[Request] = []
        groups: dict[tuple, list] = {}
        for req, toks in self._work():
            decode = self.varlen and req.length >= len(req.prompt)
            key = ("decode",) if decode else (len(toks), req.length)
            groups.setdefault(key, []).append((req, toks))
        for items in groups.values():
            try:
                self._run_group(items)
            except Exception as e:  # keep serving the others; these requests fail with the reason
                log.exception("engine step failed for %d request(s)", len(items))
                for req, _ in items:
                    if not req.done:
                        self._finish(req, "error", f"{type(e).__name__}: {e}")
                        done.append(req)
        self.stats["steps"] += 1
        done += [r for r in self._recent if r not in done]
        self._recent = []
        return done

    def _ensure_block(self, req: Request) -> None:
        if req.length % self.bs == 0 and len(req.blocks) == req.length // self.bs:
            req.blocks.append(self.pool.allocate())
            req.reserve -= 1
            self.reserved -= 1

    def _run_rows(self, rows: list[tuple[Sequence[int], int, list[int], dict[str, Any]]]) -> tuple[Any, dict[str, Any], list]:
        """One model call (``_call``) for ``rows`` of (block table, cached length, ``T`` token ids each, KDA
        states ``{name: [1, *shape]}``); the MLA caches are gathered from the pool, right-padded to the
        longest length ``L``. Returns (logits ``[G, T', V]``, the new states by name (MLA caches ``[G, L+T,
        R+P]``), the triton target's non-finite gate flags ``(launch, row, head)``)."""
        import torch
        G, T = len(rows), len(rows[0][2])
        lengths = [length for _, length, _, _ in rows]
        L = max(lengths)
        args: list[Any] = [np.asarray([t for _, _, t, _ in rows], dtype=np.int64)]
        if self.varlen:
            args.append(np.asarray(lengths, dtype=np.int64))
        for name in self.names:
            if name in self.pool.pages:
                W = self.pool.pages[name].shape[-1]
                cache = torch.zeros(G, L, W, dtype=self.dtype, device=self.device)
                for b, (blocks, length, _, _) in enumerate(rows):
                    if length:
                        cache[b, :length] = self.pool.gather_latents(name, blocks, length)
                args.append(cache)
            else:
                args.append(torch.cat([kda[name] for _, _, _, kda in rows], 0))
        outs = self._call(T, args)
        self.stats["calls"] += 1
        self.stats["rows"] += G
        take = getattr(self.exe, "take_gate_flags", None)   # the triton target on a device: non-finite KDA gates
        flagged = take() if take is not None else []        # (a copy to the host; the rows are read next anyway)
        return torch.as_tensor(outs[0]), dict(zip(self.names, outs[1:])), flagged

    def _run_group(self, items: list[tuple[Request, list[int]]]) -> None:
        for req, _ in items:
            self._ensure_block(req)
        L, T = max(req.length for req, _ in items), len(items[0][1])
        logits, new, flagged = self._run_rows([(req.blocks, req.length, toks, req.kda) for req, toks in items])
        for b, (req, toks) in enumerate(items):
            bad = gate_flag_text([h for h in flagged if h[1] == b])
            if bad:                 # that request alone ends: its states are NaN
                self._finish(req, "error", bad)
                self._recent.append(req)
                continue
            try:                    # one row's failure ends that request only, not the others of the call
                self._advance(req, b, T, L, new, logits)
            except Exception as e:
                log.exception("request %s failed after its model call", req.id)
                if not req.done:
                    self._finish(req, "error", f"{type(e).__name__}: {e}")
                    self._recent.append(req)

    def _call(self, T: int, args: list[Any]) -> list[Any]:
        """One model call for a group of rows of ``T`` tokens each (``args`` as the function takes them:
        ids ``[G, T]``, with ``@prefill_varlen`` the cache lengths, then the states): the logits
        ``[G, T', V]`` (``T' >= 1``; the last position of each row is the one sampled), then the new states."""
        fn = VARLEN if self.varlen else ("decode" if T == 1 else "prefill")
        return self.exe.run(fn, args, self.session.params)

    def _advance(self, req: Request, b: int, T: int, L: int, new: dict[str, Any], logits: Any) -> None:
        """Store row ``b``'s new states for ``req`` (``T`` tokens after the padded cache length ``L``)
        and sample when its prompt is consumed."""
        import torch
        prefill = req.length < len(req.prompt)
        self.stats["prefill_tokens" if prefill else "decode_tokens"] += T
        blk, off = req.blocks[req.length // self.bs], req.length % self.bs
        for name in self.pool.mla_names:
            self.pool.write_latents(name, blk, off, torch.as_tensor(new[name])[b, L:L + T])
        req.kda = {n: self._t(new[n])[b:b + 1] for n in self.pool.kda_names}
        req.length += T
        if prefill and req.length == self._prompt_chunk_end(req):
            req.prompt_kda = {n: t.clone() for n, t in req.kda.items()}
        if req.length % self.bs == 0 and req.length <= len(req.prompt):     # generated ones: _cache_generated
            self._publish(req, blk, req.length, req.kda)
        if req.length >= len(req.prompt):
            self._sample(req, logits[b, -1])

    def _publish(self, req: Request, blk: int, end: int, kda: dict[str, Any]) -> None:
        """Snapshot the KDA states ``kda`` at the block boundary ``end`` (a token count) and publish the block."""
        self.pool.write_snapshot(blk, kda)
        i = end // self.bs - 1
        if i >= len(req.hashes):           # a block of generated tokens: extend the hash chain
            toks = [req.fed_token(p) for p in range(i * self.bs, (i + 1) * self.bs)]
            salt = req.hashes[i - 1] if i else self.pool.salt
            req.hashes.append(block_hashes(toks, self.bs, salt)[0])
        self.pool.register(blk, req.hashes[i])

    def _sample(self, req: Request, row) -> None:
        top = float(row.max())
        if not np.isfinite(top):         # NaN / +inf / all -inf logits: no token is meaningful (would be id 0)
            self._finish(req, "error", f"the model's logits are not finite ({top}) at generation step "
                                       f"{len(req.output) + 1}")
            self._recent.append(req)
            return
        tok = sample(row, req.params, req.generator)
        if req.keep_logits:
            req.logits.append(row.detach().to("cpu").clone())
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        req.output.append(tok)
        self._emit(req, tok)
        if tok in self.stop_ids or tok in req.params.stop_token_ids:
            self._finish(req, "stop")
        elif len(req.output) >= req.params.max_tokens:
            self._finish(req, "length")
        else:
            return
        self._recent.append(req)


class EngineThread:
    """Runs an ``Engine`` in a daemon thread; ``submit`` and ``abort`` are thread-safe."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="k3ir-engine", daemon=True)

    def start(self) -> EngineThread:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def submit(self, req: Request) -> Request:
        self._inbox.put(req)
        self._wake.set()
        return req

    def abort(self, req: Request) -> None:
        req.cancelled = True
        self._wake.set()

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._wake.clear()
            while True:
                try:
                    eng.enqueue(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if eng.has_work():
                try:
                    eng.step()
                except Exception:
                    log.exception("engine step failed")
                    for r in [*eng.waiting, *eng.running]:
                        eng._finish(r, "error", "internal engine error")
            else:
                self._wake.wait(self.idle_wait_s)
        for r in [*eng.waiting, *eng.running]:
            eng._finish(r, "abort")


def build_engine(module, target: str = "torch", dtype: str | None = None, device: str = "cpu", params=None,
                 seed: int = 0, **engine_kw) -> Engine:
    """Compile ``module`` with ``@prefill_varlen`` added (so mixed-length rows batch together) and
    wrap it in a Session and an Engine (``engine_kw`` go to ``Engine``). ``dtype`` None: the target's own
    (float32, float64 for ``reference``). Raises K3RuntimeError for bad engine sizes (see
    ``engine_size_problem``) before compiling."""
    from k3ir.frontend.model import add_varlen_function

    import k3ir

    from .session import Session
    sizes = {k: engine_kw[k] for k in ("block_size", "num_blocks", "max_batch", "max_prefill_tokens", "host_cache_bytes")
             if k in engine_kw}
    why = engine_size_problem(**sizes)          # before the (slow) compile
    if why:
        raise K3RuntimeError(why)
    m = add_varlen_function(module.clone())
    exe = k3ir.compile(m, target=target, dtype=dtype, device=device)
    return Engine(Session(exe, params=params, seed=seed), **engine_kw)
