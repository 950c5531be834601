"""Trainer: next-token training of a compiled module through the torch executable (autograd),
AdamW with decoupled weight decay and a warmup + cosine learning-rate schedule, global
gradient-norm clipping, bf16 autocast on CUDA, activation checkpointing per layer, and
Quantile Balancing of every MoE layer's selection bias after each step (SPEC.md 6).

    exe = k3ir.compile(k3ir.load("k3-tiny"), target="torch", dtype="float32")
    tr = Trainer(exe, TrainConfig(steps=300, qb="quantile"))
    stats = tr.train_step(batch)          # batch: int64[B, T+1]; stats.loss, stats.balance

The router's top-k selection has no gradient; the combine weights do. The QB bias
(``e_score_correction_bias``) is not trained by gradient: it is excluded from the optimizer
and set by the balancer from the step's router scores.

On a mesh (an executable of a sharded module compiled with ``mesh=``, ``runtime/distributed.py``) every
rank builds the same Trainer from the UNSHARDED parameters and calls ``train_step`` with the same global
batch; each trains its slice of the parameters on its rows (ep, dp) and segment (cp) of the batch, the
gradients of replicated parameters are summed over the ranks holding them, and QB reads the global
batch's histograms (``runtime/train_mesh.py``, docs/distributed.md).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np

from k3ir.errors import K3RuntimeError
from k3ir.ir import Function, Operation

from .qb import QuantileBalancer, moe_layers, router_spec
from .train_mesh import MeshTraining


@dataclass
class TrainConfig:
    """Hyper-parameters. ``lr`` peaks after ``warmup`` linear steps, then follows a cosine to
    ``lr * min_lr_ratio`` at ``schedule_steps`` (0, the default: at ``steps``) and stays there for any later
    step: a finished run extended to more ``steps`` keeps the schedule it was planned with, so its first steps
    are unchanged and the added ones run at ``lr * min_lr_ratio``. ``weight_decay`` applies to matrices only (not norms,
    biases, AttnRes pseudo-queries, ``A_log``/``dt_bias``). ``clip``: max global grad norm
    (0 = off). ``qb``: quantile | margin | sign | none. ``router_lr_scale`` multiplies the
    learning rate of the router weights (no weight decay on them). ``checkpointing``: recompute each layer
    in backward. ``autocast``: ``auto`` (bf16 on CUDA, off on CPU) | ``bf16`` | ``off``."""
    steps: int = 300
    batch: int = 8
    seq: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0
    qb: str = "quantile"
    qb_sign_step: float = 1e-3
    router_lr_scale: float = 1.0
    checkpointing: bool = False
    autocast: str = "auto"
    seed: int = 0
    schedule_steps: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class StepStats:
    """One step: ``loss`` (mean next-token cross entropy, nats), ``grad_norm`` (before
    clipping), ``lr``, ``balance`` (MoE layer -> max-load / mean-load of this step's routing),
    ``tokens`` trained on, ``seconds`` wall time."""
    step: int
    loss: float
    grad_norm: float
    lr: float
    balance: dict[int, float] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0

    @property
    def worst_balance(self) -> float:
        return max(self.balance.values()) if self.balance else 1.0


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate for 0-based ``step``: linear warmup to ``lr`` over ``warmup`` steps, then
    cosine decay to ``lr * min_lr_ratio`` at ``schedule_steps`` (or ``steps`` when 0), constant after it."""
    if cfg.warmup > 0 and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    horizon = cfg.schedule_steps or cfg.steps
    lo = cfg.lr * cfg.min_lr_ratio
    if step >= horizon:
        return lo
    span = max(1, horizon - cfg.warmup)
    frac = min(1.0, (step - cfg.warmup) / span)
    return lo + 0.5 * (cfg.lr - lo) * (1.0 + math.cos(math.pi * frac))


def decays(name: str, shape) -> bool:
    """Whether AdamW weight decay applies: tensors with at least two non-unit dims, except the
    KDA decay parameters."""
    if name.endswith(("A_log", "dt_bias")):
        return False
    return sum(1 for d in shape if int(d) > 1) >= 2


def layer_segments(fn: Function) -> tuple[list[Operation], list[list[Operation]]]:
    """Split ``fn``'s ops at layer boundaries for activation checkpointing: the ops before the
    first op tagged ``attrs["layer"]`` (the embedding) and one range per layer, from the layer's
    first tagged op up to the next layer's (the last range also holds the final norm and head)."""
    first: dict[int, int] = {}
    for i, op in enumerate(fn.ops):
        lay = op.attrs.get("layer")
        if isinstance(lay, int) and lay not in first:
            first[lay] = i
    starts = sorted(first.values())
    if not starts:
        return list(fn.ops), []
    head = list(fn.ops[:starts[0]])
    bounds = starts + [len(fn.ops)]
    return head, [list(fn.ops[a:b]) for a, b in pairwise(bounds)]


class Trainer:
    """Trains the parameters of a compiled module (a torch ``Executable`` or a ``Session`` over
    one). ``params``: initial values (name -> array); default: the session's, the module's bound
    weights, or the deterministic init from ``config.seed``. Parameters are kept as fp32 (fp64
    when compiled with ``float64``) leaf tensors in ``self.params``.

    A sharded executable (compiled with ``mesh=``) needs ``params``: the unsharded values, the same on every
    rank; ``self.params`` holds this rank's slices (``shard_params``) and ``self.mesh`` the MeshTraining.

    Raises K3RuntimeError for a non-torch executable, a bad configuration or a mesh without ``params``."""

    def __init__(self, executable, config: TrainConfig | None = None, params: dict[str, Any] | None = None):
        import torch

        from .session import Session
        if isinstance(executable, Session):
            params = executable.params if params is None else params
            executable = executable.exe
        if getattr(executable, "target", None) != "torch":
            raise K3RuntimeError(f"training needs the torch target, got '{getattr(executable, 'target', '?')}'")
        self.exe = executable
        self.module = executable.module
        self.cfg = config or TrainConfig()
        if "forward" not in self.module.functions:
            raise K3RuntimeError("module has no @forward function to train")
        self.mesh: MeshTraining | None = None
        if getattr(executable, "mesh", None) is not None:
            from .distributed import mesh_coords, shard_params
            if params is None:
                raise K3RuntimeError("a Trainer on a mesh takes params: the unsharded values, the same on every rank "
                                     "(init_params(module, seed) of the module before the shard pass)")
            coords = mesh_coords(executable.mesh)
            self.mesh = MeshTraining(self.module, coords)
            params = shard_params(self.module, params, coords)
        if params is None:
            params = Session(executable, seed=self.cfg.seed).params
        self.params: dict[str, Any] = {}
        for name, t in executable.prepare_params({k: params[k] for k in self.module.params}).items():
            t = t.detach().clone()
            if t.is_floating_point() and t.dtype in (torch.bfloat16, torch.float16):
                t = t.float()
            self.params[name] = t
        self.layers = moe_layers(self.module)
        self.bias_names = {lay.layer: lay.bias for lay in self.layers}
        frozen = set(self.bias_names.values())
        routers = {lay.weight for lay in self.layers if lay.weight}
        decay, no_decay, router = [], [], []
        self.trainable: list[str] = []
        for name, t in self.params.items():
            if name in frozen or not t.is_floating_point():
                continue
            t.requires_grad_(True)
            self.trainable.append(name)
            if name in routers:
                router.append(t)
            else:
                shape = self.mesh.full_shapes[name] if self.mesh else t.shape
                (decay if decays(name, shape) else no_decay).append(t)
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay, "lr_scale": 1.0},
                  {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0},
                  {"params": router, "weight_decay": 0.0, "lr_scale": self.cfg.router_lr_scale}]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=self.cfg.lr,
                                     betas=(self.cfg.beta1, self.cfg.beta2), eps=self.cfg.eps)
        self.qb = QuantileBalancer(self.layers, self.cfg.qb, self.cfg.qb_sign_step,
                                   all_reduce=self.mesh.data_all_reduce if self.mesh else None)
        self.step = 0
        self.history: list[StepStats] = []
        fn = self.module.functions["forward"]
        self._routers = {id(op): (int(op.attrs.get("layer", -1)), router_spec(op)[1]) for op in fn.ops
                         if router_spec(op) is not None}
        self._segments = layer_segments(fn)
        self._users = fn.users()
        self._returns = {id(v) for v in fn.returns}

    # ---- forward / loss ----------------------------------------------------------------
    def _autocast(self):
        import contextlib

        import torch
        mode = self.cfg.autocast
        on_cuda = self.exe.tdev.type == "cuda"
        if mode == "bf16" or (mode == "auto" and on_cuda):
            return torch.autocast(device_type=self.exe.tdev.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def logits(self, input_ids, capture: dict[int, Any] | None = None):
        """Logits ``f32[B, T, vocab]`` of ``input_ids int64[B, T]`` with autograd; router scores
        of each MoE layer go into ``capture[layer]`` (detached ``f32[B, T, E]``)."""
        import torch
        from k3ir.backends.interpreter import Interpreter
        fn = self.module.functions["forward"]

        def observe(op, out):
            hit = self._routers.get(id(op))
            if hit is not None and capture is not None:
                capture[hit[0]] = out[hit[1]].detach()

        interp = Interpreter(self.module, self.exe.table, self.params.__getitem__, post=self.exe._post,
                             observe=observe)
        ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.int64, device=self.exe.tdev)
        if not self.cfg.checkpointing:
            return interp.run(fn, [ids])[0]
        from torch.utils.checkpoint import checkpoint
        env: dict[int, Any] = {id(fn.args[0]): ids}
        head, segs = self._segments
        for op in head:
            interp.exec_op(op, env)
        for seg in segs:
            inside = {id(r) for op in seg for r in op.results}
            ins = list(dict.fromkeys(id(v) for op in seg for v in op.operands if id(v) not in inside))
            outs = [id(r) for op in seg for r in op.results
                    if id(r) in self._returns or any(u not in seg for u in self._users.get(id(r), []))]

            def run_seg(*vals, _seg=seg, _ins=ins, _outs=outs):
                local = dict(zip(_ins, vals))
                for op in _seg:
                    interp.exec_op(op, local)
                return tuple(local[i] for i in _outs)

            res = checkpoint(run_seg, *[env[i] for i in ins], use_reentrant=False, preserve_rng_state=False)
            env.update(zip(outs, res))
        return env[id(fn.returns[0])]

    def loss(self, batch, capture: dict[int, Any] | None = None):
        """Mean next-token cross entropy (nats) of ``batch int64[B, T+1]`` (inputs ``[:, :-1]``,
        targets ``[:, 1:]``), a scalar tensor with autograd. On a mesh: of this rank's part of the
        global batch (``MeshTraining.local_batch``)."""
        import torch
        import torch.nn.functional as F
        b = np.asarray(batch)
        if b.ndim != 2 or b.shape[1] < 2:
            raise K3RuntimeError(f"a training batch must be int64[B, T+1] with T >= 1, got shape {list(b.shape)}")
        if self.mesh is not None:
            b = self.mesh.local_batch(b)
        with self._autocast():
            lg = self.logits(b[:, :-1], capture)
        tgt = torch.as_tensor(b[:, 1:], dtype=torch.int64, device=lg.device)
        lg = lg.float() if lg.dtype in (torch.bfloat16, torch.float16) else lg
        return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt.reshape(-1))

    # ---- one optimisation step ----------------------------------------------------------
    def train_step(self, batch) -> StepStats:
        """Forward, backward, clip, AdamW step at ``lr_at(step)``, then one QB update per MoE
        layer from this step's router scores. Returns the step's StepStats."""
        import torch
        t0 = time.perf_counter()
        lr = lr_at(self.cfg, self.step)
        for g in self.opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        self.opt.zero_grad(set_to_none=True)
        scores: dict[int, Any] = {}
        loss = self.loss(batch, scores)
        shown = self.step + 1                 # steps are counted from 1 in the CLI's log ("step N/steps")
        value = float(loss.detach()) if self.mesh is None else self.mesh.mean_loss(float(loss.detach()))
        if not math.isfinite(value):          # nothing applied: raised before backward (on every rank of a mesh)
            raise K3RuntimeError(f"loss is {value} at step {shown}; the step was not applied (lower --lr, "
                                 "or keep --clip > 0)")
        tp = [self.params[n] for n in self.trainable]
        if self.mesh is None:
            loss.backward()
            if self.cfg.clip > 0:   # the norm is computed before clipping; non-finite grads are fixed below
                gn = float(torch.nn.utils.clip_grad_norm_(tp, self.cfg.clip))
            else:
                gn = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in tp if p.grad is not None])))
        else:
            (loss / self.mesh.world).backward()          # the adjoint collectives: d(sum_r L_r / world)
            self.mesh.sync_grads(self.params, self.trainable)
            gn = self.mesh.grad_norm(self.params, self.trainable)
            if self.cfg.clip > 0 and math.isfinite(gn):  # as clip_grad_norm_: scale by min(1, clip / (norm + 1e-6))
                coef = min(1.0, self.cfg.clip / (gn + 1e-6))
                for p in tp:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        if not math.isfinite(gn):             # an overflowing gradient must not reach the weights
            self.opt.zero_grad(set_to_none=True)
            raise K3RuntimeError(f"gradient norm is {gn} at step {shown} (loss {loss.item():.6g}); the step was "
                                 "not applied (lower --lr, or keep --clip > 0)")
        self.opt.step()
        balance = self.qb.update(scores, {lay: self.params[n] for lay, n in self.bias_names.items()})
        b = np.asarray(batch)
        st = StepStats(self.step, value, gn, lr, balance, int(b.shape[0] * (b.shape[1] - 1)),
                       time.perf_counter() - t0)
        self.history.append(st)
        self.step += 1
        return st

    def eval_loss(self, batch) -> float:
        """Cross entropy of ``batch`` without gradients or QB updates."""
        import torch
        with torch.no_grad():
            if self.mesh is None:
                return float(self.loss(batch))
            return self.mesh.mean_loss(float(self.loss(self.mesh.eval_rows(batch))))

    # ---- state for checkpoints -------------------------------------------------------------
    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """Per trainable parameter name: AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``."""
        out = {}
        for n in self.trainable:
            st = self.opt.state.get(self.params[n])
            if st:
                out[n] = {k: v for k, v in st.items()}
        return out

    def load_optimizer_state(self, state: dict[str, dict[str, Any]]) -> None:
        import torch
        for n, st in state.items():
            if n not in self.params:
                raise K3RuntimeError(f"optimizer state names unknown parameter '{n}'")
            p = self.params[n]
            self.opt.state[p] = {k: (v.to(device=p.device, dtype=p.dtype) if k != "step"
                                     else v.to(dtype=torch.float32)) for k, v in st.items()}

    def set_params(self, values: dict[str, Any]) -> None:
        """Copy ``values`` (name -> tensor/array) into the parameters in place."""
        import torch
        with torch.no_grad():
            for n, v in values.items():
                if n not in self.params:
                    raise K3RuntimeError(f"unknown parameter '{n}'")
                p = self.params[n]
                t = torch.as_tensor(v)
                if tuple(t.shape) != tuple(p.shape):
                    raise K3RuntimeError(f"parameter '{n}': shape {list(t.shape)} != {list(p.shape)}")
                p.copy_(t.to(device=p.device, dtype=p.dtype))
