"""``k3ir plan``: how to lay a model out over N GPUs (``k3ir.plan``; docs/plan.md).

    k3ir plan kimi-k3 --gpus 16 --gpu h200                 # the best three layouts that fit
    k3ir plan kimi-k3 --gpus 16 --gpu h200 --ep 4 --tp 4   # one layout (refused, exit 2, if it does not fit)
    k3ir plan kimi-k3 --gpus 16 --gpu h200 --json
"""
from __future__ import annotations

import json

from .common import console, human_bytes, load_model, model_arg


def cmd_plan(args) -> int:
    from k3ir.passes import run_pipeline

    from k3ir.plan import GPUS, model_facts, plan
    m = load_model(args)
    # routed experts in the format the config (or --quantize) asks for: the module's bytes say what it stores
    run_pipeline(m, "fuse-moe-dispatch,quantize-experts", quantize=args.quantize)
    facts = model_facts(m, context=args.seq)
    fixed = {"ep": args.ep, "cp": args.cp, "tp": args.tp, "dp": args.dp}
    plans = plan(facts, args.gpus, args.gpu, seq=args.seq, batch=args.batch, fixed=fixed)
    g = GPUS[args.gpu]
    if args.json:
        print(json.dumps({"model": facts.name, "gpus": args.gpus, "gpu": vars(g), "seq": args.seq,
                          "batch": args.batch, "weights": facts.group_bytes, "weight_bytes": facts.weight_bytes,
                          "expert_format": facts.expert_format, "plans": [p.as_dict() for p in plans]}, indent=2))
        return 0
    print_plans(facts, plans, g, args)
    return 0


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def print_plans(facts, plans, g, args) -> None:
    from rich.table import Table
    con = console()
    con.print(f"{facts.name} on {args.gpus} x {g.name} ({g.hbm_bytes / 1e9:,.0f} GB HBM at {g.hbm_bw / 1e12:.2f} TB/s, "
              f"NVLink {g.link_bw / 1e9:,.0f} GB/s, network {g.net_bw / 1e9:,.0f} GB/s per GPU, {g.per_node} per node; "
              f"{g.bf16_flops / 1e12:,.0f} TFLOP/s bf16); {args.batch} sequences x {args.seq:,} tokens")
    con.print(f"weights {human_bytes(facts.weight_bytes)}: routed experts ({facts.expert_format}) "
              f"{human_bytes(facts.expert_bytes)}, trunk {human_bytes(facts.weight_bytes - facts.expert_bytes)}")
    t = Table(title="per GPU, best first (sends: bytes per token it processes)")
    t.add_column("", no_wrap=True)
    for i, p in enumerate(plans, start=1):
        t.add_column(f"#{i} " + " ".join(f"{a}{getattr(p.layout, a)}" for a in ("ep", "cp", "tp", "dp")),
                     justify="right", no_wrap=True)
    rows: list[tuple[str, list[str]]] = []
    for k in plans[0].memory:
        rows.append((k.replace("_", " "), [_gb(p.memory[k]) for p in plans]))
    rows.append(("total / capacity", [f"{_gb(p.memory_total)} / {p.capacity / 1e9:,.0f}" for p in plans]))
    rows.append(("sequences per GPU", [str(p.sequences_per_gpu) for p in plans]))
    rows.append(("decode: bytes read / step", [_gb(p.decode_bytes_read) for p in plans]))
    rows.append(("decode step ms: HBM/link/compute", [" / ".join(f"{v * 1e3:.2f}" for v in p.step_s.values())
                                                          for p in plans]))
    rows.append(("decode tokens/s per sequence", [f"{p.tokens_per_s_per_sequence:,.1f}" for p in plans]))
    rows.append(("decode tokens/s aggregate", [f"{p.tokens_per_s:,.0f}" for p in plans]))
    for kind, attr in (("decode", "comm_decode"), ("prefill", "comm_prefill")):
        keys = sorted({k for p in plans for k in getattr(p, attr)})
        for k in keys:
            rows.append((f"{kind} sends: {k}",
                         [human_bytes(getattr(p, attr).get(k, 0.0)) for p in plans]))
    for name, vals in rows:
        t.add_row(name, *vals)
    con.print(t)


def register(sub) -> None:
    from k3ir.plan import GPUS
    p = sub.add_parser("plan", help="lay a model out over N GPUs: memory per GPU, communication, decode roofline")
    model_arg(p)
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="number of GPUs")
    p.add_argument("--gpu", choices=tuple(GPUS), default="h200", help="GPU kind (default h200; docs/plan.md: figures)")
    for axis, what in (("ep", "expert"), ("cp", "context (KCP)"), ("tp", "tensor"), ("dp", "data")):
        p.add_argument(f"--{axis}", type=int, metavar="N", help=f"{what}-parallel size (default: searched)")
    p.add_argument("--seq", type=int, default=4096, metavar="L", help="tokens per sequence (default 4096)")
    p.add_argument("--batch", type=int, default=32, metavar="B", help="sequences served at once, in total (default 32)")
    p.add_argument("--quantize", choices=("none", "mxfp4", "int4"),
                   help="routed-expert format (default: what the config says)")
    p.add_argument("--json", action="store_true", help="machine-readable figures")
    p.set_defaults(func=cmd_plan)
