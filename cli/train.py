"""``k3ir train``: next-token training of a K3-family model on byte-level text with Quantile
Balancing, a progress bar, atomic checkpoints, resume and a loss/balance plot.

    k3ir train                                   # k3-tiny, bundled text, 300 steps, into runs/k3-tiny-<date>-<time>/
    k3ir train k3-tiny --steps 300 --qb sign --out runs/sign
    k3ir train --resume runs/sign                # continue from its latest checkpoint, writing into runs/sign
    k3ir train --resume runs/sign --steps 500    # extend a run: the 200 added steps at lr * min_lr_ratio
    torchrun --nproc-per-node 2 -m k3ir.cli train --dp 2 --out runs/dp2   # one process per rank (--ep, --tp, --cp)

Under torchrun every rank trains its slice of the sharded model on its part of each global batch
(``runtime/trainer.py`` on a mesh); rank 0 prints, draws the progress bar, writes the log and the plot
and holds the run's lock; every rank writes its shard of each checkpoint (``runtime/train_shards.py``).
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path

from k3ir.errors import K3Error, K3RuntimeError

log = logging.getLogger("k3ir.train")

#: TrainConfig fields settable from the command line (flag -> field)
FLAGS = {"steps": "steps", "batch": "batch", "seq": "seq", "lr": "lr", "warmup": "warmup",
         "weight_decay": "weight_decay", "clip": "clip", "qb": "qb", "seed": "seed",
         "router_lr_scale": "router_lr_scale"}
DEFAULTS = {"steps": 300, "batch": 8, "seq": 128, "lr": 3e-3, "warmup": 20, "weight_decay": 0.1, "clip": 1.0,
            "qb": "quantile", "seed": 0, "router_lr_scale": 1.0}
PLOT_FILE = "training.png"
LOG_FILE = "training.json"
#: where a fresh run without --out goes: RUNS_DIR/<model>-<YYYYmmdd-HHMMSS> under the current directory
RUNS_DIR = "runs"


def register(sub) -> None:
    from .common import device_type, model_arg
    p = sub.add_parser("train", help="train a model on byte-level text (QB balancing, checkpoints, plot)",
                       description="Train MODEL (default k3-tiny) on byte-level tokens of --data (default: the "
                                   "bundled public-domain text). Prints loss=<value> at each logged step, writes "
                                   "checkpoints, training.json and a loss/balance plot into the run directory: --out, else "
                                   "runs/<model>-<date>-<time>/. A resumed run (--resume) keeps its hyper-parameters "
                                   "(--steps may extend it) and, without --out, writes into its own run directory.")
    model_arg(p, default="k3-tiny")
    p.add_argument("--data", help="UTF-8/any text file to train on (default: bundled public-domain text)")
    p.add_argument("--steps", type=int, help=f"optimizer steps (default {DEFAULTS['steps']}); with --resume, more "
                                             "than the run's steps extends it (the learning rate of the added steps "
                                             "is the schedule's final one, lr * 0.1)")
    p.add_argument("--out", help="run directory for checkpoints/, the plot and the log (default: the run directory "
                                 f"of --resume, else a new {RUNS_DIR}/<model>-<YYYYmmdd-HHMMSS>)")
    p.add_argument("--qb", choices=("quantile", "margin", "sign", "none"),
                   help="MoE balancing rule: quantile | margin (QB, SPEC 6), sign (DeepSeek-V3), none "
                        "(default quantile)")
    p.add_argument("--batch", type=int, help=f"sequences per step (default {DEFAULTS['batch']})")
    p.add_argument("--seq", type=int, help=f"tokens per sequence (default {DEFAULTS['seq']})")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {DEFAULTS['lr']})")
    p.add_argument("--warmup", type=int, help=f"linear warmup steps (default {DEFAULTS['warmup']})")
    p.add_argument("--weight-decay", dest="weight_decay", type=float,
                   help=f"AdamW weight decay on matrices (default {DEFAULTS['weight_decay']})")
    p.add_argument("--clip", type=float, help=f"max global gradient norm, 0 = off (default {DEFAULTS['clip']})")
    p.add_argument("--seed", type=int, help="init and data seed (default 0)")
    p.add_argument("--router-lr-scale", dest="router_lr_scale", type=float,
                   help="learning-rate multiplier of the router weights (default 1.0)")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads (default: the cores this process may use, less the 1-minute load "
                        "average, at least 1; OMP_NUM_THREADS when set). Tiny models on a busy CPU slow down many "
                        "times with more threads than idle cores: on a shared machine pass --threads 1 (or set "
                        "OMP_WAIT_POLICY=PASSIVE)")
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint (a run's --out directory or a "
                                                   "checkpoints/step-N directory); hyper-parameters come from it "
                                                   "and output goes to its run directory unless --out is given")
    p.add_argument("--log-every", type=int, help="print loss=<value> every N steps (default 10; a resumed run "
                                                 "keeps its own)")
    p.add_argument("--ckpt-every", type=int, help="checkpoint every N steps, 0 = only at the end (default 100; a "
                                                  "resumed run keeps its own)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per layer")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda; default cpu)", type=device_type)
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG plot")
    from .parallel import parallel_args
    parallel_args(p)
    p.set_defaults(func=cmd_train)


#: run settings (not hyper-parameters): a resumed run keeps its own unless a flag overrides them
RUN_DEFAULTS = {"log_every": 10, "ckpt_every": 100, "threads": None}


def default_threads() -> tuple[int, str]:
    """(torch threads, why) when ``--threads`` is not given: OMP_NUM_THREADS when set (torch read
    it), else the cores of this process's affinity mask (``os.sched_getaffinity``) capped by
    torch's default, less the 1-minute load average (other runnable work), at least 1. Measured on
    a 2-core machine (k3-tiny, 12 steps): with one busy process beside it 2 threads ran 66 tok/s,
    1 thread 620 tok/s; with no other load 2 threads ran 2,315 tok/s, 1 thread 1,492."""
    import os

    import torch
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), "OMP_NUM_THREADS"
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    cores = max(1, min(cores, torch.get_num_threads()))
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return cores, f"{cores} cores"
    n = max(1, min(cores, cores - round(load)))
    return n, f"auto: {cores} cores, load average {load:.1f}; --threads N to set"


def _config(args, meta: dict | None):
    from k3ir.runtime.trainer import TrainConfig
    if meta is not None:
        cfg = TrainConfig.from_dict(meta["config"])
        if args.steps is not None and args.steps > cfg.steps:      # extend: the schedule keeps its planned end
            cfg.schedule_steps = cfg.schedule_steps or cfg.steps
            cfg.steps = args.steps
        for flag, fld in FLAGS.items():
            v = getattr(args, flag)
            if flag == "steps" and v is not None and v < cfg.steps:
                raise K3RuntimeError(f"--steps {v} is below the checkpoint's steps={cfg.steps}; a resumed run can be "
                                     f"extended (--steps above {cfg.steps}), not shortened")
            if v is not None and v != getattr(cfg, fld):
                raise K3RuntimeError(f"--{flag.replace('_', '-')} {v} differs from the checkpoint's {fld}="
                                     f"{getattr(cfg, fld)}; a resumed run keeps its hyper-parameters")
        cfg.checkpointing = bool(args.checkpointing)
        return cfg
    for flag in FLAGS:
        v = getattr(args, flag)
        if isinstance(v, float) and not math.isfinite(v):
            raise K3RuntimeError(f"--{flag.replace('_', '-')} must be a finite number, got {v}")
    from .common import check_seed
    check_seed(args.seed)
    for flag in ("weight_decay", "clip", "router_lr_scale", "warmup"):
        v = getattr(args, flag)
        if v is not None and v < 0:
            raise K3RuntimeError(f"--{flag.replace('_', '-')} must be >= 0, got {v}")
    vals = {fld: (getattr(args, flag) if getattr(args, flag) is not None else DEFAULTS[flag])
            for flag, fld in FLAGS.items()}
    cfg = TrainConfig(**vals, checkpointing=bool(args.checkpointing))
    for k in ("steps", "batch", "seq"):
        if getattr(cfg, k) < 1:
            raise K3RuntimeError(f"--{k} must be >= 1, got {getattr(cfg, k)}")
    if cfg.lr <= 0:
        raise K3RuntimeError(f"--lr must be > 0, got {cfg.lr}")
    cfg.warmup = min(cfg.warmup, cfg.steps)
    return cfg


LOCK_FILE = ".k3ir-train.lock"
#: parameter-name prefixes of the vision pathway (not counted by ``inspect``, which reports the language model)
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
_held: list = []          # open lock files of this process's running train commands


def cmd_train(args) -> int:
    try:
        return _train(args)
    finally:
        while _held:
            f = _held.pop()
            try:                            # removed while still locked: a later run creates a fresh one
                os.unlink(f.name)
            except OSError:
                pass
            f.close()                       # closing the file releases its flock


def _lock_run(out: Path) -> None:
    """Hold an exclusive ``flock`` on ``<out>/.k3ir-train.lock`` until the command ends; raise
    K3RuntimeError naming the holder's pid when another ``k3ir train`` writes into ``out``."""
    try:
        import fcntl
    except ImportError:                     # no flock on this platform: no lock
        return
    path = out / LOCK_FILE
    for _ in range(5):                      # the holder unlinks the file when it ends: lock the file at `path`
        f = open(path, "a+")                # noqa: SIM115 (held until cmd_train returns)
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            pid = f.read().strip() or "?"
            f.close()
            raise K3RuntimeError(f"--out {out} is in use by another k3ir train (pid {pid}); wait for it to finish "
                                 "or choose another --out") from None
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()                           # locked a file its holder had just removed: take the new one
    else:
        raise K3RuntimeError(f"--out {out}: cannot take the lock file {path}")
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    _held.append(f)


