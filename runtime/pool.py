"""One paged state pool for serving (SPEC.md 9): MLA latent pages by token block and KDA state
snapshots (conv + recurrent) at block boundaries, a prefix cache keyed by chained block hashes,
reference counting and LRU eviction of unreferenced cached blocks.

A block ``i`` of a sequence covers tokens ``[i*bs, (i+1)*bs)``. The pool holds, per block id:
- for every MLA layer, the ``[bs, R+P]`` latent rows (``[c_kv | k_rope]``) of those tokens;
- for every KDA layer, the conv states ``[C, K-1]`` and the recurrent state ``[H, K, V]`` (fp32)
  *after* the block's last token (a snapshot at the block's end boundary).
A full block is registered under the hash of its tokens chained with the previous block's hash,
so a new prompt that starts with the same ``k*bs`` tokens resumes from block ``k-1``'s snapshot
with the ``k`` blocks' pages as its MLA cache: exactly the state a fresh prefill reaches there.
Shared blocks are always full, so they are never written again (no copy-on-write needed).

A second tier in host memory (``host_bytes`` > 0, its own byte budget, LRU) takes the cached blocks
evicted from the device pool (their pages and their end snapshot, under the same chained hash) and
the *tails* a finished request leaves: the rows of a partial block up to a KDA chunk boundary (a
multiple of 64 tokens: the last one of its prompt and of the tokens it fed) and the KDA states there,
keyed by the hash chain before them and their token ids (the state a multi-turn chat's next prompt
starts from). A tail ends on the chunk grid of a fresh prefill, so the prefill that resumes from it
splits the rest into the same chunks a one-shot prefill does. A lookup walks the device blocks, then
the host ones (copied back into fresh device blocks), then the longest tail that continues the chain.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3ir.errors import K3RuntimeError
from k3ir.types import StateType

KDA_CHUNK = 64


def block_hashes(tokens: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """Chained hashes of the full blocks of ``tokens``: ``h_i = blake2b(h_{i-1} || ids of block i)``
    (ids as little-endian int64); ``h_{-1} = salt``. A partial last block gets no hash."""
    out: list[bytes] = []
    prev = salt
    a = np.asarray(tokens, dtype="<i8")
    for i in range(len(a) // block_size):
        prev = hashlib.blake2b(prev + a[i * block_size:(i + 1) * block_size].tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


@dataclass
class HostEntry:
    """One entry of the host tier: a full block (``tokens`` None; ``pages[name]`` ``[bs, R+P]``) or a tail
    (``tokens``: its ids, ``n < bs`` a multiple of the KDA chunk; ``pages[name]`` ``[n, R+P]``), with the KDA states after its last
    token (``snaps[name]`` ``[*shape]``); CPU tensors of the pool's dtype. ``chain``: the hash before it."""
    chain: bytes
    pages: dict[str, Any]
    snaps: dict[str, Any]
    nbytes: int
    tokens: tuple[int, ...] | None = None


@dataclass
class PrefixHit:
    """What ``StatePool.lookup`` found: ``blocks`` (retained once each, full blocks then at most one
    private tail block), ``length`` tokens they cover, ``hashes`` (every full-block hash of the tokens),
    ``kda`` (the states at ``length``, ``{name: [1, *shape]}``, None when ``length`` is 0) and the
    tokens found per tier (``device_tokens``, ``host_tokens``)."""
    blocks: list[int]
    hashes: list[bytes]
    length: int = 0
    kda: dict[str, Any] | None = None
    device_tokens: int = 0
    host_tokens: int = 0
    tail: bool = field(default=False)


