"""``k3ir export``: write a model as ONNX, MLIR or a picture. A flag that does not apply to the
format (``--weights``/``--quantize`` outside onnx, ``--iree-target`` outside mlir, ``--level`` outside
dot/svg) is a usage error naming the flag and the format (exit 2), never silently ignored.

    k3ir export kimi-k3 --format onnx --weights inputs -o k3.onnx      # structure only
    k3ir export k3-tiny --format onnx --opset 20 -o tiny20.onnx          # Scan lowering, older runtimes
    k3ir export k3-tiny --format onnx -o tiny.onnx                      # weights in tiny.onnx.data
    k3ir export k3-tiny --format mlir -o tiny.mlir --iree-target vulkan-spirv   # + tiny.vulkan-spirv.vmfb
    k3ir export kimi-k3 --format html -o k3.html                        # collapsible layer view
    k3ir export k3-tiny --format svg --level op -o tiny.svg
"""
from __future__ import annotations

import contextlib
import os
import time

from k3ir.progress import progress

from .common import UsageError, console, load_model, model_arg

FORMATS = ("onnx", "mlir", "dot", "svg", "html")


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
    if args.quantize is not None and fmt != "onnx":      # MLIR exports keep the experts as the module has them
        raise UsageError(f"--quantize applies to --format onnx only, not --format {fmt}")
    opset = getattr(args, "opset", None)
    if opset is not None and fmt != "onnx":
        raise UsageError(f"--opset applies to --format onnx only, not --format {fmt}")
    ort_kernels = getattr(args, "ort_kernels", False)
    if ort_kernels and (fmt != "onnx" or opset == 20):
        raise UsageError(f"--ort-kernels applies to --format onnx at opset 27 only, not --format {fmt}"
                         + (" --opset 20" if opset == 20 else ""))
    if args.level is not None and fmt not in ("dot", "svg"):
        raise UsageError(f"--level applies to --format dot and svg only, not --format {fmt}")
    if describe and fmt != "onnx":
        raise UsageError(f"--describe applies to --format onnx only, not --format {fmt}")
    t0 = time.perf_counter()
    m = load_model(args)
    out = args.output
    if not describe:
        _check_writable([out])
    quant = args.quantize or m.attrs.get("expert_quant", "none")
    if quant not in ("none", "mxfp4"):
        raise UsageError(f"export keeps mxfp4 experts packed; '{quant}' experts are not supported (use --quantize none)")
    if quant == "mxfp4" and fmt == "onnx":        # packed experts, dequantised inside the graph
        from k3ir.passes import run_pipeline
        run_pipeline(m, ["fuse-moe-dispatch", "quantize-experts{format=mxfp4}", "dce"])
    if describe:
        from k3ir.backends.onnx.export import describe_io
        rows = describe_io(m, args.function or "prefill", opset=opset, ort_kernels=ort_kernels)
        for kind, name, dt, shape in rows:
            con.print(f"{kind:<6} {name:<32} {dt:<8} [{', '.join(map(str, shape))}]")
        return 0
    if fmt == "onnx":
        from k3ir.backends.onnx.export import export_onnx
        weights = args.weights or "external"
        outs = [out] + ([out + ".data"] if weights == "external" else [])
        _check_writable(outs)
        with _writing(outs), progress(f"onnx: exporting @{args.function or 'prefill'} of {m.name} to {out}"):
            info = export_onnx(m, out, function=args.function or "prefill", weights=weights,
                               params=None if weights == "inputs" else _params(m), opset=opset,
                               ort_kernels=ort_kernels)
        con.print(f"wrote {out}: opset {info['opset']}, {info['nodes']:,} nodes, {info['inputs']} inputs, "
                  f"{info['initializers']} initializers"
                  + (f", data in {info['external_data']}" if info["external_data"] else "")
                  + f" ({time.perf_counter() - t0:.2f} s)")
        con.print(f"lowered natively: {', '.join(sorted(info['native']))}")
        con.print(f"decomposed: {', '.join(sorted(info['decomposed'])) or '-'}")
        return 0
    if fmt == "mlir":
        from k3ir.backends.mlir import compile_mlir, emit_mlir
        fns = [args.function] if args.function else ["prefill", "decode"]
        with progress(f"mlir: emitting and verifying {', '.join('@' + x for x in fns)} of {m.name}") as emitted:
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
            data = compile_mlir(text, args.iree_target)
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
    p.add_argument("--iree-target", choices=("llvm-cpu", "rocm", "vulkan-spirv", "metal-spirv"),
                   help="mlir: also compile a deployable IREE module OUT.<target>.vmfb")
    p.add_argument("--quantize", choices=("none", "mxfp4"),
                   help="onnx: routed experts as packed MXFP4 (default: what the config says)")
    p.add_argument("--level", choices=("layer", "op"), help="dot/svg: layer (default) or op level")
    p.set_defaults(func=cmd_export)
