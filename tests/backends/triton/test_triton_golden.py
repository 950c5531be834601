"""Golden greedy decodes of the triton target (float32, CUDA graphs off, ``TRITON_INTERPRET=1`` on a CPU
machine): k3-tiny and the tests' tiny Kimi Linear (``KIMI_LINEAR_TINY``), prefill of 9 tokens then 8
greedy decode steps, at batch 1 (the fused decode paths) and batch 5 (the fallbacks for more rows).

The files under ``tests/backends/triton/golden_runs/triton_decode/`` hold, per case, the prompt ``ids [B, 9]`` (int64), the
prefill logits ``[B, 9, V]``, the decode logits ``[8, B, V]`` (float32) and the greedy tokens
``[B, 8]`` (int64). They were taken from the triton target and checked against the torch target (same
tokens, logits within 1e-4 relative). A change that only moves or re-selects kernels must reproduce them
within 1e-6 relative (SPEC.md 11) and give the same tokens.

Regenerate (only when the numerics are meant to change)::

    TRITON_INTERPRET=1 python -m tests.backends.triton.test_triton_golden --regen

which rewrites the files from the triton target after checking it against the torch target.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import
pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
if TESTS not in sys.path:         # _tiny_models and conftest when run as a script (--regen)
    sys.path.insert(0, TESTS)

from _tiny_models import load_tiny
from conftest import rel_err

GOLDEN = os.path.join(HERE, "golden_runs", "triton_decode")
PROMPT_LEN = 9
STEPS = 8
#: (model key in _tiny_models.MODELS, batch)
CASES = [("k3-tiny", 1), ("k3-tiny", 5), ("kimi-linear-tiny", 1), ("kimi-linear-tiny", 5)]
PARAM_SEED = 3
TOL = 1e-6
PEER_TOL = 1e-4


def golden_path(key: str, batch: int) -> str:
    return os.path.join(GOLDEN, f"{key}_b{batch}.npz")


def prompt(vocab: int, batch: int) -> np.ndarray:
    """Prompt ids ``[batch, 9]`` int64 in ``[3, min(vocab, 256))`` (seeded by the batch)."""
    return np.random.default_rng(100 + batch).integers(3, min(vocab, 256), (batch, PROMPT_LEN)).astype(np.int64)


def greedy_run(key: str, batch: int, target: str = "triton", steps: int = STEPS) -> dict[str, np.ndarray]:
    """Prefill the golden prompt then ``steps`` greedy decode steps of model ``key`` on ``target``
    (float32, cpu, CUDA graphs off, weights ``init_params(seed=3)``). Returns ``ids [B, 9]``,
    ``prefill [B, 9, V]`` float32, ``decode [steps, B, V]`` float32, ``tokens [B, steps]`` int64: the
    tokens fed to the decode steps (the argmax of the previous logits)."""
    from k3ir.runtime import Session
    from k3ir.runtime.params import init_params

    import k3ir
    torch.set_num_threads(1)
    m = load_tiny(key)
    exe = k3ir.compile(m, target=target, dtype="float32", device="cpu")
    if hasattr(exe, "cuda_graphs"):
        exe.cuda_graphs = False
    sess = Session(exe, params=init_params(m, seed=PARAM_SEED))
    ids = prompt(m.config.vocab_size, batch)
    logits, state = sess.prefill(ids)
    pre = logits.float().numpy().copy()
    last = pre[:, -1]
    decode, tokens = [], []
    for _ in range(steps):
        nxt = last.argmax(-1).astype(np.int64)[:, None]
        tokens.append(nxt[:, 0])
        logits, state = sess.decode(nxt, state)
        last = logits.float().numpy()[:, -1].copy()
        decode.append(last)
    return {"ids": ids, "prefill": pre, "decode": np.stack(decode) if decode else np.zeros((0, batch, pre.shape[-1]),
            np.float32), "tokens": np.stack(tokens, 1) if tokens else np.zeros((batch, 0), np.int64)}


def check_against(got: dict, want: dict, tol: float, what: str) -> None:
    """AssertionError unless ``got`` has ``want``'s ids and tokens (over ``got``'s steps) and its logits
    are within ``tol`` relative of ``want``'s."""
    n = got["tokens"].shape[1]
    assert np.array_equal(got["ids"], want["ids"]), f"{what}: prompt differs"
    assert np.array_equal(got["tokens"], want["tokens"][:, :n]), \
        f"{what}: greedy tokens {got['tokens'].tolist()} != {want['tokens'][:, :n].tolist()}"
    e = rel_err(got["prefill"], want["prefill"])
    assert e < tol, f"{what}: prefill logits rel err {e:.3g} >= {tol}"
    for s in range(n):
        e = rel_err(got["decode"][s], want["decode"][s])
        assert e < tol, f"{what}: decode step {s} logits rel err {e:.3g} >= {tol}"


def regenerate(cases=CASES) -> list[str]:
    """Rewrite the golden files of ``cases`` from the triton target after checking each run against the
    torch target (same tokens, logits within 1e-4 relative; AssertionError otherwise). Returns the paths."""
    os.makedirs(GOLDEN, exist_ok=True)
    paths = []
    for key, batch in cases:
        got = greedy_run(key, batch, "triton")
        check_against(greedy_run(key, batch, "torch"), got, PEER_TOL, f"{key} b{batch} torch vs triton")
        path = golden_path(key, batch)
        np.savez_compressed(path, **got)
        paths.append(path)
    return paths


def _load(key: str, batch: int) -> dict:
    with np.load(golden_path(key, batch)) as z:
        return {k: z[k] for k in z.files}


def test_golden_files_are_consistent():
    """The stored tokens are the argmax of the stored logits (prefill's last row, then each step's)."""
    for key, batch in CASES:
        g = _load(key, batch)
        assert g["prefill"].shape[:2] == (batch, PROMPT_LEN) and g["decode"].shape[:2] == (STEPS, batch)
        want = np.concatenate([g["prefill"][:, -1:].argmax(-1), g["decode"][:-1].argmax(-1).T], axis=1)
        assert np.array_equal(g["tokens"], want), key


def test_k3_tiny_batch1_two_steps_match_golden():
    """Fast case: k3-tiny batch 1 (fused decode paths), two decode steps against the golden prefix."""
    check_against(greedy_run("k3-tiny", 1, steps=2), _load("k3-tiny", 1), TOL, "k3-tiny b1")


@pytest.mark.slow
@pytest.mark.parametrize("key,batch", CASES, ids=[f"{k}-b{b}" for k, b in CASES])
def test_triton_greedy_decode_matches_golden(key, batch):
    check_against(greedy_run(key, batch), _load(key, batch), TOL, f"{key} b{batch}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regen"]:
        sys.exit("usage: TRITON_INTERPRET=1 python -m tests.backends.triton.test_triton_golden --regen")
    for p in regenerate():
        print(p)
