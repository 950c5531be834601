"""Serving runtime: per-row MLA cache lengths, the paged pool and prefix cache, the
continuous-batching engine, sampling, tokenizers, ``k3ir generate``."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from conftest import rel_err
from helpers import greedy_alone, tiny_torch_session
from k3ir.frontend.model import add_varlen_function
from k3ir.runtime import Session
from k3ir.runtime.engine import Engine, build_engine
from k3ir.runtime.pool import StatePool, block_hashes
from k3ir.runtime.sampler import SamplingParams, filtered_probs, make_generator, sample
from k3ir.runtime.tokenizer import ByteTokenizer, IncrementalDecoder, load_tokenizer

import k3ir
from k3ir.errors import K3RuntimeError
from k3ir.ops.mla import mla_ref
from k3ir.types import StateType


@pytest.fixture(scope="module")
def tiny():
    return k3ir.load("k3-tiny")


@pytest.fixture(scope="module")
def session(tiny):
    """Plain Session (no pool, no varlen function): the independent path results are compared to."""
    return tiny_torch_session(tiny)



def _engine(tiny, **kw) -> Engine:
    kw.setdefault("block_size", 64)
    kw.setdefault("num_blocks", 64)
    return build_engine(tiny, seed=0, **kw)


# ---- k3.mla with per-row cache lengths -------------------------------------------------------
@pytest.mark.parametrize("absorbed", [False, True])
def test_mla_lengths_equal_rows_run_alone(absorbed, rng):
    H, n, r, vd, R, T = 2, 4, 3, 5, 6, 2
    lens = [5, 0, 3]
    L = max(lens)
    w = rng.standard_normal((H * (n + vd), R))
    kw = {"heads": H, "nope": n, "rope": r, "v_dim": vd, "scale": 0.3, "absorbed": absorbed}
    q = rng.standard_normal((3, T, H, n + r))
    kv = rng.standard_normal((3, T, R + r))
    caches = [rng.standard_normal((1, m, R + r)) for m in lens]
    padded = np.zeros((3, L, R + r))
    for b, c in enumerate(caches):
        padded[b, :lens[b]] = c[0]
    o, full = mla_ref(q, kv, w, padded, lengths=np.array(lens), **kw)
    for b in range(3):
        o1, f1 = mla_ref(q[b:b + 1], kv[b:b + 1], w, caches[b], **kw)
        assert rel_err(o[b], o1[0]) < 1e-12
        np.testing.assert_array_equal(full[b, L:], f1[0, lens[b]:])


def test_prefill_varlen_matches_separate_decodes(tiny, rng):
    """@prefill_varlen on right-padded caches == each row decoded alone (float64 reference and
    float32 torch), and the torch path agrees with the float64 reference."""
    m = add_varlen_function(tiny.clone())
    k3ir.verify_module(m)
    assert k3ir.print_module(k3ir.parse_module(k3ir.print_module(m))) == k3ir.print_module(m)
    prompts = [rng.integers(0, 256, (1, t)) for t in (9, 3, 6)]
    nxt = np.array([[3], [7], [11]])
    want = {}
    for target, dtype in (("reference", "float64"), ("torch", "float32")):
        s = Session(k3ir.compile(m, target=target, dtype=dtype), seed=0)
        states = [s.prefill(p)[1] for p in prompts]
        alone = [torch.as_tensor(s.decode(nxt[b:b + 1], st)[0])[0, 0] for b, st in enumerate(states)]
        L = max(st.length for st in states)
        args = []
        for name in states[0].names:
            rows = [torch.as_tensor(st.values[name]) for st in states]
            if "mla" in name:
                rows = [torch.cat([x, x.new_zeros((1, L - x.shape[1], x.shape[2]))], 1) for x in rows]
            args.append(torch.cat(rows, 0))
        outs = s.exe.run("prefill_varlen", [nxt, np.array([st.length for st in states])] + args, s.params)
        got = torch.as_tensor(outs[0])[:, 0]
        tol = 1e-10 if target == "reference" else 1e-5
        for b in range(3):
            assert rel_err(got[b].numpy(), alone[b].numpy()) < tol
        want[target] = got.double().numpy()
    assert rel_err(want["torch"], want["reference"]) < 1e-5


# ---- pool ------------------------------------------------------------------------------------------
SPECS = [("l0_mla_cache", StateType("mla_cache", (4, 2))), ("l1_kda_state", StateType("kda_state", (1, 2, 2))),
         ("l1_conv_q", StateType("conv_state", (3, 3)))]


def test_pool_block_size_must_be_multiple_of_kda_chunk():
    with pytest.raises(K3RuntimeError, match="multiple of the KDA chunk 64"):
        StatePool(SPECS, 4, block_size=96)
    assert StatePool(SPECS, 4, block_size=128).pages["l0_mla_cache"].shape == (4, 128, 6)


def test_block_hashes_are_chained():
    a = list(range(64)) + list(range(64))
    h = block_hashes(a, 64)
    assert len(h) == 2 and h[0] != h[1]                   # same tokens, different position in the chain
    assert block_hashes(a + [1, 2], 64) == h              # partial block: no hash
    assert block_hashes([9] + a[1:], 64)[1] != h[1]       # a change in block 0 changes block 1's hash


def test_pool_refcount_lru_eviction():
    p = StatePool(SPECS, 3, block_size=64)
    toks = list(range(128))
    hs = block_hashes(toks, 64)
    b0, b1 = p.allocate(), p.allocate()
    p.register(b0, hs[0])
    p.register(b1, hs[1])
    p.release([b0, b1])
    assert (p.num_free, p.num_cached, p.num_referenced) == (1, 2, 0)
    got, _ = p.match(toks + [5], max_tokens=128)
    assert got == [b0, b1] and p.num_referenced == 2
    p.release(got)
    got, _ = p.match(toks, max_tokens=127)                 # must leave a token to prefill: one block
    assert got == [b0]
    p.release(got)                                          # b1 is now least recently used
    c = p.allocate()                                        # the free block first
    d = p.allocate()                                        # then evict the LRU cached block
    assert d == b1 and p.stats["evictions"] == 1 and p.match(toks, 128)[0] == [b0]
    with pytest.raises(K3RuntimeError, match="exhausted"):
        p.allocate()
    p.release([b0, c, d])
    with pytest.raises(K3RuntimeError, match="released more often"):
        p.release([c])


# ---- engine: prefix cache, batching, pool hygiene --------------------------------------------------
@pytest.mark.parametrize("shared,total", [(128, 165), (100, 140), (64, 64 + 1), (130, 192)])
def test_prefix_hit_equals_fresh_prefill(tiny, session, shared, total):
    """Prefix lengths on and off block boundaries (block 64 = the KDA chunk)."""
    rng = np.random.default_rng(shared)
    base = rng.integers(0, 256, total).tolist()
    other = base[:shared] + rng.integers(0, 256, total - shared + 7).tolist()
    eng = _engine(tiny)
    sp = SamplingParams(max_tokens=5)
    eng.generate([other], sp)
    (req,) = eng.generate([base], sp, keep_logits=True)
    assert req.cached_tokens == min(shared, total - 1) // 64 * 64 > 0
    fresh, _ = session.prefill(np.array([base]))
    assert rel_err(req.logits[0].double().numpy(), fresh[0, -1].double().numpy()) < 1e-6
    assert req.output == greedy_alone(session, base, 5)


def test_mixed_length_batch_equals_alone(tiny, session):
    rng = np.random.default_rng(1)
    lens = [1, 5, 63, 64, 65, 130, 7, 200]
    prompts = [rng.integers(0, 256, n).tolist() for n in lens]
    params = [SamplingParams(max_tokens=3 + i % 4) for i in range(len(lens))]
    eng = _engine(tiny, max_batch=8)
    reqs = eng.generate(prompts, params)
    assert eng.stats["rows"] > eng.stats["calls"]          # rows of different lengths shared calls
    for p, sp, r in zip(prompts, params, reqs):
        assert r.output == greedy_alone(session, p, sp.max_tokens)
    sampled = [SamplingParams(max_tokens=6, temperature=0.9, top_k=50, top_p=0.9, seed=i) for i in range(len(lens))]
    batch = [r.output for r in _engine(tiny, max_batch=8).generate(prompts, sampled)]
    alone = _engine(tiny, max_batch=1)
    assert batch == [alone.generate([p], sp)[0].output for p, sp in zip(prompts, sampled)]


def test_stop_token_ends_request(tiny, session):
    p = list(b"stop here")
    want = greedy_alone(session, p, 6)
    (r,) = _engine(tiny).generate([p], SamplingParams(max_tokens=6, stop_token_ids=[want[2]]))
    k = want.index(want[2])
    assert r.output == want[:k + 1] and r.finish_reason == "stop"
    (r,) = _engine(tiny).generate([p], SamplingParams(max_tokens=4))
    assert r.output == want[:4] and r.finish_reason == "length"


@pytest.mark.parametrize("n", [250, pytest.param(1000, marks=pytest.mark.slow)])
def test_random_requests_free_every_block(tiny, n):
    """``n`` requests (250 in the default suite, 1,000 with ``-m slow``: ~15 s of CPU), random prompt lengths
    (from a small set, so prefill rows batch) and output lengths; every 10th is a 65..100-token prefix of one of
    3 shared stems (prefix hits on their first block). Afterwards no block is referenced or leaked. Device
    evictions and the host tier: ``test_prefix_host_tier.py``'s 1,000 requests."""
    rng = np.random.default_rng(7)
    eng = _engine(tiny, num_blocks=34, max_batch=32)
    stems = [rng.integers(0, 256, 100).tolist() for _ in range(3)]
    reqs = []
    for i in range(n):
        if i % 10 == 0:
            prompt = stems[i % 3][:int(rng.choice([65, 80, 100]))]
        else:
            prompt = rng.integers(0, 256, int(rng.choice([1, 2, 3, 5, 8, 13, 21]))).tolist()
        reqs.append(eng.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(1, 4)), seed=i,
                                                          temperature=float(i % 2))))
    eng.run(reqs)
    assert all(r.done and r.finish_reason in ("stop", "length") for r in reqs)
    assert eng.pool.stats["hits"] > 0
    p = eng.pool
    assert p.num_referenced == 0 and eng.reserved == 0 and not eng.running and not eng.waiting
    assert p.num_free + p.num_cached == p.num_blocks
    p.clear_cache()
    assert p.num_free == p.num_blocks and sorted(p.free) == list(range(p.num_blocks))