class _Ranks:
    """Who prints and writes: the only process, or rank 0 of a torchrun process group (``mesh``)."""

    def __init__(self, mesh=None):
        import torch.distributed as dist
        self.mesh = mesh
        self.rank0 = mesh is None or dist.get_rank() == 0

    def say(self, *a, **k) -> None:
        if self.rank0:
            print(*a, **k)

    def same(self, value):
        """``value`` as rank 0 has it, on every rank."""
        if self.mesh is None:
            return value
        import torch.distributed as dist
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _train(args) -> int:
    import torch

    import k3ir

    from .parallel import joined_mesh, parallel_sizes
    sizes = parallel_sizes(args, "train")           # one rank of a torchrun process group, or None

    from k3ir.runtime.train_checkpoint import read_meta, select_resume_checkpoint
    from k3ir.runtime.train_data import ByteBatches, read_bytes
    from k3ir.runtime.trainer import Trainer

    from .common import load_model

    ckpt = None             # the checkpoint --resume continues from (the newest intact one of a run)
    if args.resume:
        ckpt, notes = select_resume_checkpoint(args.resume)
        for note in notes:
            if os.environ.get("RANK", "0") == "0":
                print(f"warning: {note}", file=sys.stderr, flush=True)
    meta = read_meta(ckpt) if ckpt else None
    given_threads = args.threads
    run = dict(RUN_DEFAULTS, **((meta or {}).get("run") or {}))     # logging/checkpoint cadence, threads
    for k in RUN_DEFAULTS:
        if getattr(args, k) is not None:
            run[k] = getattr(args, k)
    args.log_every, args.ckpt_every, args.threads = run["log_every"], run["ckpt_every"], run["threads"]
    if args.threads is not None and args.threads < 1:
        raise K3RuntimeError(f"--threads must be >= 1, got {args.threads}")
    why = "from --threads" if given_threads else "kept from the run" if args.threads else ""
    if not args.threads:            # recorded below, so a resumed run keeps the count (bit-exact sums)
        args.threads, why = default_threads() if sizes is None else (1, "one per rank; --threads N to set")
        run["threads"] = args.threads
    torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out is not None else run_dir(ckpt) if ckpt else None
    if out is not None:
        _refuse_other_run(out, ckpt)
    cfg = _config(args, meta)
    data_path = args.data if meta is None else (args.data or meta.get("data"))
    if meta is not None and args.data and meta.get("data") not in (None, args.data):
        raise K3RuntimeError(f"--data {args.data} differs from the checkpoint's {meta.get('data')}")
    if args.log_every < 1 or args.ckpt_every < 0:
        raise K3RuntimeError("--log-every must be >= 1 and --ckpt-every >= 0")
    if sizes is not None:
        nd = sizes["ep"] * sizes["dp"]
        if cfg.batch % nd or cfg.seq % sizes["cp"]:
            raise K3RuntimeError(f"--batch {cfg.batch} must divide by ep*dp={nd} and --seq {cfg.seq} by cp={sizes['cp']} "
                                 "(each data rank trains on its rows, each cp rank on its segment)")
    module = load_model(args)
    ranks = _Ranks()
    if sizes is not None:
        from k3ir.runtime.distributed import init_mesh
        device = args.device
        if str(device).startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
        joined_mesh()
        ranks = _Ranks(init_mesh(**sizes, device=args.device))
    if out is None:
        out = Path(ranks.same(str(new_run_dir(Path(RUNS_DIR), module.name))))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise K3RuntimeError(f"--out {out}: cannot create the directory ({e.strerror or e})") from None
    if ranks.rank0:
        _lock_run(out)
    _refuse_other_run(out, ckpt)           # again under the lock: a run may have started meanwhile
    data = ByteBatches(read_bytes(data_path), cfg.batch, cfg.seq, cfg.seed)
    if ranks.mesh is None:
        exe = k3ir.compile(module, target="torch", dtype="float32", device=args.device)
        tr = Trainer(exe, cfg)
    else:
        from k3ir.runtime.distributed import shard
        from k3ir.runtime.params import init_params
        params = getattr(module, "weights", None)     # a checkpoint's lazy weights: each rank reads its blocks
        exe = k3ir.compile(shard(module, ranks.mesh, capacity=args.ep_capacity), target="torch", dtype="float32",
                           device=device, mesh=ranks.mesh)
        tr = Trainer(exe, cfg, params=params if params is not None else init_params(module, cfg.seed))
    try:
        return _run(args, ranks, tr, cfg, ckpt, out, module, data, data_path, run, why)
    finally:
        if ranks.mesh is not None:
            import torch.distributed as dist
            if sys.exc_info()[0] is None:
                dist.barrier()             # leave together: gloo torn down under a peer's collective aborts
            dist.destroy_process_group()


