"""Decode input path without host syncs (graphs.Staging, GraphDecode's one-copy io buffer, Session.generate's
greedy loop on the logits' device), on the CPU: the pinned buffers and CUDA events are replaced by plain tensors
and events that log their use, the CUDA graph by an eager replay of the same static buffers
(TRITON_INTERPRET=1 on a CPU machine). Logits against the float64 reference backend."""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import
pytest.importorskip("triton")

from conftest import rel_err
from k3ir.runtime import Session

import k3ir
from k3ir.errors import K3RuntimeError

KL = {"num_hidden_layers": 4, "hidden_size": 256, "vocab_size": 512, "num_experts": 8, "moe_intermediate_size": 128,
      "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 64,
      "layer_types": ["linear_attention"] * 3 + ["full_attention"],
      "mlp_layer_types": ["dense"] + ["sparse"] * 3,
      "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 64, "num_heads": 2,
                             "short_conv_kernel_size": 4}}


class LogEvent:
    """Stands for torch.cuda.Event: logs record/synchronize with its slot (the order in which it was made)."""

    def __init__(self, log):
        self.log, self.slot = log, sum(1 for e in log if e[0] == "new")
        log.append(("new", self.slot))

    def record(self):
        self.log.append(("rec", self.slot))

    def synchronize(self):
        self.log.append(("sync", self.slot))


def _staging(slots, log):
    from k3ir.backends.triton.graphs import Staging
    return Staging(slots, pin=lambda n: torch.empty(n, dtype=torch.uint8), event=lambda: LogEvent(log))


def test_staging_ring_waits_for_a_buffer_before_rewriting_it():
    """Values changing every copy land in the destination; the ring wraps after ``slots`` copies and each
    reuse of a staging buffer first synchronises the event recorded behind that buffer's previous copy."""
    log = []
    st = _staging(3, log)
    dst = torch.zeros(5, dtype=torch.int64)
    for n in range(8):
        vals = np.arange(5, dtype=np.int64) * 7 + n
        st.copy(dst, vals)
        assert torch.equal(dst, torch.from_numpy(vals))
    recs = [s for a, s in log if a == "rec"]
    assert recs == [0, 1, 2, 0, 1, 2, 0, 1]
    assert sum(1 for a, _ in log if a == "new") == 3            # one event per slot, reused
    for n in range(3, 8):       # copy n reuses slot n % 3: its event synchronised right before its new record
        i = [j for j, e in enumerate(log) if e[0] == "rec"][n]
        assert log[i - 1] == ("sync", n % 3)
    assert not any(a == "sync" for a, _ in log[:[j for j, e in enumerate(log) if e[0] == "rec"][2] + 1])
    with pytest.raises(ValueError, match="3 values"):
        st.copy(dst, np.zeros(3, dtype=np.int64))
    big = torch.zeros(40, dtype=torch.float32)            # a larger copy grows the slot's buffer
    st.copy(big, torch.arange(40, dtype=torch.float32))
    assert torch.equal(big, torch.arange(40, dtype=torch.float32))


def _eager_capture(self, params, run_eager):
    """GraphDecode._capture for the CPU: 'replay' runs the step eagerly on the same static buffers, with the
    graph context (pos, nlen read from the io buffer) as under a capture."""
    gd = self

    class Replay:
        def replay(self):
            gd.exe.graph_ctx = {"pos": gd.pos, "nlen": gd.nlen}
            try:
                out = run_eager(list(gd.static), params)
                for i in range(1, len(gd.static)):
                    if out[i].data_ptr() != gd.static[i].data_ptr():
                        gd.static[i].copy_(out[i])
            finally:
                gd.exe.graph_ctx = None
            gd.out = out
    self.graph = Replay()
    self.captures += 1