def test_request_validation(tiny):
    eng = _engine(tiny, num_blocks=2)
    with pytest.raises(K3RuntimeError, match="empty"):
        eng.make_request([])
    with pytest.raises(K3RuntimeError, match="outside the vocabulary"):
        eng.make_request([1, 999])
    with pytest.raises(K3RuntimeError, match=r"prompt 100 \+ max_tokens 60 tokens do not fit the pool of 128 tokens \(2 blocks of 64\): max_tokens can be at most 28"):
        eng.make_request([1] * 100, SamplingParams(max_tokens=60))
    with pytest.raises(K3RuntimeError, match="top_p"):
        SamplingParams(top_p=0)


# ---- sampler -----------------------------------------------------------------------------------------
def test_filtered_probs_hand_computed():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 1.0])
    e = np.exp([2.0, 1.0, 0.0, -1.0, 1.0])
    np.testing.assert_allclose(filtered_probs(logits, 1.0).numpy(), e / e.sum(), rtol=1e-12)
    k2 = np.array([e[0], e[1], 0, 0, 0])                       # tie 1.0 at ids 1 and 4: lower id kept
    np.testing.assert_allclose(filtered_probs(logits, 1.0, top_k=2).numpy(), k2 / k2.sum(), rtol=1e-12)
    p = e / e.sum()                                            # sorted: 0 (.5206), 1, 4 (.1915 each), 2, 3
    keep = np.array([p[0], p[1], 0, 0, 0])                     # .5206 + .1915 = .7121 >= .7: stop
    np.testing.assert_allclose(filtered_probs(logits, 1.0, top_p=0.7).numpy(), keep / keep.sum(), rtol=1e-12)
    keep = np.array([p[0], p[1], 0, 0, p[4]])                  # .7121 < .75: add id 4 (tie: lower id first)
    np.testing.assert_allclose(filtered_probs(logits, 1.0, top_p=0.75).numpy(), keep / keep.sum(), rtol=1e-12)
    t = np.exp(np.array([2.0, 1.0, 0.0, -1.0, 1.0]) / 0.5)
    np.testing.assert_allclose(filtered_probs(logits, 0.5).numpy(), t / t.sum(), rtol=1e-12)


