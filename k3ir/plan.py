"""Deployment planner (``k3ir plan``): per-GPU memory, communication and a decode roofline of a
model laid out over ``ep x cp x tp x dp`` GPUs. Pure arithmetic over a built Module (its parameter
bytes by group, ``k3ir.accounting``) and its config; no torch. ``docs/plan.md`` explains the model.

Layout. The GPUs form a mesh ``ep x cp x tp x dp`` (rank order: tp innermost, then cp, ep, dp, so a
tensor-parallel group is a block of neighbouring GPUs). Each ep and dp coordinate serves its own
sequences (data-parallel attention); tp splits the work of the same tokens (column / row parallel,
one all-reduce per block); cp splits each sequence into contiguous segments (KCP, SPEC.md 3).
Weights per GPU: routed experts over ``ep`` (whole experts) and, inside each expert, over ``tp``
(intermediate dimension), replicated over cp and dp; the rest as the ``shard`` pass places it
(``k3ir.sharding``: attention heads, dense FFN, shared experts, embedding and LM head over ``tp``; the
low-rank attention projections, router, latent projections, norms, AttnRes and vision tower
replicated), so the planner's bytes are the sharded module's.

Units: bytes (decimal GB = 1e9 in messages), seconds, bytes/s, FLOP/s.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .accounting import param_group, report
from .errors import K3Error
from .ir import Module
from .sharding import param_shards
from .types import DTYPE_BYTES


class K3PlanError(K3Error):
    """No layout of the requested GPUs holds the model, or a requested layout does not fit / is
    invalid; the message says which and by how much."""


@dataclass(frozen=True)
class GPU:
    """Per-GPU figures the planner assumes (one row of ``GPUS``): ``hbm_bytes`` capacity,
    ``hbm_bw`` and ``link_bw`` (NVLink, one direction) and ``net_bw`` (scale-out NIC, one
    direction) in bytes/s, ``per_node`` GPUs per NVLink domain, ``bf16_flops`` dense FLOP/s."""
    name: str
    hbm_bytes: float
    hbm_bw: float
    link_bw: float
    net_bw: float
    per_node: int
    bf16_flops: float


#: The assumed hardware, per GPU (the same table is in docs/plan.md). HGX boards of 8 GPUs,
#: NVLink bandwidth per direction (half the bidirectional figure of the data sheets), one
#: 400 Gb/s NIC per GPU between nodes, dense (not sparse) bf16 tensor-core throughput.
GPUS: dict[str, GPU] = {
    "h100": GPU("h100", 80e9, 3.35e12, 450e9, 50e9, 8, 989e12),
    "h200": GPU("h200", 141e9, 4.8e12, 450e9, 50e9, 8, 989e12),
    "b200": GPU("b200", 180e9, 8.0e12, 900e9, 50e9, 8, 2250e12),
}

#: Per-GPU allowance for communication buffers and workspaces: NCCL communicators of the four
#: process groups and their channel buffers, the CUDA context, GEMM / Triton workspaces, CUDA-graph
#: pools and allocator fragmentation.
WORKSPACE_BYTES = 4e9
#: Tokens of one prefill chunk (one sequence; split over cp); shorter sequences are one chunk.
PREFILL_CHUNK = 8192
#: EP send buffers hold ``ceil(CAPACITY_FACTOR * tokens * k / E)`` rows per expert per source rank
#: (``shard{capacity=C}``): 1.0 is the balanced load QB keeps the experts at.
CAPACITY_FACTOR = 1.0
#: Groups read at every decode step (the embedding reads B rows, the vision tower nothing).
NOT_READ_AT_DECODE = ("embedding", "vision")
#: Logits are all-gathered over tp in float32.
LOGIT_BYTES = 4
#: KCP partial states and MLA partial attention outputs travel in float32.
STATE_BYTES = 4
AXES = ("ep", "cp", "tp", "dp")
#: the largest --gpus searched
MAX_GPUS = 1 << 16


@dataclass(frozen=True)
class Layout:
    """GPUs per mesh axis; ``gpus = ep * cp * tp * dp``."""
    ep: int = 1
    cp: int = 1
    tp: int = 1
    dp: int = 1

    @property
    def gpus(self) -> int:
        return self.ep * self.cp * self.tp * self.dp

    def __str__(self) -> str:
        return " ".join(f"{a}={getattr(self, a)}" for a in AXES)


@dataclass(frozen=True)
class ModelFacts:
    """What the planner reads from a module: parameter bytes by group (after any expert
    quantisation the module carries), the shapes that set state, activations and messages, and
    the decode FLOPs per token at ``context`` (``accounting.report``)."""
    name: str
    group_bytes: dict[str, float]
    tp_split_group_bytes: dict[str, float]     # per group, the bytes of the parameters split over tp
    expert_format: str
    hidden: int
    layers: int
    dense_layers: int
    moe_layers: int
    kda_layers: int
    mla_layers: int
    experts: int
    top_k: int
    latent: int               # width of the rows the MoE dispatch sends (latent size, else hidden)
    moe_intermediate: int
    shared_experts: int
    dense_intermediate: int
    vocab: int
    kda_heads: int
    kda_head_dim: int
    mla_heads: int
    qk_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    mla_output_gate: bool
    attn_res_blocks: int
    act_bytes: int
    kda_state_bytes: float     # recurrent + short-conv state per sequence, all KDA layers (fp32)
    mla_bytes_per_token: float  # latent cache per token, all MLA layers
    flops_per_token: float
    context: int

    @property
    def expert_bytes(self) -> float:
        return self.group_bytes.get("routed_experts", 0.0)

    @property
    def weight_bytes(self) -> float:
        return sum(self.group_bytes.values())

    def tp_split_bytes(self) -> float:
        return sum(self.tp_split_group_bytes.values())

    def replicated_bytes(self) -> float:
        return sum(v - self.tp_split_group_bytes.get(g, 0.0) for g, v in self.group_bytes.items()
                   if g != "routed_experts")


def model_facts(module: Module, context: int = 4096) -> ModelFacts:
    """Facts of ``module`` (built from a config: K3PlanError for a module without one, e.g. a
    ``.k3`` file). Parameter bytes per group come from the module's parameter types, so a module
    after ``quantize-experts`` counts its MXFP4/INT4 experts with their scales."""
    c = getattr(module, "config", None)
    if c is None:
        raise K3PlanError(f"plan needs the model's config (hidden size, heads, experts); {module.name} has none "
                          "(a .k3 IR file?): pass a config.json, checkpoint directory or bundled name")
    r = report(module, context=context)
    groups: dict[str, float] = {}
    split: dict[str, float] = {}
    tp_split = {n for n, spec in param_shards(module, ep=2, tp=2).items() if "tp" in spec}
    for name, decl in module.params.items():
        g = param_group(name)
        groups[g] = groups.get(g, 0.0) + float(decl.type.nbytes())
        if name in tp_split and g != "routed_experts":
            split[g] = split.get(g, 0.0) + float(decl.type.nbytes())
    quant = sorted({str(d.attrs["quant"]) for d in module.params.values() if "quant" in d.attrs})
    act = DTYPE_BYTES.get(str(module.attrs.get("dtype", "bf16")), 2)
    kda_state = sum(lr.state_bytes_per_sequence for lr in r.layers)
    mla_tok = sum(lr.kv_bytes_per_token for lr in r.layers)
    block = int(c.attn_res_block_size or 0)
    return ModelFacts(
        name=module.name, group_bytes=groups, tp_split_group_bytes=split, expert_format="/".join(quant) or str(module.attrs.get("dtype", "bf16")),
        hidden=int(c.hidden_size), layers=int(c.num_hidden_layers), dense_layers=r.counts.get("dense", 0),
        moe_layers=r.counts["moe"],
        kda_layers=r.counts["kda"], mla_layers=r.counts["mla"], experts=int(c.num_experts), top_k=int(c.top_k),
        latent=int(c.latent_size or c.hidden_size), moe_intermediate=int(c.moe_intermediate_size),
        shared_experts=int(c.num_shared_experts or 0), dense_intermediate=int(c.intermediate_size),
        vocab=int(c.vocab_size), kda_heads=int(c.kda_num_heads or 0), kda_head_dim=int(c.kda_head_dim or 0),
        mla_heads=int(c.num_attention_heads or 0), qk_head_dim=int((c.qk_nope_head_dim or 0) + (c.qk_rope_head_dim or 0)),
        v_head_dim=int(c.v_head_dim or 0), kv_lora_rank=int(c.kv_lora_rank or 0),
        mla_output_gate=bool(c.mla_use_output_gate),
        attn_res_blocks=math.ceil(int(c.num_hidden_layers) / block) if block else 0, act_bytes=act,
        kda_state_bytes=kda_state, mla_bytes_per_token=mla_tok, flops_per_token=r.flops_per_token, context=context)


# ---- one layout ------------------------------------------------------------------------------
@dataclass
class Plan:
    """The figures of one layout. ``memory``: bytes per GPU by item; ``comm_decode`` /
    ``comm_prefill``: bytes each GPU sends per token it processes, by collective;
    ``step_s``: the decode step's HBM, interconnect and compute times (the roofline is their
    maximum: communication and compute are assumed to overlap the weight and state reads)."""
    layout: Layout
    gpu: str
    seq: int
    batch: int
    sequences_per_gpu: int
    memory: dict[str, float]
    capacity: float
    comm_decode: dict[str, float]
    comm_prefill: dict[str, float]
    decode_bytes_read: float
    step_s: dict[str, float]
    tokens_per_s_per_sequence: float
    tokens_per_s: float

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.memory_total <= self.capacity

    @property
    def comm_per_decode_token(self) -> float:
        return sum(self.comm_decode.values())

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layout"] = {a: getattr(self.layout, a) for a in AXES}
        d.update(gpus=self.layout.gpus, memory_total=self.memory_total, fits=self.fits,
                 comm_per_decode_token=self.comm_per_decode_token,
                 comm_per_prefill_token=sum(self.comm_prefill.values()))
        return d


def activation_bytes_per_token(f: ModelFacts, tp: int) -> float:
    """Live activations per prefill token on one GPU (inference, one layer at a time), in the
    activation dtype: the residual stream, the layer input, its norm and output and the AttnRes
    block sums ``(4 + blocks) d``, plus the largest layer intermediate: KDA ``q,k,v,g,o`` and
    beta (``6 H D / tp``), MLA ``q,k`` (``2 H dqk``), ``v``, the output gate if any and the output
    (``(2 + gate) H dv``) over tp, MoE send and receive buffers and the combined output
    (``3 k latent``) plus the expert's gate and up (``2 k I / tp``) and the shared experts'
    (``2 s I / tp``), the dense FFN's ``2 I / tp``. Bytes per token."""
    resident = (4 + f.attn_res_blocks) * f.hidden
    kda = 6 * f.kda_heads * f.kda_head_dim / tp if f.kda_layers else 0
    mla = f.mla_heads * (2 * f.qk_head_dim + (2 + f.mla_output_gate) * f.v_head_dim) / tp if f.mla_layers else 0
    moe = (f.top_k * (3 * f.latent + 2 * f.moe_intermediate / tp) + 2 * f.shared_experts * f.moe_intermediate / tp
           if f.moe_layers else 0)
    dense = 2 * f.dense_intermediate / tp
    return f.act_bytes * (resident + max(kda, mla, moe, dense))