class StatePool:
    """Fixed-size pool of ``num_blocks`` blocks of ``block_size`` tokens.

    ``specs``: the model's state signature ``[(name, StateType)]`` (``Session.state_specs``);
    ``mla_cache`` entries get pages ``[num_blocks, bs, R+P]``, ``conv_state``/``kda_state`` entries
    snapshots ``[num_blocks, *shape]``. Tensors live on ``device`` in ``dtype`` (fp32; float64 on
    the reference target). ``block_size`` must be a positive multiple of the KDA chunk (64) so a
    resumed prefill keeps the chunk grid of a fresh one. ``host_bytes``: the host tier's budget in
    bytes (0: no host tier). Raises K3RuntimeError on bad sizes and when no block can be allocated."""

    def __init__(self, specs: Sequence[tuple[str, StateType]], num_blocks: int, block_size: int = 512,
                 device: Any = "cpu", dtype: Any = None, salt: bytes = b"", host_bytes: int = 0):
        import torch
        if block_size <= 0 or block_size % KDA_CHUNK:
            raise K3RuntimeError(f"pool block size must be a positive multiple of the KDA chunk {KDA_CHUNK}, "
                                 f"got {block_size}")
        if num_blocks <= 0:
            raise K3RuntimeError(f"pool needs at least one block, got num_blocks={num_blocks}")
        if isinstance(host_bytes, bool) or not isinstance(host_bytes, (int, np.integer)) or host_bytes < 0:
            raise K3RuntimeError(f"host cache budget must be an integer number of bytes >= 0, got {host_bytes!r}")
        self.block_size, self.num_blocks, self.salt = block_size, num_blocks, salt
        self.dtype = dtype or torch.float32
        self.device = torch.device(device)
        self.mla_names = [n for n, t in specs if t.kind == "mla_cache"]
        self.kda_names = [n for n, t in specs if t.kind in ("conv_state", "kda_state")]
        self.pages: dict[str, Any] = {}
        self.snaps: dict[str, Any] = {}
        for name, t in specs:
            if t.kind == "mla_cache":
                self.pages[name] = torch.zeros(num_blocks, block_size, t.params[0] + t.params[1],
                                               dtype=self.dtype, device=self.device)
            else:
                self.snaps[name] = torch.zeros((num_blocks,) + tuple(t.params), dtype=self.dtype, device=self.device)
        self.refcount = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))      # pop() yields 0, 1, ...
        self.lru: OrderedDict[int, None] = OrderedDict()                 # cached, unreferenced; oldest first
        self.stats = {"hits": 0, "hit_tokens": 0, "lookups": 0, "evictions": 0, "hit_tokens_device": 0,
                      "hit_tokens_host": 0, "host_stored": 0, "host_evictions": 0}
        self.host_bytes = int(host_bytes)
        self.host_used = 0
        self.host: OrderedDict[bytes, HostEntry] = OrderedDict()     # oldest first
        self.tails: dict[bytes, set[bytes]] = {}                         # chain hash -> tail keys

    # ---- accounting --------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks on the free list (never used, evicted or released without a hash)."""
        return len(self.free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that still hold a cached prefix (evictable)."""
        return len(self.lru)

    @property
    def num_referenced(self) -> int:
        return sum(1 for r in self.refcount if r > 0)

    def available(self) -> int:
        """Blocks an allocation can get now: free plus evictable."""
        return len(self.free) + len(self.lru)

    def bytes_per_block(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in [*self.pages.values(), *self.snaps.values()])

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self) -> int:
        """A block with reference count 1: from the free list, else the least recently used
        cached block (its prefix entry is dropped). Raises K3RuntimeError when all are in use."""
        if self.free:
            b = self.free.pop()
        elif self.lru:
            b, _ = self.lru.popitem(last=False)
            h = self.hash_of[b]
            if h is not None and self.by_hash.get(h) == b:
                del self.by_hash[h]
                self._to_host(b, h)
            self.hash_of[b] = None
            self.stats["evictions"] += 1
        else:
            raise K3RuntimeError(f"state pool exhausted: all {self.num_blocks} blocks are referenced")
        self.refcount[b] = 1
        return b

    def retain(self, block: int) -> None:
        if self.refcount[block] == 0:
            self.lru.pop(block, None)
        self.refcount[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; unreferenced hashed blocks stay cached (LRU, most
        recent last), unhashed ones return to the free list."""
        for b in blocks:
            if self.refcount[b] <= 0:
                raise K3RuntimeError(f"pool block {b} released more often than referenced")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                if self.hash_of[b] is not None:
                    self.lru[b] = None
                else:
                    self.free.append(b)

    def clear_cache(self) -> int:
        """Forget every unreferenced cached prefix (their blocks go to the free list). Returns how many."""
        n = len(self.lru)
        for b in list(self.lru):
            h = self.hash_of[b]
            if h is not None and self.by_hash.get(h) == b:
                del self.by_hash[h]
            self.hash_of[b] = None
            self.free.append(b)
        self.lru.clear()
        return n

    # ---- prefix cache ------------------------------------------------------------------
    def match(self, tokens: Sequence[int], max_tokens: int) -> tuple[list[int], list[bytes]]:  # device tier only
        """Longest cached chain of full blocks that is a prefix of ``tokens`` and covers at most
        ``max_tokens`` tokens. Returns (block ids, each retained once; all full-block hashes of
        ``tokens``)."""
        hashes = block_hashes(tokens, self.block_size, self.salt)
        got: list[int] = []
        for h in hashes[: max(0, max_tokens) // self.block_size]:
            b = self.by_hash.get(h)
            if b is None:
                break
            self.retain(b)
            got.append(b)
        self.stats["lookups"] += 1
        if got:
            self.stats["hits"] += 1
            self.stats["hit_tokens"] += len(got) * self.block_size
            self.stats["hit_tokens_device"] += len(got) * self.block_size
        return got, hashes

    def register(self, block: int, h: bytes) -> bool:
        """Publish a full block under its chained hash; False when that prefix is already cached
        by another block (this one then stays private and is freed on release). A host copy of the
        same block is dropped (the device one is used first)."""
        if h in self.by_hash:
            return False
        self.by_hash[h] = block
        self.hash_of[block] = h
        if h in self.host:
            self._drop_host(h)
        return True

    def lookup(self, tokens: Sequence[int], max_tokens: int, keep_available: int = 0) -> PrefixHit:
        """The longest cached prefix of ``tokens`` of at most ``max_tokens`` tokens from both tiers:
        device blocks, then host blocks (each copied into a block from ``allocate``, only while more
        than ``keep_available`` blocks stay available: those are promised elsewhere), then the longest
        host tail that continues the chain (into one more block, same rule). Every returned block is
        retained once; ``stats`` count the hit per tier."""
        hashes = block_hashes(tokens, self.block_size, self.salt)
        hit = PrefixHit([], hashes)
        for h in hashes[: max(0, max_tokens) // self.block_size]:
            b = self.by_hash.get(h)
            if b is not None:
                self.retain(b)
                hit.device_tokens += self.block_size
            elif h in self.host and self.available() > keep_available:
                b = self._from_host(h)
                hit.host_tokens += self.block_size
            else:
                break
            hit.blocks.append(b)
        hit.length = len(hit.blocks) * self.block_size
        if self.tails and self.available() > keep_available:
            self._tail(hit, tokens, max_tokens)
        if hit.blocks and hit.kda is None:
            hit.kda = self.read_snapshot(hit.blocks[-1])
        self.stats["lookups"] += 1
        if hit.blocks:
            self.stats["hits"] += 1
            self.stats["hit_tokens"] += hit.length
            self.stats["hit_tokens_device"] += hit.device_tokens
            self.stats["hit_tokens_host"] += hit.host_tokens
        return hit

    def _tail(self, hit: PrefixHit, tokens: Sequence[int], max_tokens: int) -> None:
        """Extend ``hit`` by the longest host tail after its full blocks (copied into a private block)."""
        k = len(hit.blocks)
        chain = hit.hashes[k - 1] if k else self.salt
        rest = [int(t) for t in tokens[k * self.block_size: max(0, max_tokens)]]
        best = None
        for key in self.tails.get(chain, ()):
            e = self.host[key]
            n = len(e.tokens)
            if n <= len(rest) and tuple(rest[:n]) == e.tokens and (best is None or n > len(best[1].tokens)):
                best = (key, e)
        if best is None:
            return
        key, e = best
        self.host.move_to_end(key)
        b = self.allocate()
        n = len(e.tokens)
        for name in self.mla_names:
            self.pages[name][b, :n] = e.pages[name].to(self.device)
        hit.kda = {name: e.snaps[name][None].to(self.device).clone() for name in self.kda_names}
        hit.blocks.append(b)
        hit.length += n
        hit.host_tokens += n
        hit.tail = True

    # ---- host tier ---------------------------------------------------------------------
    def keep_tail(self, hashes: Sequence[bytes], tokens: Sequence[int], block: int, kda: dict[str, Any]) -> bool:
        """Store in the host tier the tail of a sequence: its full blocks have ``hashes`` (the chain it
        continues), ``tokens`` (``0 < n < bs`` ids, ``n`` a multiple of the KDA chunk 64) lie in ``block``
        rows ``0..n``, ``kda`` the states a chunked prefill reached after them (``{name: [1, *shape]}``).
        False when there is no host tier or it does not fit. Raises K3RuntimeError for an ``n`` off the
        chunk grid (a prefill resumed there would split the rest into other chunks than a fresh one)."""
        n = len(tokens)
        if n % KDA_CHUNK:
            raise K3RuntimeError(f"a prefix-cache tail must end on the KDA chunk grid ({KDA_CHUNK} tokens), "
                                 f"got {n} tokens")
        if not self.host_bytes or not 0 < n < self.block_size:
            return False
        chain = hashes[-1] if hashes else self.salt
        tok = tuple(int(t) for t in tokens)
        key = b"t" + hashlib.blake2b(chain + np.asarray(tok, dtype="<i8").tobytes(), digest_size=16).digest()
        if key in self.host:
            self.host.move_to_end(key)
            return True
        pages = {name: self.pages[name][block, :n].to("cpu", copy=True) for name in self.mla_names}
        snaps = {name: kda[name][0].to("cpu", self.dtype, copy=True) for name in self.kda_names}
        if not self._store(key, HostEntry(chain, pages, snaps, _nbytes(pages, snaps), tok)):
            return False
        self.tails.setdefault(chain, set()).add(key)
        return True

    def _to_host(self, block: int, h: bytes) -> None:
        if not self.host_bytes:
            return
        pages = {name: self.pages[name][block].to("cpu", copy=True) for name in self.mla_names}
        snaps = {name: self.snaps[name][block].to("cpu", copy=True) for name in self.kda_names}
        self._store(h, HostEntry(b"", pages, snaps, _nbytes(pages, snaps)))

    def _store(self, key: bytes, e: HostEntry) -> bool:
        if e.nbytes > self.host_bytes:
            return False
        while self.host_used + e.nbytes > self.host_bytes:
            self._drop_host(next(iter(self.host)))
            self.stats["host_evictions"] += 1
        self.host[key] = e
        self.host_used += e.nbytes
        self.stats["host_stored"] += 1
        return True

    def _drop_host(self, key: bytes) -> None:
        e = self.host.pop(key)
        self.host_used -= e.nbytes
        if e.tokens is not None:
            keys = self.tails[e.chain]
            keys.discard(key)
            if not keys:
                del self.tails[e.chain]

    def _from_host(self, h: bytes) -> int:
        """A device block (retained once, registered under ``h``) holding host block ``h``'s data."""
        e = self.host[h]
        b = self.allocate()
        for name in self.mla_names:
            self.pages[name][b] = e.pages[name].to(self.device)
        for name in self.kda_names:
            self.snaps[name][b] = e.snaps[name].to(self.device)
        self.register(b, h)                      # drops the host copy
        return b

    def host_accounting(self) -> dict[str, int]:
        """The host tier's books: ``entries``, ``blocks`` (full blocks), ``tails``, ``bytes`` (sum of the
        entries' sizes), ``used`` (the running count, equal to ``bytes``), ``budget``, ``indexed_tails``
        (tail keys in the chain index, equal to ``tails``) and ``on_both_tiers`` (hashes cached on the
        device and the host at once: 0)."""
        tails = sum(1 for e in self.host.values() if e.tokens is not None)
        return {"entries": len(self.host), "blocks": len(self.host) - tails, "tails": tails,
                "bytes": sum(e.nbytes for e in self.host.values()), "used": self.host_used,
                "budget": self.host_bytes, "indexed_tails": sum(len(v) for v in self.tails.values()),
                "on_both_tiers": sum(1 for h in self.by_hash if h in self.host)}

    def clear_host(self) -> int:
        """Drop every host-tier entry. Returns how many."""
        n = len(self.host)
        self.host.clear()
        self.tails.clear()
        self.host_used = 0
        return n

    # ---- data ----------------------------------------------------------------------------
    def write_latents(self, name: str, block: int, offset: int, rows: Any) -> None:
        """Store MLA latent rows ``[n, R+P]`` for tokens ``offset..offset+n`` of ``block``."""
        n = rows.shape[0]
        if offset + n > self.block_size:
            raise K3RuntimeError(f"latent write of {n} rows at offset {offset} crosses a {self.block_size}-token block")
        self.pages[name][block, offset:offset + n] = rows.to(self.dtype)

    def gather_latents(self, name: str, blocks: Sequence[int], length: int) -> Any:
        """The MLA cache ``[length, R+P]`` of a sequence whose tokens lie in ``blocks`` (in order)."""
        import torch
        if length == 0:
            return self.pages[name].new_zeros((0, self.pages[name].shape[-1]))
        nb = -(-length // self.block_size)
        idx = torch.as_tensor(list(blocks[:nb]), device=self.device)
        return self.pages[name].index_select(0, idx).reshape(-1, self.pages[name].shape[-1])[:length]

    def write_snapshot(self, block: int, states: dict[str, Any]) -> None:
        """Store the KDA states ``{name: [1, *shape]}`` reached after ``block``'s last token."""
        for name in self.kda_names:
            self.snaps[name][block] = states[name][0].to(self.dtype)

    def read_snapshot(self, block: int) -> dict[str, Any]:
        """The KDA states saved at ``block``'s end, as fresh ``[1, *shape]`` tensors."""
        return {name: self.snaps[name][block:block + 1].clone() for name in self.kda_names}


def _nbytes(pages: dict[str, Any], snaps: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in [*pages.values(), *snaps.values()])