def _run(args, ranks: _Ranks, tr, cfg, ckpt, out: Path, module, data, data_path, run: dict, why: str) -> int:
    """The training loop of ``_train`` (every rank of a mesh runs it; rank 0 prints and writes)."""
    import torch
    from k3ir.runtime.train_checkpoint import save_checkpoint
    from k3ir.runtime.train_shards import load_training_checkpoint, save_sharded_checkpoint
    print = ranks.say
    save = save_checkpoint if ranks.mesh is None else save_sharded_checkpoint
    if ckpt:
        load_training_checkpoint(ckpt, tr)          # a sharded one under another layout is put together and cut
        if tr.step >= cfg.steps:         # nothing to run: say so instead of a summary of no steps
            print(f"{args.resume}: the run is already complete ({tr.step}/{cfg.steps} steps); its summary is in "
                  f"{out / LOG_FILE} (--steps N above {cfg.steps} extends it)", flush=True)
            return 0
    extra = {"data": data_path, "model_arg": args.model, "run": run}
    nlayers = len(tr.layers)
    shapes = {n: tr.mesh.full_shapes[n] if tr.mesh else tuple(p.shape) for n, p in tr.params.items()}
    n_all = sum(math.prod(s) for s in shapes.values())
    n_vis = sum(math.prod(s) for n, s in shapes.items() if n.startswith(VISION_PREFIXES))
    split = f" ({n_all - n_vis:,} language model + {n_vis:,} vision tower/projector)" if n_vis else ""
    print(f"run directory: {out} (checkpoints/, {LOG_FILE}, {PLOT_FILE})", flush=True)
    if cfg.schedule_steps and cfg.steps > cfg.schedule_steps:
        print(f"extended run: steps {cfg.schedule_steps + 1}-{cfg.steps} at the schedule's final learning rate "
              f"{cfg.lr * cfg.min_lr_ratio:.2e} (lr x min_lr_ratio)", flush=True)
    print(f"training {module.name}: {n_all:,} parameters{split}, "
          f"{nlayers} MoE layers, qb={cfg.qb}, batch {cfg.batch} x seq {cfg.seq}, steps {tr.step}->{cfg.steps}, "
          f"torch threads {torch.get_num_threads()} ({why})"
          + (f", mesh {' '.join(f'{a}={n}' for a, n in tr.mesh.sizes.items())} on "
             f"{tr.mesh.world} ranks" if tr.mesh else ""), flush=True)
    t_start = time.perf_counter()
    toks = 0
    saved = [(tr.step, args.resume)] if args.resume else []      # (step, directory) of this run's checkpoints
    try:
        with (_progress(cfg.steps, tr.step) if ranks.rank0 else _no_progress()) as (prog, task):
            while tr.step < cfg.steps:
                st = tr.train_step(data.batch_at(tr.step))
                toks += st.tokens
                tps = toks / max(time.perf_counter() - t_start, 1e-9)
                bal = st.worst_balance
                prog.update(task, completed=tr.step, loss=st.loss, tps=tps, bal=bal)
                if tr.step % args.log_every == 0 or tr.step == cfg.steps or tr.step == 1:
                    print(f"step {tr.step}/{cfg.steps} loss={st.loss:.6f} lr={st.lr:.2e} "
                          f"grad_norm={st.grad_norm:.3f} tok/s={tps:.0f} max/mean_load={bal:.3f}", flush=True)
                if (args.ckpt_every and tr.step % args.ckpt_every == 0) or tr.step == cfg.steps:
                    save(out, tr, extra)
                    saved.append((tr.step, out))
    except KeyboardInterrupt:              # main prints "k3ir: interrupted: <this>" and exits 130
        raise KeyboardInterrupt(interrupted_text(tr.step, cfg.steps, args.ckpt_every, saved)) from None
    ev = tr.eval_loss(data.eval_batch())
    if not ranks.rank0:
        return 0
    summary = _summary(tr, ev, time.perf_counter() - t_start)
    (out / LOG_FILE).write_text(json.dumps(summary, indent=1))
    runs = (f"k3ir generate {out} runs it" if tr.mesh is None else
            f"sharded: one file per rank; torchrun ... train --resume {out} with the same flags continues it")
    print(f"wrote {out / LOG_FILE} and {out / 'checkpoints'} (latest: step-{tr.step:06d}; {runs})", flush=True)
    n10, n20 = min(len(tr.history), 10), min(len(tr.history), 20)
    mean10 = f"mean of last {n10} steps: {summary['final_loss_10']:.4f}; " if n10 > 1 else ""
    over20 = f"mean of last {n20} steps" if n20 > 1 else "last step"
    print(f"done: final loss={summary['final_loss']:.6f} ({mean10}ln(256)={math.log(256):.4f}), "
          f"held-out loss={ev:.4f}, worst-layer max/mean load ({over20}) {summary['worst_balance_20']:.3f}", flush=True)
    if not args.no_plot:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:   # the run itself succeeded: say so, exit 0
            print("plot: skipped (needs matplotlib: pip install 'k3ir[train]'; or pass --no-plot)", flush=True)
            return 0
        path = write_plot(tr, out / PLOT_FILE, title=f"{module.name} qb={cfg.qb}")
        print(f"plot: {path}", flush=True)
    return 0


