"""Request models of the HTTP server and their validation: ``ServerLimits``, the pydantic schemas of
``/v1/completions`` and ``/v1/chat/completions`` (strict types), unknown and unsupported fields,
text that is not valid Unicode, and the sampling parameters and stop strings a request asks for.
Every problem is an ``APIError`` (400, 404 for an unknown model) naming the field."""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from k3ir.errors import K3Error, K3RuntimeError

from .sampler import SamplingParams
from .serve_errors import APIError


@dataclass
class ServerLimits:
    """Per-request and global limits: body bytes (413 over it, chunked bodies too), prompt tokens,
    output tokens (``max_tokens``), requests in flight (queued + running; more get 429), ``stop``
    strings per request and their total characters (400 naming ``stop`` over either), and
    ``body_timeout_s``: seconds from a request's headers until its whole body must have arrived
    (408 and the connection closed otherwise). Each must be an integer >= 1, the timeout a finite
    number > 0 (K3RuntimeError otherwise)."""
    max_request_bytes: int = 1 << 20
    max_prompt_tokens: int = 4096
    max_output_tokens: int = 1024
    max_concurrent: int = 64
    max_stop_strings: int = 16
    max_stop_chars: int = 4096
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for key in ("max_request_bytes", "max_prompt_tokens", "max_output_tokens", "max_concurrent",
                    "max_stop_strings", "max_stop_chars"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise K3RuntimeError(f"server limit {key} must be an integer >= 1, got {v!r}")
        t = self.body_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise K3RuntimeError(f"server limit body_timeout_s must be a finite number of seconds > 0, got {t!r}")


#: OpenAI request fields this server does not implement, with the values it accepts for them (their
#: defaults: clients often send those explicitly). Any other value is a 400 naming the field.
UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, 0, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "stream_options": (None,), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
}
#: OpenAI fields accepted and ignored without a schema (``user``, which only identifies the end user to
#: the API provider, is a declared field so that its type is checked)
IGNORED: frozenset[str] = frozenset()


class CommonRequest(BaseModel):
    """Fields both endpoints read."""
    # strict: a wrong JSON type is a 400 naming the field ("2" or true for max_tokens, "yes" for stream),
    # never silently coerced; JSON integers are still accepted for float fields. Extra fields are checked
    # by check_fields (400 naming them).
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    user: str | None = None          # accepted and ignored


def check_text(text: str, param: str) -> None:
    """APIError 400 naming ``param`` when ``text`` cannot be encoded as UTF-8 (a lone surrogate such
    as ``"\\ud800"``, which JSON can spell but no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} holds a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}, "
                            "which is not valid Unicode text (send a UTF-8 string)", "invalid_request", param) from None


class CompletionRequest(CommonRequest):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)     # an unknown key in a message is a 400
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)    # OpenAI's newer name for max_tokens


def check_fields(body: CommonRequest) -> None:
    """APIError 400 for a field the request schema does not read: an unsupported OpenAI field
    (UNSUPPORTED) at a value other than its default, or a field the server does not know at all."""
    for key, value in (body.model_extra or {}).items():
        if key in IGNORED:
            continue
        if key in UNSUPPORTED:
            if value in UNSUPPORTED[key]:         # 0.0 == 0 == False: a default in any JSON spelling
                continue
            ok = " or ".join(json.dumps(v) for v in UNSUPPORTED[key])
            raise APIError(400, f"'{key}' is not supported by this server (accepted only as {ok}), got "
                                f"{json.dumps(value)}", "unsupported_parameter", key)
        fields = ", ".join(sorted(type(body).model_fields) + sorted(IGNORED))
        raise APIError(400, f"unrecognized request field '{key}' (this endpoint reads: {fields})",
                       "unknown_parameter", key)


def check_chat(body: ChatRequest) -> None:
    """``check_fields``, then ``max_completion_tokens`` folded into ``max_tokens`` (APIError 400 when
    both are given and differ) and every message's text checked (``check_text``)."""
    check_fields(body)
    if body.max_completion_tokens is not None:
        if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
            raise APIError(400, f"max_tokens {body.max_tokens} and max_completion_tokens "
                                f"{body.max_completion_tokens} disagree (give one)", "invalid_request", "max_tokens")
        body.max_tokens = body.max_completion_tokens
    for i, m in enumerate(body.messages):
        check_text(m.content, f"messages.{i}.content")


def sampling_params(body: CommonRequest, n_prompt: int, model_name: str, limits: ServerLimits,
                    stop_token_ids: list[int]) -> SamplingParams:
    """The ``SamplingParams`` of ``body`` (``max_tokens`` defaults to 16 or the limit if lower; a random
    seed when none is given). APIError 404 for another model than ``model_name``, 400 for a prompt of
    more than ``limits.max_prompt_tokens`` tokens, ``max_tokens`` over ``limits.max_output_tokens`` or
    values the sampler refuses."""
    if body.model is not None and body.model != model_name:
        raise APIError(404, f"model '{body.model}' does not exist (serving '{model_name}')", "model_not_found", "model")
    if n_prompt > limits.max_prompt_tokens:
        raise APIError(400, f"prompt has {n_prompt} tokens, the limit is {limits.max_prompt_tokens}",
                       "context_length_exceeded", "prompt")
    mt = body.max_tokens if body.max_tokens is not None else min(16, limits.max_output_tokens)
    if mt > limits.max_output_tokens:
        raise APIError(400, f"max_tokens {mt} exceeds the limit {limits.max_output_tokens}",
                       "max_tokens_exceeded", "max_tokens")
    seed = body.seed if body.seed is not None else secrets.randbits(62)
    try:
        return SamplingParams(max_tokens=mt, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                              seed=seed, stop_token_ids=list(stop_token_ids))
    except K3Error as e:
        raise APIError(400, str(e), "invalid_request") from None


def stop_strings(body: CommonRequest, limits: ServerLimits) -> list[str]:
    """The request's stop strings; APIError 400 naming ``stop`` over the limits or for text that is
    not valid Unicode."""
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > limits.max_stop_strings:
        raise APIError(400, f"stop has {len(stops)} strings, the limit is {limits.max_stop_strings}",
                       "invalid_request", "stop")
    total = sum(len(x) for x in stops)
    if total > limits.max_stop_chars:
        raise APIError(400, f"stop strings hold {total} characters in all, the limit is {limits.max_stop_chars}",
                       "invalid_request", "stop")
    for i, x in enumerate(stops):
        check_text(x, "stop" if isinstance(body.stop, str) else f"stop.{i}")
    return stops