def group_bandwidth(layout: Layout, gpu: GPU, axis: str) -> float:
    """Bytes/s per GPU for a collective over ``axis``: NVLink when the group stays inside one
    node of ``gpu.per_node`` GPUs (the span of an axis is its size times the sizes of the axes
    inside it, rank order tp, cp, ep, dp), else the network (the whole collective at NIC speed)."""
    span = 1
    for a in ("tp", "cp", "ep", "dp"):
        span *= getattr(layout, a)
        if a == axis:
            break
    return gpu.link_bw if span <= gpu.per_node else gpu.net_bw


def ep_capacity(f: ModelFacts, tokens: int, capacity_factor: float = CAPACITY_FACTOR) -> int:
    """EP send-buffer rows per expert per source rank for a call routing ``tokens`` tokens on one GPU:
    ``ceil(capacity_factor * tokens * k / E)`` (at least 1), the ``capacity`` of ``shard{capacity=C}``."""
    return max(1, math.ceil(capacity_factor * tokens * f.top_k / f.experts)) if f.experts else 0


def communication(f: ModelFacts, layout: Layout, seq: int, decode_tokens: int = 1, prefill_tokens: int | None = None,
                  capacity_factor: float = CAPACITY_FACTOR) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes each GPU sends per token it processes, by collective, for decode and for prefill, as the
    sharded module runs them (``passes/shard.py``; ring collectives: an all-reduce of S bytes over g GPUs
    sends ``2 (g-1)/g S``, an all-gather in which each contributes P sends ``(g-1) P``, an all-to-all of S
    sends ``(g-1)/g S``). ``decode_tokens``: tokens one GPU routes per decode step (its sequences);
    ``prefill_tokens``: per prefill call (default: a chunk's segment). Collectives over an axis of size 1
    are left out, and so are those per sequence rather than per token (the short conv's halo, the final
    states' broadcast from the last cp rank).

    - ``ep_all_to_all``: dispatch and combine per MoE layer, each the fixed send buffer of ``E`` experts x
      ``C`` rows (``ep_capacity``) of ``latent`` activations, ``(ep-1)/ep`` of it sent, per token routed:
      ``2 (ep-1)/ep E C latent / tokens`` (``(ep-1)/ep 2 k latent`` when the loads sit at the target).
    - ``tp_all_reduce``: after every attention block's row-parallel output projection, every dense FFN
      and every MoE layer's shared experts (width ``d``), after every MoE layer's routed experts (their
      intermediate dim is split: the combine's partial sums, width ``latent``) and after the
      vocabulary-parallel embedding (``d``).
    - ``tp_logits_all_gather``: ``(tp-1)/tp vocab`` float32 logits per token (prefill computes every
      token's logits too).
    - ``cp_state_all_gather`` (prefill): each KDA layer's segment summary ``(M, S_loc)``,
      ``2 H/tp D^2`` float32 per segment of ``seq/cp`` tokens, to cp-1 peers (SPEC.md 3).
    - ``cp_cache_all_gather`` (prefill): each MLA layer's latent kv of the segment, to cp-1 peers (every
      cp rank then holds the whole cache). Decode steps are replicated over cp: no cp traffic.
    """
    ep, cp, tp = layout.ep, layout.cp, layout.tp
    a = f.act_bytes
    dec: dict[str, float] = {}
    pre: dict[str, float] = {}
    segment = max(1, math.ceil(seq / cp))
    chunk = prefill_tokens or math.ceil(min(seq, PREFILL_CHUNK) / cp)
    if ep > 1 and f.moe_layers:
        for out, t in ((dec, decode_tokens), (pre, chunk)):
            rows = f.experts * ep_capacity(f, t, capacity_factor)
            out["ep_all_to_all"] = f.moe_layers * 2 * (ep - 1) / ep * rows * f.latent * a / t
    if tp > 1:
        width = ((f.layers + f.dense_layers + (f.moe_layers if f.shared_experts else 0) + 1) * f.hidden
                 + f.moe_layers * f.latent)
        dec["tp_all_reduce"] = pre["tp_all_reduce"] = 2 * (tp - 1) / tp * width * a
        dec["tp_logits_all_gather"] = pre["tp_logits_all_gather"] = (tp - 1) / tp * f.vocab * LOGIT_BYTES
    if cp > 1:
        if f.mla_layers:
            pre["cp_cache_all_gather"] = (cp - 1) * f.mla_bytes_per_token
        if f.kda_layers:
            pre["cp_state_all_gather"] = (f.kda_layers * (cp - 1) * 2 * f.kda_heads / tp * f.kda_head_dim ** 2
                                          * STATE_BYTES / segment)
    return dec, pre


_AXIS_OF = {"ep_all_to_all": "ep", "tp_all_reduce": "tp", "tp_logits_all_gather": "tp",
            "cp_cache_all_gather": "cp", "cp_state_all_gather": "cp"}


def plan_layout(f: ModelFacts, layout: Layout, gpu: GPU, seq: int, batch: int,
                capacity_factor: float = CAPACITY_FACTOR) -> Plan:
    """Memory, communication and decode roofline of ``layout`` on ``gpu`` for ``batch``
    sequences (in total) of ``seq`` tokens each. Sequences spread evenly over the ``ep x dp``
    groups (``sequences_per_gpu = ceil(batch / (ep dp))``; the busiest GPU sets the step time).
    As the ``shard`` pass runs it: the MLA cache is whole on every cp rank (each all-gathers the
    segments' latent kv) and decode steps are replicated over cp."""
    ep, cp, tp = layout.ep, layout.cp, layout.tp
    seqs = math.ceil(batch / (ep * layout.dp))
    chunk = math.ceil(min(seq, PREFILL_CHUNK) / cp)
    memory = {
        "routed_experts": f.expert_bytes / (ep * tp),
        "trunk_tp_split": f.tp_split_bytes() / tp,
        "trunk_replicated": f.replicated_bytes(),
        "kda_state": seqs * f.kda_state_bytes / tp,
        "mla_cache": seqs * seq * f.mla_bytes_per_token,
        "activations": chunk * activation_bytes_per_token(f, tp),
        "workspace": WORKSPACE_BYTES,
    }
    dec, pre = communication(f, layout, seq, decode_tokens=seqs, prefill_tokens=chunk, capacity_factor=capacity_factor)
    # decode step of the busiest GPU: one token for each of its sequences
    touched = 1.0 - (1.0 - f.top_k / f.experts) ** (seqs * ep) if f.experts else 0.0
    read_trunk = (sum(v for g, v in f.tp_split_group_bytes.items() if g not in NOT_READ_AT_DECODE) / tp
                  + sum(v - f.tp_split_group_bytes.get(g, 0.0) for g, v in f.group_bytes.items()
                        if g != "routed_experts" and g not in NOT_READ_AT_DECODE))
    read = (read_trunk + touched * memory["routed_experts"]
            + seqs * (2 * f.kda_state_bytes / tp + seq * f.mla_bytes_per_token))
    t_comm = sum(seqs * b / group_bandwidth(layout, gpu, _AXIS_OF[k]) for k, b in dec.items())
    step = {"hbm": read / gpu.hbm_bw, "interconnect": t_comm,
            "compute": seqs * f.flops_per_token / tp / gpu.bf16_flops}
    t = max(step.values())
    return Plan(layout=layout, gpu=gpu.name, seq=seq, batch=batch, sequences_per_gpu=seqs, memory=memory,
                capacity=gpu.hbm_bytes, comm_decode=dec, comm_prefill=pre, decode_bytes_read=read, step_s=step,
                tokens_per_s_per_sequence=1.0 / t, tokens_per_s=min(batch, seqs * ep * layout.dp) / t)


# ---- choosing layouts ------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def layout_problem(f: ModelFacts, layout: Layout, seq: int) -> str | None:
    """Why ``layout`` cannot shard this model (None: it can): tp must divide the KDA and MLA
    heads and the expert intermediate size, ep the number of experts, cp at most ``seq``."""
    if f.kda_layers and f.kda_heads % layout.tp:
        return f"tp={layout.tp} does not divide the {f.kda_heads} KDA heads"
    if f.mla_layers and f.mla_heads % layout.tp:
        return f"tp={layout.tp} does not divide the {f.mla_heads} MLA heads"
    if f.moe_layers and f.moe_intermediate % layout.tp:
        return f"tp={layout.tp} does not divide the expert intermediate size {f.moe_intermediate}"
    if f.experts % layout.ep:
        return f"ep={layout.ep} does not divide the {f.experts} routed experts"
    if layout.cp > seq:
        return f"cp={layout.cp} is more than the {seq} tokens of a sequence"
    return None


def candidate_layouts(f: ModelFacts, gpus: int, seq: int, fixed: dict[str, int] | None = None,
                      max_tp: int | None = None) -> list[Layout]:
    """Every valid layout of exactly ``gpus`` GPUs whose axes match ``fixed`` (axis -> size), with
    ``tp <= max_tp`` when given."""
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    out = []
    for ep in _divisors(gpus):
        for cp in _divisors(gpus // ep):
            for tp in _divisors(gpus // (ep * cp)):
                lay = Layout(ep, cp, tp, gpus // (ep * cp * tp))
                if max_tp is not None and tp > max_tp:
                    continue
                if all(getattr(lay, k) == v for k, v in fixed.items()) and layout_problem(f, lay, seq) is None:
                    out.append(lay)
    return out


def rank_plans(plans: list[Plan]) -> list[Plan]:
    """Fitting plans first by decode roofline (aggregate tokens/s, descending), ties by less
    communication per decode token, then fewer tp/cp (simpler)."""
    return sorted(plans, key=lambda p: (-round(p.tokens_per_s, 6), p.comm_per_decode_token,
                                        p.layout.tp, p.layout.cp, p.layout.ep))


def plan(f: ModelFacts, gpus: int, gpu: str, seq: int = 4096, batch: int = 32,
         fixed: dict[str, int] | None = None, top: int = 3) -> list[Plan]:
    """The best ``top`` layouts that fit (``rank_plans``) among the valid layouts matching ``fixed``
    (axis -> size; the other axes are searched, tp only up to the GPUs of one node unless fixed).
    K3PlanError when the GPU kind is
    unknown, the fixed axes name no valid layout, or nothing fits: the message says by how much
    (the closest layout's excess per GPU, and the weights against the total HBM)."""
    if gpu not in GPUS:
        raise K3PlanError(f"unknown GPU '{gpu}' (known: {', '.join(GPUS)})")
    if gpus < 1 or seq < 1 or batch < 1:
        raise K3PlanError(f"--gpus, --seq and --batch must be >= 1 (got {gpus}, {seq}, {batch})")
    if gpus > MAX_GPUS:
        raise K3PlanError(f"--gpus {gpus}: the planner searches layouts of at most {MAX_GPUS} GPUs")
    g = GPUS[gpu]
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    for k, v in fixed.items():
        if k not in AXES or v < 1:
            raise K3PlanError(f"--{k} must be >= 1, got {v}")
    prod = math.prod(fixed.values()) if fixed else 1
    if gpus % prod:
        given = " x ".join(f"--{k} {v}" for k, v in fixed.items())
        raise K3PlanError(f"{given} = {prod} GPUs, which does not divide --gpus {gpus}")
    # searched layouts keep tensor parallelism inside one node (its per-block all-reduces are latency-bound,
    # which the bandwidth roofline does not see); an explicit --tp may cross nodes
    cands = candidate_layouts(f, gpus, seq, fixed, max_tp=None if "tp" in fixed else g.per_node)
    if not cands:
        why = layout_problem(f, Layout(**{a: fixed.get(a, 1) for a in AXES}), seq)
        raise K3PlanError(f"no valid layout of {gpus} GPUs with {', '.join(f'{k}={v}' for k, v in fixed.items())}"
                          + (f": {why}" if why else ""))
    plans = [plan_layout(f, lay, g, seq, batch) for lay in cands]
    fit = [p for p in plans if p.fits]
    if not fit:
        raise K3PlanError(refusal(f, plans, g, gpus, fixed))
    return rank_plans(fit)[:top]


def refusal(f: ModelFacts, plans: list[Plan], gpu: GPU, gpus: int, fixed: dict[str, int]) -> str:
    """One line: the closest layout's memory per GPU against the capacity (and, when the
    weights alone exceed the GPUs' total HBM, that too)."""
    best = min(plans, key=lambda p: p.memory_total)
    over = best.memory_total - best.capacity
    which = f"layout {best.layout}" if fixed and len(plans) == 1 else f"no layout fits; the closest, {best.layout},"
    msg = (f"{f.name} on {gpus} x {gpu.name}: {which} needs {best.memory_total / 1e9:,.1f} GB per GPU, "
           f"{over / 1e9:,.1f} GB more than the {gpu.hbm_bytes / 1e9:,.0f} GB a {gpu.name} has")
    total = gpus * gpu.hbm_bytes
    if f.weight_bytes > total:
        msg += (f" (the weights alone are {f.weight_bytes / 1e12:,.2f} TB, {gpus} GPU{'' if gpus == 1 else 's'} hold{'s' if gpus == 1 else ''} "
                f"{total / 1e12:,.2f} TB)")
    return msg
