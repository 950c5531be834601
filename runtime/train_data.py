"""Training data: byte-level token windows from a text file (default: the public-domain text
bundled in ``k3ir/runtime/data``), drawn deterministically per step so a resumed run sees
exactly the batches of an uninterrupted one."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

from k3ir.errors import K3RuntimeError

#: the bundled corpus: public-domain English prose and verse (1776-1865), see data/README.md
BUNDLED_TEXT = "public_domain.txt"


def bundled_text_path() -> Path:
    """Path of the bundled public-domain text (a few tens of kB, UTF-8)."""
    return Path(str(resources.files("k3ir.runtime").joinpath("data", BUNDLED_TEXT)))


def read_bytes(path: str | Path | None = None) -> np.ndarray:
    """The file's bytes as ``int64`` token ids 0..255 (``None``: the bundled text).
    Raises K3RuntimeError if the file is missing, unreadable or too short to train on."""
    p = bundled_text_path() if path is None else Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise K3RuntimeError(f"cannot read training data '{p}': {e.strerror or e}") from None
    if len(data) < 64:
        raise K3RuntimeError(f"training data '{p}' holds {len(data)} bytes; need at least 64")
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64)


class ByteBatches:
    """Random windows of ``seq + 1`` tokens (inputs and next-token targets).

    ``batch_at(step) -> int64[batch, seq + 1]`` depends only on ``(seed, step)``: the data
    position of a run is its step count. The last ``holdout`` fraction of the text is kept out
    of training windows and served by ``eval_batch`` (fixed windows for a held-out loss)."""

    def __init__(self, tokens: np.ndarray, batch: int, seq: int, seed: int = 0, holdout: float = 0.05):
        if batch < 1 or seq < 1:
            raise K3RuntimeError(f"batch and seq must be >= 1, got batch={batch}, seq={seq}")
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.batch, self.seq, self.seed = batch, seq, seed
        n = len(self.tokens)
        cut = int(n * (1.0 - holdout))
        if cut < seq + 2:
            raise K3RuntimeError(f"training data has {n} tokens; too few for windows of {seq + 1} "
                                 f"(use a smaller --seq or a longer --data file)")
        self.train_end = cut
        self.eval_tokens = self.tokens[cut:] if n - cut >= seq + 1 else self.tokens[-(seq + 1):]

    def batch_at(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.train_end - self.seq - 1, size=self.batch)
        return np.stack([self.tokens[s:s + self.seq + 1] for s in starts])

    def eval_batch(self, max_rows: int = 8) -> np.ndarray:
        n = (len(self.eval_tokens) - 1) // self.seq
        rows = max(1, min(max_rows, n))
        return np.stack([self.eval_tokens[i * self.seq:i * self.seq + self.seq + 1] for i in range(rows)])
