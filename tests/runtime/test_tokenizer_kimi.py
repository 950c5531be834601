"""Kimi's tiktoken tokenizer (``runtime/tokenizer.py``) against the published ``tokenization_kimi.py``.

The real 163,584-rank vocabulary cannot be downloaded here, so each test writes a small tiktoken
vocabulary (all 256 bytes plus 18 merges) in tiktoken's ``.model`` format into a checkpoint
directory with a ``tokenizer_config.json``; every expected split and id below is worked out by hand
from that table.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import regex
from conftest import one_line_error, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from k3ir.runtime.tokenizer import KIMI_PAT_STR, ByteTokenizer, KimiTokenizer, cut_long_runs, load_tokenizer

from k3ir.errors import K3ConfigError, K3RuntimeError

tiktoken = pytest.importorskip("tiktoken")

# The pre-tokeniser split, quoted from the published tokenization_kimi.py (class TikTokenTokenizer,
# attribute pat_str) of moonshotai/Kimi-K2-Instruct on the Hugging Face hub
# (https://huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/tokenization_kimi.py); Kimi-Linear-48B-A3B
# and Kimi-K3 publish the same pattern. `&&` is a class intersection: letters except Han characters.
PUBLISHED_ALTERNATIVES = [
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
]
PUBLISHED_PAT = "|".join(PUBLISHED_ALTERNATIVES)
#: tiktoken's cl100k_base split, which runtime/tokenizer.py applied to every tiktoken file before
CL100K_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

#: ranks 256.. of the test vocabulary (ranks 0..255 are the single bytes 0..255)
MERGES = [b"oW", b"ll", b"he", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world",
          b"\xe4\xbd", "你".encode(), b"\xe5\xa5", "好".encode(), "你好".encode(), b"12", b"'s", b"Ki"]
BASE = 256 + len(MERGES)                 # 274 ranks: the first special id
VOCAB = BASE + 256                       # the model's vocabulary: base ranks + 256 reserved ids = 530

# Latin, Han, digits, whitespace runs, an emoji, a Han run glued to Latin letters, camel case
TEXT = "hello world 你好Kimi's 12345\n\n  x\t🙂 helloWorld\n"
#: (pre-token under Kimi's pattern, its ids by BPE over the table above), worked out by hand
KIMI_PIECES = [
    ("hello", [260]),                    # ll(257), he(258), hell(259), hello(260)
    (" world", [265]),                   # the whole piece is a rank
    (" ", [32]),                         # a space before Han: no letter rule takes it, \s+ does
    ("你好", [270]),                     # [\p{Han}]+ alone: the Han run ends at the Latin letter
    ("Kimi's", [273, ord("m"), ord("i"), 272]),  # 's(272) merges first, then Ki(273)
    (" ", [32]),                         # " ?[^\s\p{L}\p{N}]" cannot take a digit: \s+ does
    ("123", [271, ord("3")]),            # \p{N}{1,3}
    ("45", [ord("4"), ord("5")]),
    ("\n\n", [10, 10]),                  # \s*[\r\n]+ stops at the last newline
    (" ", [32]),                         # \s+(?!\S) leaves the space before "x"
    (" x", [32, ord("x")]),
    ("\t", [9]),
    ("🙂", [0xF0, 0x9F, 0x99, 0x82]),     # ?[^\s\p{L}\p{N}]+: a symbol run
    (" hello", [32, 260]),               # " h" is not a rank
    ("World", [ord("W"), 262, 264]),     # camel case starts a new piece: no "oW" merge across it
    ("\n", [10]),
]
KIMI_IDS = [i for _, ids in KIMI_PIECES for i in ids]
#: the same text under the cl100k pattern, by hand: Han and Latin letters glued, 's apart, camel case whole
CL100K_PIECES = ["hello", " world", " 你好Kimi", "'s", " ", "123", "45", "\n\n", " ", " x", "\t", "🙂", " helloWorld",
                 "\n"]

#: named special tokens at Kimi's offsets from the first special id (the rest are reserved names)
NAMED = {0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|im_end|>", True), 3: ("<|im_user|>", True),
         4: ("<|im_assistant|>", True), 11: ("<|tool_calls_section_begin|>", False), 254: ("[UNK]", True),
         255: ("[PAD]", True)}


def write_tiktoken(path: Path, merges=MERGES) -> None:
    """tiktoken's ``.model`` format: one ``base64(token bytes) rank`` line per rank."""
    pieces = [bytes([b]) for b in range(256)] + list(merges)
    path.write_text("".join(f"{base64.b64encode(p).decode()} {r}\n" for r, p in enumerate(pieces)))