def test_sample_greedy_seeded_and_frequencies():
    logits = torch.tensor([0.5, 3.0, 3.0, 1.0])
    assert sample(logits, SamplingParams(temperature=0), None) == 1
    sp = SamplingParams(temperature=1.0, top_k=3, seed=5)
    a = [sample(logits, sp, g) for g in [make_generator(5)] for _ in range(50)]
    b = [sample(logits, sp, g) for g in [make_generator(5)] for _ in range(50)]
    assert a == b
    g = make_generator(0)
    draws = np.bincount([sample(logits, sp, g) for _ in range(4000)], minlength=4) / 4000
    want = filtered_probs(logits, 1.0, top_k=3).numpy()
    assert draws[3] == 0 or want[3] > 0
    assert np.abs(draws - want).max() < 0.03


# ---- tokenizers ---------------------------------------------------------------------------------------
def test_byte_tokenizer_and_incremental_decoding(tiny):
    tok = load_tokenizer("k3-tiny", tiny)
    assert isinstance(tok, ByteTokenizer) and tok.stop_ids == [257]
    ids = tok.encode("héllo €")
    assert ids[0] == 256 and bytes(ids[1:]) == "héllo €".encode()
    assert tok.decode(ids + [257]) == "héllo €"
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(t) for t in ids[1:]]
    assert "".join(pieces) + dec.flush() == "héllo €" and pieces[-3:] == ["", "", "€"]   # € is 3 bytes
    assert tok.chat([{"role": "user", "content": "hi"}]) == tok.encode("user: hi\nassistant: ")


