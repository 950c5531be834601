"""``k3ir export``: write a model as ONNX, MLIR or a picture. A flag that does not apply to the
format (``--weights``/``--mxfp4-form`` outside onnx, ``--quantize``/``--moe-form`` outside onnx and mlir,
``--iree-target``/``--kda-form`` outside mlir, ``--level`` outside dot/svg), or a form the format does not
have (``--moe-form loop`` for mlir), is a usage error naming the flag and the format (exit 2), never
silently ignored.

    k3ir export kimi-k3 --format onnx --weights inputs -o k3.onnx      # structure only
    k3ir export k3-tiny --format onnx --opset 20 -o tiny20.onnx          # Scan lowering, older runtimes
    k3ir export k3-tiny --format onnx -o tiny.onnx                      # weights in tiny.onnx.data
    k3ir export k3-tiny --format onnx --logits-to-keep 0 -o tiny.onnx   # logits of every position by default
    k3ir export k3-tiny --format mlir -o tiny.mlir --iree-target vulkan-spirv   # + tiny.vulkan-spirv.vmfb
    k3ir export k3-tiny --format mlir --quantize mxfp4 -o tiny.mlir     # packed experts, dequantised per expert
    k3ir export k3-tiny --format onnx --moe-form loop -o tiny.onnx      # a Loop over the experts in use
    k3ir export kimi-k3 --format html -o k3.html                        # collapsible layer view
    k3ir export k3-tiny --format svg --level op -o tiny.svg
"""
from __future__ import annotations

import contextlib
import os
import time

from k3ir.backends.mlir.config import KDA_FORMS
from k3ir.backends.mlir.config import MOE_FORMS as MLIR_MOE_FORMS
from k3ir.backends.onnx.export import MXFP4_FORMS
from k3ir.backends.onnx.moe import MOE_FORMS as ONNX_MOE_FORMS

from k3ir.progress import progress

from .common import UsageError, console, load_model, model_arg

FORMATS = ("onnx", "mlir", "dot", "svg", "html")
#: ``--moe-form`` values per format (the exporters' own lists)
MOE_FORMS = {"onnx": ONNX_MOE_FORMS, "mlir": MLIR_MOE_FORMS}


def _check_forms(args, fmt: str, opset: int | None) -> tuple[str | None, str | None, str | None]:
    """``(moe_form, mxfp4_form, kda_form)`` of the command line, each None when not given; UsageError (one line)
    for a flag outside its formats or a value the format does not have."""
    moe_form = getattr(args, "moe_form", None)
    mxfp4_form = getattr(args, "mxfp4_form", None)
    kda_form = getattr(args, "kda_form", None)
    if moe_form is not None:
        if fmt not in MOE_FORMS:
            raise UsageError(f"--moe-form applies to --format onnx and mlir only, not --format {fmt}")
        if moe_form not in MOE_FORMS[fmt]:
            raise UsageError(f"--moe-form {moe_form} does not apply to --format {fmt} "
                             f"(want {' or '.join(MOE_FORMS[fmt])})")
    if mxfp4_form is not None:
        if fmt != "onnx":
            raise UsageError(f"--mxfp4-form applies to --format onnx only, not --format {fmt}")
        if mxfp4_form == "dequantize_linear" and opset == 20:
            raise UsageError("--mxfp4-form dequantize_linear needs opset 27 (FLOAT4E2M1, FLOAT8E8M0), not --opset 20")
    if kda_form is not None and fmt != "mlir":
        raise UsageError(f"--kda-form applies to --format mlir only, not --format {fmt}")
    return moe_form, mxfp4_form, kda_form


def _params(m):
    """Bound checkpoint weights, else None: the exporter then draws the deterministic random init
    (``runtime.params.init_param``, seed 0) one used parameter at a time."""
    from k3ir.runtime.params import bound_params
    return bound_params(m)