def kimi_config(**extra) -> dict:
    cfg = {"tokenizer_class": "TikTokenTokenizer",
           "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
           "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
           "added_tokens_decoder": {str(BASE + k): {"content": c, "special": s, "lstrip": False, "normalized": False,
                                                    "rstrip": False, "single_word": False}
                                    for k, (c, s) in NAMED.items()}}
    cfg.update(extra)
    return cfg


@pytest.fixture
def ckpt(tmp_path) -> Path:
    write_tiktoken(tmp_path / "tiktoken.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(kimi_config()))
    return tmp_path


def model(vocab: int = VOCAB) -> SimpleNamespace:
    return SimpleNamespace(attrs={"vocab_size": vocab})


@pytest.fixture
def tok(ckpt) -> KimiTokenizer:
    t = load_tokenizer(str(ckpt), model())
    assert isinstance(t, KimiTokenizer)
    return t


# ---- the split pattern -----------------------------------------------------------------------------
def test_published_pattern_splits_by_hand():
    """The quoted pattern splits TEXT into the hand-written pieces (the `regex` module needs V1 for
    `&&`, which tiktoken's Rust regex reads natively); the cl100k pattern splits it otherwise."""
    assert KIMI_PAT_STR == PUBLISHED_PAT
    assert regex.findall(PUBLISHED_PAT, TEXT, flags=regex.V1) == [p for p, _ in KIMI_PIECES]
    assert regex.findall(CL100K_PAT, TEXT) == CL100K_PIECES
    assert CL100K_PIECES != [p for p, _ in KIMI_PIECES]


def test_encode_gives_hand_written_ids(tok):
    assert tok.encode(TEXT) == KIMI_IDS
    for piece, ids in KIMI_PIECES:
        assert tok.encode(piece) == ids, piece
    assert tok.bos_id not in tok.encode(TEXT)            # the published encode adds no BOS


def test_cl100k_pattern_gives_other_ids(tok):
    """What the old default did with the same ranks: " helloWorld" stays one piece and "oW" (rank
    256, the lowest merge) is taken before "hello" can form."""
    old = tiktoken.Encoding("cl100k-split", pat_str=CL100K_PAT,
                            mergeable_ranks={p: r for r, p in enumerate([bytes([b]) for b in range(256)] + MERGES)},
                            special_tokens={})
    got = old.encode(TEXT)
    assert got != KIMI_IDS and got[-6:] == [32, 259, 256, 262, 264, 10]   # " ", hell, oW, or, ld, "\n"
    assert tok.encode(TEXT)[-6:] == [32, 260, ord("W"), 262, 264, 10]


def test_round_trip(tok):
    assert tok.decode(tok.encode(TEXT)) == TEXT


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("helo wrdKi's12345你好数据\n\t🙂Éé_-.")), max_size=40))
def test_round_trip_fuzz(tmp_path_factory, text):
    d = tmp_path_factory.getbasetemp() / "kimi-fuzz"
    if not d.exists():
        d.mkdir()
        write_tiktoken(d / "tiktoken.model")
        (d / "tokenizer_config.json").write_text(json.dumps(kimi_config()))
    t = load_tokenizer(str(d), model())
    ids = t.encode(text)
    assert all(0 <= i < BASE for i in ids)               # the alphabet holds no special-token text
    assert t.decode(ids) == text


# ---- special and reserved tokens ---------------------------------------------------------------------
def test_special_tokens_fill_the_vocabulary(tok):
    """As the published file: ids BASE..BASE+255 are special, named from added_tokens_decoder or
    <|reserved_token_{id}|>."""
    assert tok.vocab_size == VOCAB
    assert len(tok.special_tokens) == 256 and set(tok.special_tokens.values()) == set(range(BASE, VOCAB))
    for k, (content, _) in NAMED.items():
        assert tok.special_tokens[content] == BASE + k
    assert tok.special_tokens["<|reserved_token_279|>"] == 279 and "<|reserved_token_280|>" in tok.special_tokens
    assert tok.encode("<|im_user|>hello<|reserved_token_300|>") == [BASE + 3, 260, 300]
    assert tok.encode("<|im_user|>", allow_special=False) == list(b"<|im_user|>")