def new_run_dir(root: Path, model: str) -> Path:
    """A run directory for a fresh run without ``--out``: ``root/<model>-<YYYYmmdd-HHMMSS>`` (local time;
    ``-2``, ``-3``... appended when that exists), the model name reduced to letters, digits, ``.``, ``_``
    and ``-``. Not created here."""
    import re
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("._") or "model"
    base = root / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def interrupted_text(done: int, steps: int, ckpt_every: int, saved: list) -> str:
    """What a Ctrl-C during training leaves: ``done`` steps finished, the checkpoints ``saved``
    as (step, run or checkpoint directory), oldest first."""
    head = f"at step {done + 1}/{steps} ({done} steps done)"
    if not saved:
        first = min(ckpt_every, steps) if ckpt_every else steps
        return f"{head}; no checkpoint written (the first is at step {first}; --ckpt-every sets the interval)"
    step, where = saved[-1]
    return f"{head}; the last checkpoint is step {step}: continue with k3ir train --resume {where}"


def _refuse_other_run(out: Path, resume: str | Path | None) -> None:
    """Raise K3RuntimeError when ``out`` already holds a training run (``checkpoints/latest`` or
    ``checkpoints/step-*``) that is not the one being resumed: a fresh run there would mix its
    checkpoints, ``latest`` and training.json with the old run's."""
    from k3ir.runtime.train_checkpoint import LATEST, read_meta
    ck = out / "checkpoints"
    if not ck.is_dir() or not ((ck / LATEST).exists() or any(ck.glob("step-*"))):
        return
    if resume is not None and run_dir(resume).resolve() == out.resolve():
        return
    try:
        meta = read_meta(out)
        what = f"{meta.get('model', 'a model')} at step {meta.get('step')}/{(meta.get('config') or {}).get('steps')}"
    except K3Error:
        what = f"checkpoints in {ck}"
    hint = f"pass --resume {out} to continue it" if resume is None else f"--resume {resume} belongs to another run"
    raise K3RuntimeError(f"--out {out} already holds a training run ({what}); {hint}, or choose another --out")