def _check_writable(paths: list[str]) -> None:
    """UsageError when an output path is a directory or its folder is missing / not writable."""
    for p in paths:
        if os.path.isdir(p):
            raise UsageError(f"{p}: is a directory (want an output file path)")
        d = os.path.dirname(os.path.abspath(p))
        if not os.path.isdir(d):
            raise UsageError(f"output directory '{d}' does not exist")
        if not os.access(d, os.W_OK):
            raise UsageError(f"{d}: output directory is not writable")


@contextlib.contextmanager
def _writing(paths: list[str]):
    """Remove the ``paths`` this block created when it fails (no partial output is left); an
    OSError becomes a UsageError naming the path."""
    existed = {p for p in paths if os.path.lexists(p)}
    try:
        yield
    except BaseException as e:
        for p in paths:
            if p not in existed and os.path.isfile(p):
                with contextlib.suppress(OSError):
                    os.remove(p)
        if isinstance(e, OSError):
            raise UsageError(f"{e.filename or paths[0]}: cannot write ({e.strerror or e})") from None
        raise


def cmd_export(args) -> int:
    con = console()
    describe = getattr(args, "describe", False)
    if args.output is None and not describe:
        raise UsageError("export needs -o/--output (or --describe to print the ONNX interface)")
    fmt = args.format or ("onnx" if args.output is None else os.path.splitext(args.output)[1].lstrip(".").lower())
    if fmt not in FORMATS:
        raise UsageError(f"unknown export format '{fmt}' (want one of {', '.join(FORMATS)})")
    if args.weights and fmt != "onnx":
        raise UsageError(f"--weights applies to --format onnx only, not --format {fmt}")
    if args.iree_target and fmt != "mlir":
        raise UsageError(f"--iree-target applies to --format mlir only, not --format {fmt}")
    if args.quantize is not None and fmt not in ("onnx", "mlir"):
        raise UsageError(f"--quantize applies to --format onnx and mlir only, not --format {fmt}")
    opset = getattr(args, "opset", None)
    if opset is not None and fmt != "onnx":
        raise UsageError(f"--opset applies to --format onnx only, not --format {fmt}")
    moe_form, mxfp4_form, kda_form = _check_forms(args, fmt, opset)
    ort_kernels = getattr(args, "ort_kernels", False)
    if ort_kernels and (fmt != "onnx" or opset == 20):
        raise UsageError(f"--ort-kernels applies to --format onnx at opset 27 only, not --format {fmt}"
                         + (" --opset 20" if opset == 20 else ""))
    if args.level is not None and fmt not in ("dot", "svg"):
        raise UsageError(f"--level applies to --format dot and svg only, not --format {fmt}")
    if describe and fmt != "onnx":
        raise UsageError(f"--describe applies to --format onnx only, not --format {fmt}")
    keep = getattr(args, "logits_to_keep", None)
    if keep is not None and fmt not in ("onnx", "mlir"):
        raise UsageError(f"--logits-to-keep applies to --format onnx and mlir only, not --format {fmt}")
    if keep is not None and keep < 0:
        raise UsageError(f"--logits-to-keep must be >= 0 (0: every position), not {keep}")
    if keep is not None and fmt == "mlir" and keep > 1:
        raise UsageError(f"--logits-to-keep for --format mlir is 0 (every position) or 1 (the last), not {keep}")
    mlir_keep = {"logits_to_keep": keep} if fmt == "mlir" and keep is not None else {}
    keep = 1 if keep is None else keep
    t0 = time.perf_counter()
    m = load_model(args)
    if fmt == "onnx" and args.function in m.functions:     # one that is missing gets the exporter's own error
        from k3ir.backends import get_backend
        why = get_backend("onnx").function_problem(m, args.function)     # as k3ir check --target onnx says it
        if why:
            raise UsageError(f"--function {args.function}: {why}")
    out = args.output
    if not describe:
        _check_writable([out])
    quant = (args.quantize or m.attrs.get("expert_quant", "none")) if fmt in ("onnx", "mlir") else "none"
    if quant not in ("none", "mxfp4"):
        raise UsageError(f"export keeps mxfp4 experts packed; '{quant}' experts are not supported (use --quantize none)")
    if mxfp4_form is not None and quant != "mxfp4":
        raise UsageError(f"--mxfp4-form applies to MXFP4 experts; {m.name}'s are not quantised (add --quantize mxfp4)")
    if quant == "mxfp4" and fmt == "mlir" and moe_form == "dense":
        raise UsageError("--moe-form dense applies to float experts; MXFP4 experts run over sorted rows in MLIR "
                         "(drop --moe-form or add --quantize none)")
    if quant == "mxfp4":        # packed experts, dequantised inside the graph / per expert in the MLIR
        from k3ir.passes import run_pipeline
        run_pipeline(m, ["fuse-moe-dispatch", "quantize-experts{format=mxfp4}", "dce"])
    if describe:
        from k3ir.backends.onnx.export import describe_io
        rows = describe_io(m, args.function or "prefill", opset=opset, ort_kernels=ort_kernels, moe_form=moe_form,
                           mxfp4_form=mxfp4_form or "unpack", logits_to_keep=keep)
        for kind, name, dt, shape in rows:
            note = f"  optional, default {keep} (0: every position)" if name == "logits_to_keep" else ""
            if kind == "output" and name == "logits" and "T_logits" in shape:
                note = "  T_logits = min(T, logits_to_keep), T when 0"
            grown = next((d for d in shape if isinstance(d, str) and d.startswith("L_plus_")), None)
            if kind == "output" and grown:
                note = f"  {grown} = L + {grown[len('L_plus_'):]}"
            con.print(f"{kind:<6} {name:<32} {dt:<8} [{', '.join(map(str, shape))}]{note}")
        return 0
    if fmt == "onnx":
        from k3ir.backends.onnx.export import export_onnx
        weights = args.weights or "external"
        outs = [out] + ([out + ".data"] if weights == "external" else [])
        _check_writable(outs)
        with _writing(outs), progress(f"onnx: exporting @{args.function or 'prefill'} of {m.name} to {out}"):
            info = export_onnx(m, out, function=args.function or "prefill", weights=weights,
                               params=None if weights == "inputs" else _params(m), opset=opset,
                               ort_kernels=ort_kernels, moe_form=moe_form, mxfp4_form=mxfp4_form or "unpack",
                               logits_to_keep=keep)
        con.print(f"wrote {out}: opset {info['opset']}, {info['nodes']:,} nodes, {info['inputs']} inputs, "
                  f"{info['initializers']} initializers"
                  + (f", data in {info['external_data']}" if info["external_data"] else "")
                  + f" ({time.perf_counter() - t0:.2f} s)")
        con.print(f"lowered natively: {', '.join(sorted(info['native']))}")
        con.print(f"decomposed: {', '.join(sorted(info['decomposed'])) or '-'}")
        return 0
    if fmt == "mlir":
        from k3ir.backends.mlir import compile_mlir, emit_mlir
        from k3ir.backends.mlir.config import mlir_config
        fns = [args.function] if args.function else ["prefill", "decode"]
        forms = {k: v for k, v in (("moe_form", moe_form), ("kda_form", kda_form)) if v is not None} | mlir_keep
        # a standalone module: the weights as trailing arguments (upstream dialects only), one module of every
        # function compiled without data tiling (decode steps do not compile with it: backends/mlir DATA_TILED_GROUPS)
        forms |= {"param_form": "arguments", "data_tiling": False}
        with (mlir_config(**forms),
              progress(f"mlir: emitting and verifying {', '.join('@' + x for x in fns)} of {m.name}") as emitted):
            text, order = emit_mlir(m, fns)
        vm = os.path.splitext(out)[0] + f".{args.iree_target}.vmfb" if args.iree_target else None
        if vm:
            _check_writable([vm])
        with _writing([out]), open(out, "w") as f:
            f.write(text)
        con.print(f"wrote {out}: {len(text.splitlines()):,} lines, functions {', '.join('@' + x for x in fns)}; "
                  f"weights are trailing arguments ({len(order[fns[0]])} for @{fns[0]}) ({emitted.seconds:.2f} s)")
        if args.iree_target:
            t1 = time.perf_counter()
            data = compile_mlir(text, args.iree_target, data_tiling=False)
            with _writing([vm]), open(vm, "wb") as f:
                f.write(data)
            con.print(f"wrote {vm} ({len(data):,} bytes, IREE {args.iree_target}, {time.perf_counter() - t1:.1f} s)")
        return 0
    from . import pictures
    fn = args.function or "forward"
    level = args.level or "layer"
    with progress(f"{fmt}: drawing @{fn} of {m.name}") as drawn:
        if fmt == "html":
            text = pictures.to_html(m, fn)
        elif fmt == "dot":
            text = pictures.to_dot(m, fn, level)
        else:
            text = pictures.to_svg(m, fn, level)
    with _writing([out]), open(out, "w") as f:
        f.write(text)
    shown = "layer and op levels" if fmt == "html" else f"{level} level"
    con.print(f"wrote {out} ({fmt}, {shown}, @{fn}, {len(text):,} bytes, {drawn.seconds:.2f} s)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("export", help="write ONNX, MLIR or a graph picture (dot/svg/html)")
    model_arg(p)
    p.add_argument("--format", choices=FORMATS, help="output format (default: from the -o extension)")
    p.add_argument("-o", "--output", metavar="OUT", help="output file (required unless --describe)")
    p.add_argument("--function", help="entry function (onnx: prefill; mlir: prefill+decode; pictures: forward)")
    p.add_argument("--weights", choices=("inputs", "external", "embedded"),
                   help="onnx: weights as graph inputs (structure only), in OUT.data (default) or embedded")
    p.add_argument("--opset", type=int, choices=(27, 20),
                   help="onnx: 27 (default where the installed onnxruntime runs it: LinearAttention, "
                        "CausalConvWithState) or 20 (KDA as a Scan, for older runtimes)")
    p.add_argument("--ort-kernels", action="store_true",
                   help="onnx: LinearAttention and CausalConvWithState in onnxruntime's com.microsoft domain "
                        "(its native CPU kernels; the file then needs onnxruntime)")
    p.add_argument("--describe", action="store_true",
                   help="onnx: print the graph's inputs and outputs (names, types, shapes; weights left out), "
                        "write nothing")
    p.add_argument("--logits-to-keep", type=int, metavar="N",
                   help="onnx: default of the graph input logits_to_keep: logits for the last N positions only "
                        "(default 1, what generation needs; 0: every position); callers may feed another value; "
                        "mlir: 0 (default, every position) or 1 (the last), compiled in")
    p.add_argument("--iree-target", choices=("llvm-cpu", "rocm", "vulkan-spirv", "metal-spirv"),
                   help="mlir: also compile a deployable IREE module OUT.<target>.vmfb")
    p.add_argument("--quantize", choices=("none", "mxfp4"),
                   help="onnx, mlir: routed experts as packed MXFP4, dequantised in the graph (default: what the "
                        "config says)")
    p.add_argument("--moe-form", choices=tuple(dict.fromkeys(ONNX_MOE_FORMS + MLIR_MOE_FORMS)),
                   help="routed experts; onnx: sorted (default up to 256 experts: one Gemm per expert on its slice "
                        "of the expert-sorted rows) or loop (a Loop over the experts in use; default above 256); "
                        "mlir: sorted (default: one contraction per expert on its rows) or dense (every token "
                        "through every expert, the earlier lowering; float experts only)")
    p.add_argument("--mxfp4-form", choices=MXFP4_FORMS,
                   help="onnx, MXFP4 experts: unpack (default: bit operations and the E2M1 table, runs in "
                        "onnxruntime 1.32) or dequantize_linear (the standard FLOAT4E2M1 + blocked "
                        "DequantizeLinear, opset 27; onnxruntime 1.32's CPU provider has no kernel for it)")
    p.add_argument("--kda-form", choices=KDA_FORMS,
                   help="mlir: KDA in prefill as chunked (default: SPEC.md 3's chunk form, an scf.for over "
                        "chunks) or scan (an scf.for over tokens, the earlier lowering)")
    p.add_argument("--level", choices=("layer", "op"), help="dot/svg: layer (default) or op level")
    p.set_defaults(func=cmd_export)