def test_every_id_below_vocab_size_decodes(tok):
    """Reserved ids (the old code's tiktoken KeyError) decode to nothing, or to their names with
    skip_special_tokens=False; a token the config marks "special": false always shows."""
    for i in range(VOCAB):
        tok.decode([i])
        tok.decode([i], skip_special_tokens=False)
    assert tok.decode([279]) == "" and tok.decode([279], skip_special_tokens=False) == "<|reserved_token_279|>"
    assert tok.decode([260, BASE + 1, 32, 300, 265]) == "hello  world"
    assert tok.decode([BASE + 2, 260], skip_special_tokens=False) == "<|im_end|>hello"
    assert tok.decode([BASE + 11, 260]) == "<|tool_calls_section_begin|>hello"


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 7, 10**12, -1])
def test_ids_outside_the_vocabulary_are_errors(tok, bad):
    with pytest.raises(K3RuntimeError, match=rf"token id {bad} .*0\.\.{VOCAB - 1}"):
        tok.decode([260, bad])


def test_model_vocabulary_larger_than_the_table(ckpt):
    """Model rows past the tokenizer's table (padding) decode to nothing; past the model, an error."""
    t = load_tokenizer(str(ckpt), model(VOCAB + 64))
    assert t.vocab_size == VOCAB + 64 and t.decode([260, VOCAB + 10]) == "hello"
    with pytest.raises(K3RuntimeError, match=f"token id {VOCAB + 64} "):
        t.decode([VOCAB + 64])


def test_bos_eos_and_stop_ids(ckpt):
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [BASE + 2, BASE + 1]}))
    t = load_tokenizer(str(ckpt), model())
    assert t.bos_id == BASE and t.bos_token == "[BOS]" and t.eos_token == "[EOS]"
    assert sorted(t.stop_ids) == [BASE + 1, BASE + 2]    # the tokenizer's eos + generation_config's


def test_eos_not_in_the_table_is_an_error(ckpt):
    (ckpt / "tokenizer_config.json").write_text(json.dumps(kimi_config(eos_token="<|eot|>")))
    with pytest.raises(K3ConfigError, match=r"tokenizer_config.json: key 'eos_token': '<\|eot\|>' is not"):
        load_tokenizer(str(ckpt), model())


# ---- recognising the checkpoint's files ------------------------------------------------------------------
def test_recognised_without_running_the_checkpoint_code(ckpt, tmp_path_factory):
    """tokenization_kimi.py is never imported; with tokenizer_class TikTokenTokenizer the tiktoken
    file wins over a tokenizer.json next to it."""
    marker = tmp_path_factory.mktemp("marker") / "ran"
    (ckpt / "tokenization_kimi.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(ckpt / "tokenizer.json"))
    t = load_tokenizer(str(ckpt), model())
    assert isinstance(t, KimiTokenizer) and t.encode(TEXT) == KIMI_IDS
    assert not marker.exists()


def test_tiktoken_file_without_kimi_markers_reads_as_kimi(ckpt):
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[EOS]",
                                                            "added_tokens_decoder": {str(BASE + 1): {"content": "[EOS]"}}}))
    t = load_tokenizer(str(ckpt), model())
    assert t.encode(TEXT) == KIMI_IDS and t.stop_ids == [BASE + 1] and t.bos_id is None


def test_long_runs_are_cut_as_published(tok):
    """The published encode cuts runs of more than 25,000 non-space (or space) characters, so the
    last 'l' is its own piece: x + 12,499 x ll + l, then l."""
    ids = tok.encode("x" + "l" * 25000)
    assert ids == [ord("x")] + [257] * 12499 + [ord("l"), ord("l")]
    assert tok.encode("x" + "l" * 24999) == [ord("x")] + [257] * 12499 + [ord("l")]


def published_cut(s: str, limit: int) -> list[str]:
    """The published _split_whitespaces_or_nonwhitespaces, restated as a character loop."""
    out, start, run, space = [], 0, 0, s[:1].isspace()
    for i, ch in enumerate(s):
        if ch.isspace() != space:
            run, space = 1, ch.isspace()
        else:
            run += 1
            if run > limit:
                out.append(s[start:i])
                start, run = i, 1
    return out + [s[start:]]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(["a", "b", " ", "\n", "\u3000", "你"]), max_size=30),
       st.integers(min_value=1, max_value=4))
def test_cut_long_runs_equals_the_published_loop(text, limit):
    assert list(cut_long_runs(text, limit)) == published_cut(text, limit)


