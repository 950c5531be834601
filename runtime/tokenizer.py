"""Text <-> token ids for serving: the checkpoint's tokenizer (``tokenizer.json`` through the
``tokenizers`` package, or a tiktoken BPE file through ``tiktoken``) with its chat template
(``tokenizer_config.json: chat_template``, rendered by a sandboxed jinja2), or bytes for the bundled
tiny models (ids 0..255 are the bytes; ids >= 256 are the config's special tokens)."""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from k3ir.errors import K3ConfigError

TIKTOKEN_FILES = ("tiktoken.model", "tokenizer.model")
#: default pre-tokeniser split for tiktoken files (a cl100k-style pattern); a checkpoint can
#: override it with ``pat_str`` in tokenizer_config.json
DEFAULT_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


class Tokenizer:
    """Common interface. ``encode(text) -> ids``, ``decode(ids) -> text`` (special tokens
    skipped), ``chat(messages) -> ids`` (template + generation prompt), ``stop_ids``."""
    name = "base"
    bos_id: int | None = None
    stop_ids: Sequence[int] = ()
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text of ``messages`` (``[{"role", "content"}]``) ending in the assistant turn."""
        if self.chat_template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token)
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.render_chat(messages))


class ByteTokenizer(Tokenizer):
    """Bytes as ids 0..255 (UTF-8); ``bos_id`` is prepended by ``encode``; ids >= 256 decode to
    nothing. The bundled tiny models use it."""
    name = "bytes"

    def __init__(self, bos_id: int | None = None, eos_id: int | None = None, vocab_size: int = 256):
        self.bos_id, self.vocab_size = bos_id, vocab_size
        self.stop_ids = [eos_id] if eos_id is not None else []

    def encode(self, text: str) -> list[int]:
        return ([self.bos_id] if self.bos_id is not None else []) + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(t) for t in ids if 0 <= int(t) < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` (HF ``tokenizers``) with ``tokenizer_config.json`` for specials/template."""
    name = "tokenizers"

    def __init__(self, path: Path, config: dict[str, Any]):
        from tokenizers import Tokenizer as _T
        self.tok = _T.from_file(str(path))
        _specials(self, config, self.tok.token_to_id)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(t) for t in ids], skip_special_tokens=True)


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE file (``base64 token rank`` lines); special tokens from
    ``tokenizer_config.json: added_tokens_decoder`` (ids after the base ranks)."""
    name = "tiktoken"

    def __init__(self, path: Path, config: dict[str, Any]):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe
        ranks = load_tiktoken_bpe(str(path))
        specials = {v["content"]: int(k) for k, v in config.get("added_tokens_decoder", {}).items()
                    if isinstance(v, dict) and "content" in v and int(k) >= len(ranks)}
        self.enc = tiktoken.Encoding(name=path.stem, pat_str=config.get("pat_str", DEFAULT_PAT),
                                     mergeable_ranks=ranks, special_tokens=specials)
        self.special_ids = set(specials.values())
        _specials(self, config, lambda s: specials.get(s))

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode([int(t) for t in ids if int(t) not in self.special_ids], errors="replace")


def _token_text(v: Any) -> str:
    return v.get("content", "") if isinstance(v, dict) else (v or "")


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


def load_tokenizer(model: str, module) -> Tokenizer:
    """The tokenizer for ``model`` (a checkpoint directory, a config.json path or a bundled name):
    ``tokenizer.json`` or a tiktoken file next to the config; else bytes when the vocabulary is a
    byte vocabulary plus specials (<= 512 ids). Raises K3ConfigError otherwise."""
    d = _model_dir(model)
    if d is not None:
        cfg_path = d / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text())
            except (OSError, ValueError) as e:
                raise K3ConfigError(f"{cfg_path}: cannot read tokenizer config ({e})") from None
        if (d / "tokenizer.json").is_file():
            return HFTokenizer(d / "tokenizer.json", config)
        for name in TIKTOKEN_FILES:
            if (d / name).is_file():
                return TiktokenTokenizer(d / name, config)
    vocab = int(module.attrs.get("vocab_size", 0))
    if 256 <= vocab <= 512:
        return ByteTokenizer(module.attrs.get("bos_token_id"), module.attrs.get("eos_token_id"), vocab)
    why = f"vocabulary of {vocab} ids is not a byte vocabulary"
    if d is None:            # a bundled name: a config only, nowhere to put a tokenizer
        raise K3ConfigError(f"no tokenizer for '{model}': it is a bundled config without a tokenizer ({why}); "
                            f"pass a checkpoint directory holding config.json and tokenizer.json (or "
                            f"tiktoken.model) instead of the name")
    raise K3ConfigError(f"no tokenizer for '{model}': put tokenizer.json or tiktoken.model in {os.fspath(d)} "
                        f"({why})")
