"""Text <-> token ids for serving: the checkpoint's tokenizer with its chat template
(``chat_template.jinja`` or ``tokenizer_config.json: chat_template``, rendered by ``chat``), or bytes for the bundled
tiny models (ids 0..255 are the bytes; ids >= 256 are the config's special tokens).

Checkpoint tokenizers (``docs/checkpoints.md``): Kimi's tiktoken tokenizer (``tiktoken.model`` read
as the published ``tokenization_kimi.py`` reads it, without running that file) and HF
``tokenizer.json`` files (through the ``tokenizers`` package). Every tokenizer decodes every id below
its ``vocab_size`` (the model's vocabulary, or the tokenizer's table where that is larger) and raises
K3RuntimeError naming any other id."""
from __future__ import annotations

import base64
import binascii
import functools
import json
import logging
import operator
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from k3ir.errors import K3ConfigError, K3RuntimeError

from .chat import SIMPLE_TEMPLATE, chat_ids, read_chat_template
from .chat import render_chat as render_template

logger = logging.getLogger(__name__)

TIKTOKEN_FILES = ("tiktoken.model", "tokenizer.model")

#: Kimi's pre-tokeniser split, from the published ``tokenization_kimi.py`` (class TikTokenTokenizer,
#: attribute ``pat_str``) of moonshotai/Kimi-K2-Instruct on the Hugging Face hub
#: (https://huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/tokenization_kimi.py; Kimi-Linear-48B-A3B
#: and Kimi-K3 publish the same). In order: a Han run; a letter run without Han (an optional leading
#: non-letter, then upper-case letters before lower-case ones, so camel case splits) keeping an English
#: contraction; the same with upper-case letters required; 1-3 digits; a punctuation run; newlines;
#: spaces. ``&&`` intersects two classes (tiktoken's Rust regex reads it; Python's ``regex`` needs V1).
KIMI_PAT_ALTERNATIVES = (
    r"""[\p{Han}]+""",
    (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
     r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""),
    (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
     r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""),
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
KIMI_PAT_STR = "|".join(KIMI_PAT_ALTERNATIVES)
#: special-token ids after the base ranks (the published ``num_reserved_special_tokens``): named from
#: ``added_tokens_decoder`` or ``<|reserved_token_{id}|>``; 163,584 ranks + 256 = Kimi's 163,840 ids.
#: (Kimi-Linear's file registers 2 more, past its 163,840-entry vocabulary; they are not registered here.)
KIMI_NUM_RESERVED = 256
#: the published encode cuts text into slices of 400,000 characters, and those into pieces holding at
#: most 25,000 consecutive space (or non-space) characters, before tiktoken sees them
KIMI_MAX_ENCODE_CHARS = 400_000
KIMI_MAX_RUN_CHARS = 25_000


class Tokenizer:
    """Common interface. ``encode(text) -> ids``, ``decode(ids) -> text`` (special tokens skipped
    unless ``skip_special_tokens=False``), ``chat(messages) -> ids`` (template + generation prompt),
    ``stop_ids``. ``vocab_size``: ids 0..vocab_size-1 decode; any other id raises K3RuntimeError."""
    name = "base"
    vocab_size: int = 0
    source: str = ""
    bos_id: int | None = None
    stop_ids: Sequence[int] = ()
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def checked_ids(self, ids: Sequence[int]) -> list[int]:
        """``ids`` as Python ints; K3RuntimeError naming the first id outside 0..vocab_size-1."""
        out = []
        for t in ids:
            try:
                i = operator.index(t)
            except TypeError:
                raise K3RuntimeError(f"token ids must be integers, got {type(t).__name__} {t!r}") from None
            if not 0 <= i < self.vocab_size:
                raise K3RuntimeError(f"token id {i} is outside the vocabulary 0..{self.vocab_size - 1} of the "
                                     f"{self.name} tokenizer{f' ({self.source})' if self.source else ''}")
            out.append(i)
        return out

    @property
    def control_tokens(self) -> tuple[str, ...]:
        """The texts ``encode`` reads as control (special) ids; () when it reads none."""
        return ()

    def special_id(self, text: str) -> int | None:
        """The control id spelled ``text`` (e.g. ``"<|tool_call_begin|>"``), or None."""
        return None

    def encode_text(self, text: str) -> list[int]:
        """``text`` encoded as plain text: control-token spellings in it give ordinary ids, never control ids."""
        return self.encode(text)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of ``messages`` (OpenAI-style dicts) and ``tools`` ending in the assistant turn
        (``chat.render_chat`` with the checkpoint's template, or ``chat.SIMPLE_TEMPLATE``)."""
        return render_template(self.chat_template or SIMPLE_TEMPLATE, messages, tools, bos_token=self.bos_token,
                           eos_token=self.eos_token)

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
             assistant_prefix: str = "") -> list[int]:
        """Prompt ids of ``messages`` and ``tools`` (``chat.chat_ids``: client text never gives control ids)."""
        return chat_ids(self, messages, tools, assistant_prefix)


class ByteTokenizer(Tokenizer):
    """Bytes as ids 0..255 (UTF-8); ``bos_id`` is prepended by ``encode``; ids 256..vocab_size-1
    decode to nothing. The bundled tiny models use it."""
    name = "bytes"

    def __init__(self, bos_id: int | None = None, eos_id: int | None = None, vocab_size: int = 256):
        self.bos_id, self.vocab_size = bos_id, vocab_size
        self.stop_ids = [eos_id] if eos_id is not None else []

    def encode(self, text: str) -> list[int]:
        return ([self.bos_id] if self.bos_id is not None else []) + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(t for t in self.checked_ids(ids) if t < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` (HF ``tokenizers``) with ``tokenizer_config.json`` for specials/template.
    ``vocab_size``: the larger of the model's vocabulary and the file's (added tokens included); model
    ids the file has no token for decode to nothing."""
    name = "tokenizers"

    def __init__(self, path: Path, config: dict[str, Any], model_vocab: int = 0):
        from tokenizers import Tokenizer as _T
        self.tok = _T.from_file(str(path))
        self.source = os.fspath(path)
        self.vocab_size = max(self.tok.get_vocab_size(with_added_tokens=True), model_vocab)
        _specials(self, config, self.tok.token_to_id)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(self.checked_ids(ids), skip_special_tokens=skip_special_tokens)

    @property
    def control_tokens(self) -> tuple[str, ...]:
        return tuple(t.content for t in self.tok.get_added_tokens_decoder().values())

    def special_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text) if text in self.control_tokens else None

    def encode_text(self, text: str) -> list[int]:
        self.tok.encode_special_tokens = True       # added tokens split as text
        try:
            return self.tok.encode(text, add_special_tokens=False).ids
        finally:
            self.tok.encode_special_tokens = False


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file (``tiktoken.model``): one ``base64(token bytes) rank`` line per token, as
    tiktoken's ``load_tiktoken_bpe`` reads it. Returns ``{token bytes: rank}``. Raises K3ConfigError
    naming the file (and line) for a malformed line, ranks that are not 0..n-1 each once, or a single
    byte without a rank (byte-level BPE must be able to spell any text)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise K3ConfigError(f"cannot read the tiktoken file ({e.strerror or e})", path=os.fspath(path)) from None
    hint = " (a SentencePiece tokenizer.model is not supported)" if path.name == "tokenizer.model" else ""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected 'base64-token rank'")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise K3ConfigError(f"line {lineno}: not a tiktoken BPE line ({e}): {line[:60]!r}{hint}",
                                path=os.fspath(path)) from None
        if token in ranks:
            raise K3ConfigError(f"line {lineno}: token {token!r} is ranked twice", path=os.fspath(path))
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise K3ConfigError(f"ranks must be 0..{len(ranks) - 1}, each once (a rank repeats or is missing)",
                            path=os.fspath(path))
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise K3ConfigError(f"no rank for the single byte 0x{missing[0]:02x}"
                            f"{f' (and {len(missing) - 1} more bytes)' if len(missing) > 1 else ''}: a byte-level "
                            f"BPE file ranks all 256 bytes{hint}", path=os.fspath(path))
    return ranks


@functools.lru_cache(maxsize=4)
def _long_runs(limit: int) -> re.Pattern:
    # a run of more than `limit` space or non-space characters, matched only at the run's start (linear time)
    return re.compile(rf"(?<!\S)\S{{{limit + 1},}}|(?<!\s)\s{{{limit + 1},}}")


def cut_long_runs(text: str, limit: int = KIMI_MAX_RUN_CHARS) -> Iterator[str]:
    """``text`` in pieces that hold at most ``limit`` consecutive space (``str.isspace``) or non-space
    characters: a run is cut after each ``limit`` characters, as the published Kimi encode cuts it
    (``_split_whitespaces_or_nonwhitespaces``). Yields one piece (maybe empty) when nothing is cut."""
    start = 0
    for m in _long_runs(limit).finditer(text):
        for cut in range(m.start() + limit, m.end(), limit):
            yield text[start:cut]
            start = cut
    yield text[start:]


class KimiTokenizer(Tokenizer):
    """Kimi's tiktoken tokenizer as the published ``tokenization_kimi.py`` (TikTokenTokenizer) builds it:
    the base ranks of ``tiktoken.model``, Kimi's split ``KIMI_PAT_STR`` (or ``tokenizer_config.json:
    pat_str``), and special tokens at ids base..base+255, named from ``added_tokens_decoder`` or
    ``<|reserved_token_{id}|>``. ``encode`` adds no BOS and reads special-token text as the special id
    (``allow_special=False``: as plain text), after cutting long runs as the published encode does.

    ``decode``: base ranks to their bytes (UTF-8, invalid bytes replaced); with ``skip_special_tokens``
    (the default) a special or reserved id gives nothing unless ``added_tokens_decoder`` marks it
    ``"special": false`` (then its text), without it every special id gives its name. Named tokens
    past the 256 (not registered by the published file either) decode to their names and are not
    encoded; model ids with no token at all decode to nothing. ``vocab_size``: the larger of the
    model's vocabulary and base + 256."""
    name = "kimi-tiktoken"

    def __init__(self, path: Path, config: dict[str, Any], model_vocab: int = 0,
                 config_path: Path | None = None):
        import tiktoken
        ranks = read_tiktoken_ranks(path)
        base = len(ranks)
        cfg = os.fspath(config_path) if config_path is not None else None
        named = _added_tokens(config, cfg)
        self.special_tokens: dict[str, int] = {
            named.get(i, (f"<|reserved_token_{i}|>", True))[0]: i for i in range(base, base + KIMI_NUM_RESERVED)}
        pat_str = config.get("pat_str", KIMI_PAT_STR)
        if not isinstance(pat_str, str):
            raise K3ConfigError(f"must be a regex string, got {type(pat_str).__name__}", key="pat_str", path=cfg)
        if pat_str != KIMI_PAT_STR:
            logger.info("%s: split pattern pat_str from %s instead of Kimi's", path, cfg)
        self.enc = tiktoken.Encoding(name=path.name, pat_str=pat_str, mergeable_ranks=ranks,
                                     special_tokens=self.special_tokens)
        self.source, self.num_base_tokens = os.fspath(path), base
        self.vocab_size = max(base + KIMI_NUM_RESERVED, model_vocab, max(named, default=-1) + 1)
        self._pieces = [b""] * self.vocab_size       # id -> bytes (special ids: their name)
        self._hidden = bytearray(self.vocab_size)    # 1: skipped by decode(skip_special_tokens=True)
        for token, rank in ranks.items():
            self._pieces[rank] = token
        for i in range(base, base + KIMI_NUM_RESERVED):
            text, special = named.get(i, (f"<|reserved_token_{i}|>", True))
            self._pieces[i], self._hidden[i] = text.encode("utf-8"), special
        for i, (text, special) in named.items():
            if i >= base + KIMI_NUM_RESERVED:
                self._pieces[i], self._hidden[i] = text.encode("utf-8"), special
        self._by_name = {**{t: i for i, (t, _) in named.items() if i >= base}, **self.special_tokens}
        if model_vocab and model_vocab < base:
            logger.warning("%s has %d base ranks but the model's vocabulary has only %d ids", path, base, model_vocab)
        self.chat_template = config.get("chat_template") if isinstance(config.get("chat_template"), str) else None
        self.bos_token, self.bos_id = self._named_special(config, "bos_token", "[BOS]", cfg)
        self.eos_token, eos_id = self._named_special(config, "eos_token", "[EOS]", cfg)
        self.stop_ids = [eos_id] if eos_id is not None else []

    def _named_special(self, config: dict[str, Any], key: str, default: str, cfg: str | None):
        """(text, id) of ``config[key]`` (the published defaults "[BOS]"/"[EOS]" when absent and named;
        ("", None) when absent and not named); K3ConfigError when the config names an unknown token."""
        if config.get(key) is None:
            return (default, self._by_name[default]) if default in self._by_name else ("", None)
        text = _token_text(config[key])
        if text not in self._by_name:
            raise K3ConfigError(f"'{text}' is not a special token of {Path(self.source).name} (ids "
                                f"{self.num_base_tokens}..{self.num_base_tokens + KIMI_NUM_RESERVED - 1}: "
                                f"added_tokens_decoder or <|reserved_token_ID|>)", key=key, path=cfg)
        return text, self._by_name[text]

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        ids: list[int] = []
        for i in range(0, len(text), KIMI_MAX_ENCODE_CHARS):
            for piece in cut_long_runs(text[i:i + KIMI_MAX_ENCODE_CHARS], KIMI_MAX_RUN_CHARS):
                ids += (self.enc.encode(piece, allowed_special="all") if allow_special
                        else self.enc.encode(piece, disallowed_special=()))
        return ids

    @property
    def control_tokens(self) -> tuple[str, ...]:
        return tuple(self.special_tokens)

    def special_id(self, text: str) -> int | None:
        return self.special_tokens.get(text)

    def encode_text(self, text: str) -> list[int]:
        return self.encode(text, allow_special=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        pieces, hidden = self._pieces, self._hidden
        ids = self.checked_ids(ids)
        data = b"".join(pieces[i] for i in ids if not hidden[i]) if skip_special_tokens else \
            b"".join(pieces[i] for i in ids)
        return data.decode("utf-8", errors="replace")


def _token_text(v: Any) -> str:
    return v.get("content", "") if isinstance(v, dict) else (v or "")


def _added_tokens(config: dict[str, Any], cfg: str | None) -> dict[int, tuple[str, bool]]:
    """``tokenizer_config.json: added_tokens_decoder`` as ``{id: (text, special)}`` (``special``
    defaults to true); K3ConfigError for an id that is not a non-negative integer or an entry
    without text."""
    raw = config.get("added_tokens_decoder") or {}
    if not isinstance(raw, dict):
        raise K3ConfigError(f"must map ids to tokens, got {type(raw).__name__}", key="added_tokens_decoder", path=cfg)
    out = {}
    for k, v in raw.items():
        text = _token_text(v)
        if not (str(k).isascii() and str(k).isdigit()) or not isinstance(text, str) or not text:
            raise K3ConfigError(f"entry {k!r}: expected a non-negative integer id and a token with 'content'",
                                key="added_tokens_decoder", path=cfg)
        out[int(k)] = (text, bool(v.get("special", True)) if isinstance(v, dict) else True)
    return out


def _specials(tok: Tokenizer, config: dict[str, Any], to_id) -> None:
    tok.chat_template = config.get("chat_template") if isinstance(config.get("chat_template"), str) else None
    tok.bos_token, tok.eos_token = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    tok.bos_id = to_id(tok.bos_token) if tok.bos_token else None
    stops = [to_id(tok.eos_token)] if tok.eos_token else []
    tok.stop_ids = [i for i in stops if i is not None]


class IncrementalDecoder:
    """Text deltas for streaming: feed token ids one by one, get the new text each time (held
    back while the text ends in an incomplete UTF-8 sequence)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok, self.ids, self.sent = tokenizer, [], 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta

    def flush(self) -> str:
        text = self.tok.decode(self.ids)
        delta, self.sent = text[self.sent:], len(text)
        return delta


def _model_dir(model: str) -> Path | None:
    p = Path(model)
    if p.is_file():
        p = p.parent
    return p if p.is_dir() else None


def _read_json(path: Path) -> dict[str, Any]:
    """``path`` as a JSON object ({} when there is no such file); K3ConfigError when it cannot be read."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise K3ConfigError(f"cannot read the tokenizer config ({e})", path=os.fspath(path)) from None
    if not isinstance(data, dict):
        raise K3ConfigError(f"expected a JSON object, got {type(data).__name__}", path=os.fspath(path))
    return data


def is_kimi_tokenizer(d: Path, config: dict[str, Any]) -> bool:
    """Whether checkpoint directory ``d`` declares Kimi's tiktoken tokenizer: ``tokenizer_class``
    TikTokenTokenizer, an ``auto_map`` naming ``tokenization_kimi``, or a ``tokenization_kimi.py`` file
    (read by name only: the checkpoint's Python code is never run)."""
    return (config.get("tokenizer_class") == "TikTokenTokenizer"
            or "tokenization_kimi" in json.dumps(config.get("auto_map") or {})
            or (d / "tokenization_kimi.py").is_file())


def _generation_stop_ids(d: Path, vocab_size: int) -> list[int]:
    """``generation_config.json: eos_token_id`` (an id or a list of ids; [] without the file or key)."""
    path = d / "generation_config.json"
    eos = _read_json(path).get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise K3ConfigError(f"expected token ids in 0..{vocab_size - 1}, got {eos!r}", key="eos_token_id",
                                path=os.fspath(path))
    return ids


def load_tokenizer(model: str, module) -> Tokenizer:
    """The tokenizer for ``model`` (a checkpoint directory, a config.json path or a bundled name),
    from the files next to the config: Kimi's tiktoken tokenizer when ``is_kimi_tokenizer`` says so and
    a tiktoken file is there, else ``tokenizer.json`` (HF ``tokenizers``), else a tiktoken file (read as
    Kimi's); else bytes when the model's vocabulary is a byte vocabulary plus specials (<= 512 ids).
    ``generation_config.json: eos_token_id`` adds stop ids. Raises K3ConfigError otherwise."""
    d = _model_dir(model)
    vocab = int(module.attrs.get("vocab_size", 0) or 0)
    if d is not None:
        cfg_path = d / "tokenizer_config.json"
        config = _read_json(cfg_path)
        tiktoken_file = next((d / n for n in TIKTOKEN_FILES if (d / n).is_file()), None)
        tok: Tokenizer | None = None
        if tiktoken_file is not None and (is_kimi_tokenizer(d, config) or not (d / "tokenizer.json").is_file()):
            cls = config.get("tokenizer_class")
            if cls not in (None, "TikTokenTokenizer"):
                logger.warning("%s: tokenizer_class %r with a tiktoken file; reading it as Kimi's TikTokenTokenizer",
                               cfg_path, cls)
            tok = KimiTokenizer(tiktoken_file, config, vocab, config_path=cfg_path)
        elif (d / "tokenizer.json").is_file():
            tok = HFTokenizer(d / "tokenizer.json", config, vocab)
        if tok is None and 256 <= vocab <= 512:
            tok = ByteTokenizer(module.attrs.get("bos_token_id"), module.attrs.get("eos_token_id"), vocab)
        if tok is not None:
            tok.chat_template = read_chat_template(d, config, cfg_path)
            tok.stop_ids = list(dict.fromkeys([*tok.stop_ids, *_generation_stop_ids(d, tok.vocab_size)]))
            logger.info("tokenizer %s from %s: %d ids, bos %s, stop ids %s", tok.name, tok.source, tok.vocab_size,
                        tok.bos_id, tok.stop_ids)
            return tok
    if 256 <= vocab <= 512:
        return ByteTokenizer(module.attrs.get("bos_token_id"), module.attrs.get("eos_token_id"), vocab)
    why = f"vocabulary of {vocab} ids is not a byte vocabulary"
    if d is None:            # a bundled name: a config only, nowhere to put a tokenizer
        raise K3ConfigError(f"no tokenizer for '{model}': it is a bundled config without a tokenizer ({why}); "
                            f"pass a checkpoint directory holding config.json and tokenizer.json (or "
                            f"tiktoken.model) instead of the name")
    raise K3ConfigError(f"no tokenizer for '{model}': put tokenizer.json or tiktoken.model in {os.fspath(d)} "
                        f"({why})")