@pytest.mark.parametrize("content, where", [
    ("aGk= 0\nbad-line\n", "line 2"),
    ("aGk= 0\n!!!! 1\n", "line 2"),
    ("aGk= x\n", "line 1"),
])
def test_bad_tiktoken_file(tmp_path, content, where):
    (tmp_path / "tiktoken.model").write_text(content)
    with pytest.raises(K3ConfigError, match=f"tiktoken.model: {where}: "):
        load_tokenizer(str(tmp_path), model())


@pytest.mark.parametrize("entries", [{"-1": {"content": "[X]"}}, {"²": {"content": "[X]"}}, {"280": {"special": True}},
                                     {"280": {"content": 7}}, ["[X]"]])
def test_bad_added_tokens_decoder(ckpt, entries):
    (ckpt / "tokenizer_config.json").write_text(json.dumps(kimi_config(added_tokens_decoder=entries)))
    with pytest.raises(K3ConfigError, match=r"tokenizer_config.json: key 'added_tokens_decoder': "):
        load_tokenizer(str(ckpt), model())


def test_tiktoken_file_missing_a_byte(tmp_path):
    pieces = [bytes([b]) for b in range(256) if b != 0x41] + [b"ab"]
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(p).decode()} {r}\n"
                                                     for r, p in enumerate(pieces)))
    with pytest.raises(K3ConfigError, match=r"tiktoken.model: .*byte 0x41"):
        load_tokenizer(str(tmp_path), model())


# ---- every tokenizer: ids outside the vocabulary -------------------------------------------------------
def test_hf_tokenizer_ids_outside_the_vocabulary(tmp_path):
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(str(tmp_path), model(8))
    assert t.vocab_size == 8 and t.decode([1, 5]) == "hello"          # model padding rows: nothing
    for bad in (8, -1):
        with pytest.raises(K3RuntimeError, match=f"token id {bad} "):
            t.decode([1, bad])


def test_byte_tokenizer_ids_outside_the_vocabulary():
    t = ByteTokenizer(256, 257, vocab_size=260)
    assert t.decode([104, 105, 259]) == "hi"
    with pytest.raises(K3RuntimeError, match="token id 260 "):
        t.decode([104, 260])


# ---- what `k3ir generate` loads ---------------------------------------------------------------------------
def test_generate_reads_the_checkpoint_tokenizer(ckpt, capsys):
    """k3ir generate on a k3-tiny checkpoint directory with the Kimi tokenizer: the random model's
    reserved ids decode (before: tiktoken KeyError)."""
    rc, out, err = run_cli(capsys, "generate", str(tiny_checkpoint(ckpt)), "--prompt", "hello 你好", "--max-tokens", "24",
                           "--block-size", "64", "--show-ids")
    assert rc == 0, one_line_error(err) if err else out
    new = [int(x) for x in out.split("token ids: [")[1].split("]")[0].split(",")]
    assert any(i >= BASE for i in new), new                 # the check below is not vacuous
    t = load_tokenizer(str(ckpt), model())
    assert out.startswith("hello 你好" + t.decode(new))



def tiny_checkpoint(ckpt: Path) -> Path:
    """k3-tiny's config.json, its vocabulary widened to the tokenizer's 530 ids, next to the tokenizer."""
    cfg = json.loads((Path(__file__).parents[2] / "frontend" / "configs" / "k3-tiny.json").read_text())
    cfg["text_config"]["vocab_size"] = VOCAB
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt / "config.json"


def test_server_completion_with_reserved_ids(ckpt):
    """/v1/completions on the same checkpoint: 200 and the greedy tokens' text (before: a 500 from
    the tiktoken KeyError on the first reserved id)."""
    pytest.importorskip("fastapi")
    import numpy as np
    from fastapi.testclient import TestClient
    from k3ir.runtime import Session
    from k3ir.runtime.engine import build_engine
    from k3ir.runtime.server import ServerLimits, create_app

    import k3ir
    m = k3ir.load(str(tiny_checkpoint(ckpt)))
    tok = load_tokenizer(str(ckpt / "config.json"), m)
    prompt = tok.encode("hello 你好")
    out = Session(k3ir.compile(m, target="torch", dtype="float32"), seed=0).generate(np.array([prompt]), 16)
    out = out[0, len(prompt):].tolist()
    out = out[:out.index(BASE + 1) + 1] if BASE + 1 in out else out
    assert any(BASE <= i < VOCAB for i in out), out           # reserved or special ids among them
    with TestClient(create_app(build_engine(m, block_size=64, num_blocks=16, max_batch=2), tok, "kimi-tiny",
                               ServerLimits())) as c:
        r = c.post("/v1/completions", json={"prompt": "hello 你好", "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode(out)