def test_hf_tokenizer_json_and_chat_template(tmp_path, tiny):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4, "<|user|>": 5, "<|bot|>": 6}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["<s>", "</s>", "<|user|>", "<|bot|>"])
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": '
        '"{{ bos_token }}{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}'
        '{% if add_generation_prompt %}<|bot|>{% endif %}"}')
    tok = load_tokenizer(str(tmp_path), tiny)
    assert tok.encode("hello world") == [3, 4] and tok.stop_ids == [1]
    assert tok.chat([{"role": "user", "content": "hello"}]) == [0, 5, 3, 6]
    assert tok.decode([0, 3, 4, 1]) == "hello world"


def test_tiktoken_file(tmp_path, tiny):
    lines = [f"{base64.b64encode(bytes([i])).decode()} {i}" for i in range(256)]
    lines.append(f"{base64.b64encode(b'ab').decode()} 256")
    (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    (tmp_path / "tokenizer_config.json").write_text(
        '{"eos_token": "<|eos|>", "added_tokens_decoder": {"257": {"content": "<|eos|>"}}}')
    tok = load_tokenizer(str(tmp_path), tiny)
    assert tok.encode("abc") == [256, ord("c")] and tok.stop_ids == [257]
    assert tok.decode([256, ord("c"), 257]) == "abc"


def test_cli_generate_matches_session(tiny, session, capsys):
    from k3ir.cli import main
    assert main(["generate", "k3-tiny", "--prompt", "Kimi", "--max-tokens", "5", "--block-size", "64",
                 "--show-ids"]) == 0
    out = capsys.readouterr().out
    ids = [256] + list(b"Kimi")
    want = greedy_alone(session, ids, 5)
    assert f"token ids: {want}" in out
    assert main(["generate", "k3-tiny", "--prompt", "x", "--block-size", "100"]) == 2
    assert "multiple of the KDA chunk" in capsys.readouterr().err
