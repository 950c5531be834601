"""``k3ir generate MODEL --prompt TEXT``: one prompt through the serving engine, the text on stdout.

A model without trained weights (a bundled name, a config without safetensors) runs its random init:
one warning line on stderr says so and how to pass real weights (a ``k3ir train`` run, ``RUN`` or
``RUN/checkpoints/step-N``, or a downloaded checkpoint). Control characters in the printed prompt and
text (a byte-level model emits any byte, ESC included) are written escaped, ``\\x1b``, so they cannot drive
the terminal; ``--raw`` writes the exact text.
"""
from __future__ import annotations

import sys

from k3ir.errors import K3RuntimeError

from .common import UsageError, check_prompt, model_arg, quiet_stdout, random_weights_note
from .parallel import generate_on_mesh, parallel_args, parallel_sizes
from .serve import _engine_args, _sampling_args, _setup

#: characters written as they are: newline and tab (every other C0 control, DEL and C1 is escaped)
KEPT_CONTROLS = frozenset("\n\t")
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if chr(c) not in KEPT_CONTROLS}


def escape_controls(text: str) -> str:
    """``text`` with every C0 control character but newline and tab, DEL (0x7f) and every C1 control
    (0x80-0x9f) written as ``\\xNN`` (lower-case hex), so printing it cannot move the cursor, clear the
    screen or retitle the terminal. Other characters, backslashes included, are kept."""
    return text.translate(_ESCAPES)


def cmd_generate(args) -> int:
    from k3ir.runtime.sampler import SamplingParams
    from k3ir.runtime.tokenizer import IncrementalDecoder
    if args.prompt is None:
        raise UsageError("generate needs --prompt TEXT")
    check_prompt(args.prompt)                        # before the model loads
    shown = (lambda s: s) if args.raw else escape_controls
    sizes = parallel_sizes(args, "generate")
    if sizes is not None:                            # one rank of a torchrun process group
        return generate_on_mesh(args, sizes, shown)
    module, tok, engine = _setup(args)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed, stop_token_ids=list(tok.stop_ids))
    note = random_weights_note(module, args.model, args.init_seed)     # once, after the flags are checked
    if note:
        print(note, file=sys.stderr, flush=True)
    ids = tok.encode(args.prompt)
    dec = IncrementalDecoder(tok)

    broken = []                                      # set when the reader of stdout went away (EPIPE)

    def on_event(req, token):
        if token is None or broken:
            return
        try:
            sys.stdout.write(shown(dec.push(token)))
            sys.stdout.flush()
        except BrokenPipeError:                      # `k3ir generate ... | head`: stop quietly, as print/inspect do
            broken.append(True)
            req.cancelled = True                     # the engine aborts it before the next step
            quiet_stdout()
    req = engine.add_request(ids, sp, on_event=on_event)
    sys.stdout.write(shown(args.prompt))
    try:
        engine.run([req])
    except KeyboardInterrupt:                        # "k3ir: interrupted" goes to stderr on a line of its own
        try:
            sys.stdout.write("\n")
            sys.stdout.flush()
        except OSError:
            pass
        raise
    if broken:
        return 0
    sys.stdout.write(shown(dec.flush()) + "\n")
    if args.show_ids:
        sys.stdout.write(f"token ids: {req.output}\nfinish: {req.finish_reason}\n")
    if req.finish_reason == "error":
        sys.stdout.flush()
        raise K3RuntimeError(f"generation failed: {req.error}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (continuous-batching engine)",
                       description="Generate text from --prompt with MODEL (default k3-tiny). Bundled models have "
                                   "random weights (their text is noise; a warning says so): pass a checkpoint "
                                   "directory, e.g. a k3ir train run RUN or RUN/checkpoints/step-N, for real text.")
    model_arg(p, default="k3-tiny")
    p.add_argument("--prompt", help="prompt text (through the model's tokenizer; bytes for tiny models)")
    _sampling_args(p)
    _engine_args(p)
    parallel_args(p)
    p.add_argument("--show-ids", action="store_true", help="also print the generated token ids")
    p.add_argument("--raw", action="store_true",
                   help="write the exact text, control characters included (default: C0/C1 controls but newline "
                        "and tab are written escaped, e.g. \\x1b)")
    p.set_defaults(func=cmd_generate)