def run_dir(resume: str | Path) -> Path:
    """The run directory (the ``--out`` that wrote it) of the checkpoint ``resume`` names:
    ``<run>/checkpoints/step-N`` -> ``<run>``; a checkpoint outside a ``checkpoints/`` folder ->
    its own directory."""
    from k3ir.runtime.train_checkpoint import resolve_checkpoint
    ck = resolve_checkpoint(resume).resolve()
    return ck.parent.parent if ck.parent.name == "checkpoints" else ck


def _summary(tr, eval_loss: float, seconds: float) -> dict:
    h = tr.history
    last = h[-10:]
    last20 = h[-20:]
    return {"steps": tr.step, "qb": tr.cfg.qb, "config": tr.cfg.to_dict(), "eval_loss": eval_loss,
            "final_loss": h[-1].loss if h else float("nan"),
            "final_loss_10": sum(s.loss for s in last) / max(len(last), 1),
            "worst_balance_20": sum(s.worst_balance for s in last20) / max(len(last20), 1),
            "per_layer_balance_20": {str(lay.layer): sum(s.balance.get(lay.layer, 1.0) for s in last20)
                                     / max(len(last20), 1) for lay in tr.layers},
            "seconds_this_process": seconds,
            "loss": [s.loss for s in h], "worst_balance": [s.worst_balance for s in h]}


