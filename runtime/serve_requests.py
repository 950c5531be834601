"""Request models of the HTTP server and their validation: ``ServerLimits``, the pydantic schemas of
``/v1/completions`` and ``/v1/chat/completions`` (strict types), unknown and unsupported fields,
text that is not valid Unicode, and the sampling parameters and stop strings a request asks for.
Every problem is an ``APIError`` (400, 404 for an unknown model) naming the field."""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal

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
    (408 and the connection closed otherwise); ``drain_timeout_s``: seconds that requests in flight
    get to finish after the server is told to stop (SIGTERM); those still running then are cancelled.
    Each count must be an integer >= 1, each time a finite number > 0 (K3RuntimeError otherwise).
    ``max_prompt_tokens`` None: ``create_app`` takes the engine's ``prompt_limit()`` (the model's
    ``max_position_embeddings`` bounded by the pool's capacity)."""
    max_request_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_output_tokens: int = 1024
    max_concurrent: int = 64
    max_stop_strings: int = 16
    max_stop_chars: int = 4096
    body_timeout_s: float = 30.0
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for key in ("max_request_bytes", "max_prompt_tokens", "max_output_tokens", "max_concurrent",
                    "max_stop_strings", "max_stop_chars"):
            v = getattr(self, key)
            if v is None and key == "max_prompt_tokens":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise K3RuntimeError(f"server limit {key} must be an integer >= 1, got {v!r}")
        for key in ("body_timeout_s", "drain_timeout_s"):
            t = getattr(self, key)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
                raise K3RuntimeError(f"server limit {key} must be a finite number of seconds > 0, got {t!r}")


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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)     # an unknown key is a 400 naming it


#: OpenAI's rule for function names (letters, digits, ``_`` and ``-``, at most 64)
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionCall(_Strict):
    name: str
    arguments: str                      # JSON text, as the model wrote it


class ToolCall(_Strict):
    """One call of an assistant message (``functions.NAME:IDX`` ids are the ones this server gives)."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None          # a JSON schema, passed to the template as given
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class TextPart(_Strict):
    """One part of a message's ``content`` in OpenAI's list form: ``{"type": "text", "text": ...}`` (the only part
    type a text model takes; an image or audio part is a 400 naming it)."""
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """A message: ``content`` (a string, or a list of text parts joined in order; an assistant message with
    ``tool_calls`` may leave it out or null), ``name``, an assistant's ``tool_calls``, a tool result's ``tool_call_id``. The OpenAI client's
    own null fields of an assistant message it returned (``refusal``, ``annotations``, ``audio``,
    ``function_call``) are accepted as null."""
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None


class ChatRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)    # OpenAI's newer name for max_tokens
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None          # accepted; every call the model writes is returned


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
    both are given and differ), every message's fields and text checked (``check_strings``; a message
    without content, ``tool_calls`` off an assistant message, (content given as text parts is joined first), ``tool_call_id`` missing from a tool
    message or on another one: 400 naming the field), tools and ``tool_choice`` checked (a function
    declared twice, a call asked for without tools or naming a function not among them: 400)."""
    check_fields(body)
    if body.max_completion_tokens is not None:
        if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
            raise APIError(400, f"max_tokens {body.max_tokens} and max_completion_tokens "
                                f"{body.max_completion_tokens} disagree (give one)", "invalid_request", "max_tokens")
        body.max_tokens = body.max_completion_tokens
    for i, m in enumerate(body.messages):
        where = f"messages.{i}"
        if isinstance(m.content, list):          # OpenAI's list of parts: the text parts, joined
            m.content = "".join(part.text for part in m.content)
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(400, f"{where}: a {m.role} message needs 'content' (a string)", "invalid_request",
                           f"{where}.content")
        if m.tool_calls is not None and m.role != "assistant":
            raise APIError(400, f"{where}: only assistant messages carry 'tool_calls'", "invalid_request",
                           f"{where}.tool_calls")
        if (m.tool_call_id is not None) != (m.role == "tool"):
            raise APIError(400, f"{where}: " + ("a tool message needs 'tool_call_id' (the id of the call it answers)"
                                                if m.role == "tool" else "only tool messages carry 'tool_call_id'"),
                           "invalid_request", f"{where}.tool_call_id")
        check_strings(m.model_dump(exclude_none=True), where)
    check_strings([t.model_dump(exclude_none=True) for t in body.tools or []], "tools")
    names = [t.function.name for t in body.tools or []]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"tools: the function '{dup}' is declared twice", "invalid_request", "tools")
    choice = body.tool_choice
    if choice not in (None, "none", "auto"):
        if not names:
            raise APIError(400, "tool_choice asks for a tool call but no tools are given", "invalid_request",
                           "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(400, f"tool_choice names the function '{choice.function.name}', which is not among the "
                                f"tools ({', '.join(names)})", "invalid_request", "tool_choice")


def check_strings(value: Any, where: str) -> None:
    """``check_text`` on every string in ``value`` (nested dicts and lists), naming its path from ``where``."""
    if isinstance(value, str):
        check_text(value, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_strings(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_strings(v, f"{where}.{i}")


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