@pytest.mark.slow
def test_graph_decode_stages_ids_position_and_length_in_one_copy(monkeypatch):
    """GraphDecode over 4 steps whose ids change every step (host numpy ids, then ids as a tensor): each step is
    one staged copy of [ids, pos, nlen] into the io buffer (ring of 2: it wraps), the MLA kernels read pos/nlen
    from it, the state hands off without copies, one capture, logits equal the float64 reference's."""
    from k3ir.backends.triton import graphs
    torch.set_num_threads(1)
    m = k3ir.load("kimi-linear-6p6b", KL)
    exe = k3ir.compile(m, target="triton", dtype="float32", device="cpu")
    ref = Session(k3ir.compile(m, target="reference"))
    tri = Session(exe, params=ref.params)
    log = []
    exe._staging = _staging(2, log)
    monkeypatch.setattr(graphs.GraphDecode, "_capture", _eager_capture)
    exe.cuda_graphs = True
    ids = np.random.default_rng(1).integers(3, 500, (2, 5))
    want, s_ref = ref.prefill(ids)
    got, s_tri = tri.prefill(ids)
    L = 5
    steps = [np.array([[5], [40]]), np.array([[41], [6]]), torch.tensor([[7], [300]]), np.array([[499], [3]])]
    for n, nxt in enumerate(steps):
        want, s_ref = ref.decode(np.asarray(nxt), s_ref)
        got, s_tri = tri.decode(nxt, s_tri)
        gd = exe._graph
        assert gd.io.tolist() == [int(v) for v in np.asarray(nxt).reshape(-1)] + [L + n, L + n + 1]
        assert int(gd.nlen[0]) == L + n + 1 and int(gd.pos[0]) == L + n
        assert rel_err(got.double().numpy(), want) < 1e-4, n
    assert gd.captures == 1
    assert [s for a, s in log if a == "rec"] == [0, 1, 0, 1]     # one staged copy per step, the ring wrapped
    assert [a for a, _ in log].count("sync") == 2


def test_session_keeps_device_ids_and_checks_their_shape():
    """Session._device_ids: an integer tensor on the executable's device type is kept (int64, values untouched:
    a 'meta' tensor has none), a host tensor is left to the host checks, bad shapes/dtypes raise K3RuntimeError."""
    sess = Session.__new__(Session)

    class Exe:
        tdev = torch.device("meta")
    sess.exe = Exe()
    ids = torch.empty(3, 1, dtype=torch.int32, device="meta")
    out = sess._device_ids(ids, "token_ids")
    assert out.dtype == torch.int64 and out.shape == (3, 1) and out.device.type == "meta"
    assert sess._device_ids(torch.zeros(3, 1, dtype=torch.int64), "token_ids") is None
    assert sess._device_ids(np.zeros((3, 1), dtype=np.int64), "token_ids") is None
    with pytest.raises(K3RuntimeError, match="integer token ids"):
        sess._device_ids(torch.empty(3, 1, device="meta"), "token_ids")
    with pytest.raises(K3RuntimeError, match=r"\[B, T\]"):
        sess._device_ids(torch.empty(3, dtype=torch.int64, device="meta"), "token_ids")


def _host_greedy(sess, ids, steps, eos):
    """The synchronous loop generate ran before: argmax of the float64 host logits, one decode per token."""
    logits, state = sess.prefill(ids)
    out = torch.from_numpy(ids)
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    for step in range(steps):
        nxt = torch.argmax(logits[:, -1].detach().to("cpu", torch.float64), dim=-1)
        if eos is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
            done |= nxt == eos
        out = torch.cat([out, nxt[:, None]], dim=1)
        if step + 1 < steps:
            logits, state = sess.decode(nxt[:, None].numpy(), state)
    return out


def test_greedy_generate_equals_the_synchronous_host_loop():
    """generate (temperature 0) picks each token where the logits live and feeds it back as a tensor: same tokens
    as the host loop, with and without an EOS that one row emits mid-way (that row keeps emitting it)."""
    m = k3ir.load("k3-tiny")
    sess = Session(k3ir.compile(m, target="torch", dtype="float32", device="cpu"))
    ids = np.random.default_rng(2).integers(3, 200, (3, 4))
    want = _host_greedy(sess, ids, 6, None)
    assert torch.equal(sess.generate(ids, 6), want)
    eos = int(want[1, 5])                       # row 1's second new token: its later tokens become eos
    want_eos = _host_greedy(sess, ids, 6, eos)
    assert (want_eos[1, 5:] == eos).all()
    assert torch.equal(sess.generate(ids, 6, eos_token_id=eos), want_eos)
    assert torch.equal(sess.generate(ids, 1), want[:, :5]) and torch.equal(sess.generate(ids, 0), want[:, :4])


def test_graph_cache_capacity_doubles_then_grows_linearly():
    """The decode graph's MLA cache capacity (graphs.capacity) always exceeds the rows held before the step,
    doubles from 256 up to 8192 rows and then grows by 8192: 6 captures up to 8192 tokens instead of 32."""
    from k3ir.backends.triton.graphs import capacity
    assert [capacity(L) for L in (0, 255, 256, 511, 512, 1023, 4096, 8191)] == \
        [256, 256, 512, 512, 1024, 1024, 8192, 8192]
    assert [capacity(L) for L in (8192, 16383, 16384, 20000)] == [16384, 16384, 24576, 24576]
    caps = {capacity(L) for L in range(8192)}
    assert len(caps) == 6 and all(capacity(L) > L for L in range(0, 40000, 7))