class _no_progress:
    """The progress bar's place on ranks other than 0."""

    class _Bar:
        def update(self, *a, **k) -> None:
            pass

    def __enter__(self):
        return self._Bar(), None

    def __exit__(self, *exc):
        return False


class _progress:
    """A rich progress bar on stderr (loss, tokens/s, worst max/mean load)."""

    def __init__(self, total: int, done: int):
        self.total, self.done = total, done

    def __enter__(self):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        self.prog = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                             TextColumn("max/mean load {task.fields[bal]:.2f}"), TimeRemainingColumn(),
                             console=Console(file=sys.stderr), transient=False)
        self.prog.__enter__()
        task = self.prog.add_task("train", total=self.total, completed=self.done, loss=float("nan"), tps=0.0,
                                  bal=float("nan"))
        return self.prog, task

    def __exit__(self, *exc):
        return self.prog.__exit__(*exc)


def write_plot(tr, path: Path, title: str = "") -> Path:
    """PNG with the loss per step (and ln 256) and the per-step max-load / mean-load of the worst
    MoE layer and the mean over layers. Needs matplotlib (``pip install k3ir[train]``)."""
    try:
        import matplotlib
    except ImportError:
        raise K3RuntimeError("the loss plot needs matplotlib (pip install 'k3ir[train]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    h = tr.history
    steps = [s.step + 1 for s in h]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(steps, [s.loss for s in h], lw=1, label="train loss")
    a1.axhline(math.log(256), color="gray", ls="--", lw=0.8, label="ln 256")
    a1.set_xlabel("step")
    a1.set_ylabel("cross entropy (nats/byte)")
    a1.legend()
    a1.set_title(title or "loss")
    if h and h[0].balance:
        a2.plot(steps, [s.worst_balance for s in h], lw=1, label="worst layer")
        a2.plot(steps, [sum(s.balance.values()) / len(s.balance) for s in h], lw=1, label="mean over layers")
    a2.axhline(1.0, color="gray", ls="--", lw=0.8)
    a2.set_xlabel("step")
    a2.set_ylabel("max load / mean load")
    a2.set_title(f"MoE balance (qb={tr.cfg.qb})")
    a2.legend()
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    from .app import main as cli_main
    return cli_main(["train", *(argv or [])])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
