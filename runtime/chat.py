"""Chat prompts: a checkpoint's chat template rendered as ``transformers``' ``apply_chat_template``
renders it (a sandboxed jinja2 with the same options, filters and globals; ``messages``, ``tools``,
``add_generation_prompt`` and the tokenizer's ``bos_token``/``eos_token``), the simple template of
models without one, where the template is read from, and the prompt's token ids with no control
token coming from what a client wrote.

Control tokens (the tokenizer's special tokens, e.g. Kimi's ``<|im_end|>`` or ``<|tool_call_begin|>``)
in message text, tool-call arguments or tool schemas are wrapped in two private-use characters
before rendering; the rendered text is encoded piecewise: the template's own text with its control
tokens, the wrapped pieces as plain text (``Tokenizer.encode_text``). A template string method that
separates the two marks drops them but still cuts the text there, so nothing on either side can join
into a control token (the scheme ``transformers`` 5 uses, ``mark_control_tokens``)."""
from __future__ import annotations

import functools
import json
import os
import re
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3ir.errors import K3ConfigError

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

#: the checkpoint file holding the chat template (``save_pretrained`` writes it since transformers 4.5x);
#: ``tokenizer_config.json: chat_template`` is read when it is absent
CHAT_TEMPLATE_FILE = "chat_template.jinja"

#: the template of tokenizers without one (the bundled byte-level models): ``role: content`` lines, a
#: ``tools: [...]`` line first when tools are given, an assistant's tool calls in Kimi's markup as
#: text, a tool result as ``tool: ## Return of ID`` and its content; ends in ``assistant: `` when a
#: generation prompt is asked for
SIMPLE_TEMPLATE = (
    "{%- if tools %}{{ 'tools: ' + tools | tojson + '\n' }}{% endif %}"
    "{%- for message in messages %}"
    "{{- message.role + ': ' }}"
    "{%- if message.role == 'tool' and message.tool_call_id is defined %}"
    "{{- '## Return of ' + message.tool_call_id + '\n' }}{% endif %}"
    "{%- if message.content is string %}{{ message.content }}{% endif %}"
    "{%- if message.tool_calls is defined and message.tool_calls %}{{- '<|tool_calls_section_begin|>' }}"
    "{%- for call in message.tool_calls %}"
    "{{- '<|tool_call_begin|>' + call.id + '<|tool_call_argument_begin|>' + call.function.arguments"
    " + '<|tool_call_end|>' }}"
    "{%- endfor %}{{- '<|tool_calls_section_end|>' }}{% endif %}"
    "{{- '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)

_MARK_START, _MARK_END = "\U000f0000", "\U000f0001"


@functools.lru_cache(maxsize=8)
def compile_template(template: str):
    """``template`` compiled in an ``ImmutableSandboxedEnvironment`` set up as ``transformers`` sets
    its own: ``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension, ``tojson`` without
    HTML escaping (``ensure_ascii``, ``indent``, ``separators``, ``sort_keys`` options),
    ``raise_exception(msg)`` (raises ``jinja2.TemplateError``), ``strftime_now(fmt)``, ``dict`` and a
    ``namespace`` that refuses underscore-prefixed names. Raises ``jinja2.TemplateError`` for a template
    that does not parse."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot store the attribute {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """``value`` rebuilt from JSON types, ``None`` values of message dicts dropped (as transformers drops
    them: templates handle a missing key, many print a ``None``)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def render_chat(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """The text of ``template`` for ``messages`` (OpenAI-style dicts: ``role``, ``content``, and
    ``tool_calls`` / ``tool_call_id`` / ``name`` where given) and ``tools`` (OpenAI tool schemas, or
    None), as ``transformers``' ``apply_chat_template(..., tokenize=False)`` renders it; ``kwargs`` are
    more template variables (``bos_token``, ``eos_token``). Raises ``jinja2.TemplateError`` when the
    template fails (its ``raise_exception`` included)."""
    return compile_template(template).render(messages=_plain(messages), tools=_plain(tools), documents=None,
                                             add_generation_prompt=add_generation_prompt, **_plain(kwargs))


@functools.lru_cache(maxsize=8)
def _control_patterns(controls: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    longest = "|".join(map(re.escape, sorted(controls, key=len, reverse=True))) or "(?!)"
    return re.compile(longest), re.compile(f"{_MARK_START}({longest}){_MARK_END}|[{_MARK_START}{_MARK_END}]")


def _mark(value: Any, controls: re.Pattern) -> Any:
    """Control tokens in the strings of ``value`` wrapped in the private-use marks (marks already there
    dropped first, so none can be forged); dict keys are left alone."""
    if isinstance(value, str):
        value = value.replace(_MARK_START, "").replace(_MARK_END, "")
        return controls.sub(lambda m: _MARK_START + m.group(0) + _MARK_END, value)
    if isinstance(value, dict):
        return {k: _mark(v, controls) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark(v, controls) for v in value]
    return value


def chat_ids(tok: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
             assistant_prefix: str = "") -> list[int]:
    """Token ids of the prompt for ``messages`` and ``tools``: ``tok.chat_template`` (or
    ``SIMPLE_TEMPLATE``) with the generation prompt, then ``assistant_prefix`` (the server's own text,
    e.g. the start of a forced tool call), encoded so that a control token written by the client
    (in any string of ``messages`` or ``tools``) is encoded as plain text, never as its control id.
    Raises ``jinja2.TemplateError`` when the template fails."""
    template = tok.chat_template or SIMPLE_TEMPLATE
    controls = tuple(tok.control_tokens)
    extra = {"bos_token": tok.bos_token, "eos_token": tok.eos_token}
    if not controls:
        return tok.encode(render_chat(template, messages, tools, **extra) + assistant_prefix)
    find, split = _control_patterns(controls)
    text = render_chat(template, _mark(messages, find), _mark(tools, find), **extra) + assistant_prefix
    pieces = split.split(text)            # [text, marked token or None, text, marked token or None, ..., text]
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if piece:
            ids += tok.encode_text(piece) if i % 2 else tok.encode(piece)
    return ids


def read_chat_template(directory: Path, config: dict[str, Any], config_path: Path | None = None) -> str | None:
    """The chat template of the checkpoint in ``directory``: ``chat_template.jinja`` when that file is
    there, else ``tokenizer_config.json: chat_template`` (a string, or a list of named templates, of
    which the one named ``default`` is taken), else None. Raises K3ConfigError naming the file or key
    when the file cannot be read or the key holds something else."""
    path = directory / CHAT_TEMPLATE_FILE
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise K3ConfigError(f"cannot read the chat template ({e})", path=os.fspath(path)) from None
    raw = config.get("chat_template")
    cfg = os.fspath(config_path) if config_path is not None else None
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise K3ConfigError("a list of templates must hold one named 'default' ({'name': ..., 'template': ...})",
                            key="chat_template", path=cfg)
    raise K3ConfigError(f"expected a template string, got {type(raw).__name__}", key="chat_template", path=cfg)
