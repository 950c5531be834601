"""``--ep N --cp N --tp N --dp N`` for the CLI: one process per rank of an ``ep x cp x tp x dp`` mesh,
started by ``torchrun`` (docs/distributed.md), and ``k3ir generate`` on that mesh.

    torchrun --nproc-per-node 2 $(which k3ir) generate k3-tiny --prompt "Kimi " --max-tokens 12 --ep 2

Every rank loads the model, shards it (``runtime/distributed.py``) and runs the same greedy or sampled
loop on the gathered logits, so every rank picks the same tokens; only rank 0 writes to stdout. One
prompt is one row: the batch is that row repeated ``ep*dp`` times (each data rank runs one copy; row 0 is
printed), and under ``cp`` the prompt's longest prefix whose length divides by ``cp`` is the sharded
prefill, the remaining ``T mod cp`` tokens go through decode steps (replicated over cp), so no padding
enters the state.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .common import UsageError

PARALLEL_FLAGS = ("ep", "cp", "tp", "dp")

#: set when this process joined a torchrun process group (``joined_mesh``): ``main`` then ends it with ``os._exit``
_JOINED: list[bool] = []


def joined_mesh() -> None:
    """Record that this process is a rank of a process group (``leave_if_mesh_rank`` ends it)."""
    _JOINED.append(True)


def leave_if_mesh_rank(rc: int) -> None:
    """End a process that was a rank of a process group with ``os._exit(rc)`` once stdout and stderr are
    flushed; return when it was not. Why: after ``destroy_process_group`` c10d and gloo objects still held by
    C++ statics are destroyed by the interpreter's teardown, and under load one of gloo's threads is still
    joinable then: ``std::terminate`` ("terminate called without an active exception", SIGABRT, exit code
    -6) after the command's output was complete (faulthandler shows no Python frame: it is the teardown,
    not a collective). Skipping the teardown skips those destructors; every file the commands write is
    closed before this point."""
    if not _JOINED:
        return
    import logging
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):          # a reader gone away (| head) or a closed stream
            pass
    logging.shutdown()
    os._exit(rc)


def parallel_args(p: argparse.ArgumentParser) -> None:
    """Add ``--ep --cp --tp --dp`` (each an int, default 1) and ``--ep-capacity`` (default 0) to ``p``."""
    g = p.add_argument_group("parallelism (start with torchrun, one process per rank; docs/distributed.md)")
    for a, what in (("ep", "expert"), ("cp", "KDA context"), ("tp", "tensor"), ("dp", "data")):
        g.add_argument(f"--{a}", type=int, default=1, help=f"{what}-parallel ranks (default 1)")
    g.add_argument("--ep-capacity", type=int, default=0, metavar="C",
                   help="EP rows per expert per source rank (the shard pass's static capacity; rows past it are "
                        "dropped, docs/distributed.md); default 0: every row of the batch, lossless. k3ir plan "
                        "assumes ceil(tokens x top-k / experts)")


def parallel_sizes(args: Any, command: str) -> dict[str, int] | None:
    """The mesh sizes ``{ep, cp, tp, dp}`` when this process is one rank of several (``WORLD_SIZE`` > 1
    in the environment, as ``torchrun`` sets it), else None (one process, every size 1). Raises
    UsageError for a size below 1, a size above 1 without torchrun (the line shows the command to start
    it with), or sizes whose product differs from the world size."""
    sizes = {a: getattr(args, a, 1) for a in PARALLEL_FLAGS}
    for a, n in sizes.items():
        if n < 1:
            raise UsageError(f"--{a} must be >= 1, got {n}")
    if getattr(args, "ep_capacity", 0) < 0:
        raise UsageError(f"--ep-capacity must be >= 0 (0: every row, lossless), got {args.ep_capacity}")
    want = sizes["ep"] * sizes["cp"] * sizes["tp"] * sizes["dp"]
    world = os.environ.get("WORLD_SIZE")
    flags = " ".join(f"--{a} {n}" for a, n in sizes.items() if n > 1)
    if world is None:
        if want > 1:
            raise UsageError(f"{flags} needs one process per rank: start it with torchrun --nproc-per-node {want} "
                             f"$(which k3ir) {command} ... {flags}")
        return None
    try:
        world_n = int(world)
    except ValueError:
        raise UsageError(f"WORLD_SIZE={world!r} in the environment is not an integer") from None
    if world_n != want:
        raise UsageError(f"ep*cp*tp*dp = {want} ({flags or 'no parallel flags'}) but torchrun started {world_n} "
                         f"processes (WORLD_SIZE={world_n}); they must be equal")
    return sizes if world_n > 1 else None


class _Rank0Out:
    """stdout of rank 0 (the other ranks write nothing). When the reader goes away (EPIPE, ``| head``)
    writing stops quietly but the rank keeps stepping: its peers wait on its collectives."""

    def __init__(self, rank0: bool):
        self.on = rank0

    def write(self, text: str) -> None:
        if not self.on:
            return
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            from .common import quiet_stdout
            self.on = False
            quiet_stdout()


def generate_on_mesh(args: Any, sizes: dict[str, int], show) -> int:
    """``k3ir generate`` on this rank of the mesh ``sizes`` (the process group from torchrun's
    environment: gloo for ``--device cpu``, NCCL for ``cuda``). ``show`` escapes text for the terminal.
    Rank 0 writes the prompt and the generated text as the one-process command does; every rank ends with
    a barrier and ``destroy_process_group``. Raises UsageError for a target without collectives or a
    prompt shorter than ``cp`` tokens, K3RuntimeError for non-finite logits."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from k3ir.runtime.distributed import DistributedSession, init_mesh, shard
    from k3ir.runtime.params import init_params
    from k3ir.runtime.sampler import SamplingParams, make_generator, sample
    from k3ir.runtime.tokenizer import IncrementalDecoder, load_tokenizer

    import k3ir
    from k3ir.errors import K3RuntimeError

    from .common import check_seed, load_model, random_weights_note
    from .compile import check_dtype

    if args.target not in ("torch", "triton"):
        raise UsageError(f"--target {args.target} has no collectives; --ep/--cp/--tp/--dp run on torch or triton")
    check_seed(args.init_seed, "--init-seed")
    check_seed(args.seed)
    args.dtype = check_dtype(args.target, args.dtype)
    threads = 1 if args.threads is None else args.threads
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    device = args.device
    if str(device).startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    module = load_model(args)
    tok = load_tokenizer(args.model, module)
    ids = tok.encode(args.prompt)
    if len(ids) < sizes["cp"]:
        raise UsageError(f"the prompt is {len(ids)} tokens, fewer than --cp {sizes['cp']}; give a longer --prompt")
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed, stop_token_ids=list(tok.stop_ids))
    torch.set_num_threads(threads)                   # ranks share the cores: 1 each unless --threads
    joined_mesh()
    mesh = init_mesh(**sizes, device=args.device)
    rank0 = dist.get_rank() == 0
    printer = _Rank0Out(rank0)
    ok = False
    try:
        note = random_weights_note(module, args.model, args.init_seed)
        if note and rank0:
            print(note, file=sys.stderr, flush=True)
        params = getattr(module, "weights", None)     # a checkpoint's lazy weights: each rank reads its blocks
        if params is None:
            params = init_params(module, args.init_seed)
        exe = k3ir.compile(shard(module, mesh, capacity=args.ep_capacity), target=args.target, dtype=args.dtype,
                           device=device, mesh=mesh)
        sess = DistributedSession(exe, params)
        rows = np.tile(np.asarray(ids, dtype=np.int64)[None], (sizes["ep"] * sizes["dp"], 1))
        head = len(ids) - len(ids) % sizes["cp"]
        logits, state = sess.prefill(rows[:, :head])
        for pos in range(head, len(ids)):            # the tail shorter than cp: replicated decode steps
            logits, state = sess.decode(rows[:, pos:pos + 1], state)
        eos = module.attrs.get("eos_token_id")
        stop = set(sp.stop_token_ids) | ({eos} if eos is not None else set())
        gen, out, finish = make_generator(sp.seed), [], "length"
        dec = IncrementalDecoder(tok)
        printer.write(show(args.prompt))
        while len(out) < sp.max_tokens:
            row = logits[0, -1]
            top = float(row.detach().to("cpu", torch.float64).max())
            if not np.isfinite(top):
                raise K3RuntimeError(f"generation failed: the model's logits are not finite ({top}) at generation "
                                     f"step {len(out) + 1}")
            t = sample(row, sp, gen)
            out.append(t)
            printer.write(show(dec.push(t)))
            if t in stop:
                finish = "stop"
                break
            if len(out) < sp.max_tokens:
                logits, state = sess.decode(np.full((rows.shape[0], 1), t, dtype=np.int64), state)
        printer.write(show(dec.flush()) + "\n")
        if args.show_ids:
            printer.write(f"token ids: {out}\nfinish: {finish}\n")
        ok = True
    finally:
        if ok:
            dist.barrier()                           # leave together: gloo torn down under a peer's collective aborts
        dist.destroy_process_group()
    return 0


def run_on_mesh(args: Any, sizes: dict[str, int], print_report) -> int:
    """``k3ir run`` on this rank of the mesh ``sizes``: rank 0 builds and summarises ``args.model`` (step 1);
    every rank compiles the sharded ``args.tiny`` with the same random init, generates greedily from the
    prompt on the gathered logits and checks forward against prefill (``DistributedSession``); rank 0
    prints. The one prompt is a batch of ``ep*dp`` copies of itself (row 0 is shown); under cp the prompt's
    last ``T mod cp`` tokens go through decode steps and the check covers the longest prefix whose length
    divides by cp (``print_report``: the summary table of ``k3ir inspect``). Raises UsageError for a target without collectives, a bad count or a prompt shorter than
    ``cp`` tokens."""
    import time

    import numpy as np
    import torch
    import torch.distributed as dist
    from k3ir.runtime.distributed import DistributedSession, init_mesh, shard
    from k3ir.runtime.params import init_params

    import k3ir
    from k3ir.accounting import report

    from .common import check_prompt, check_seed, console, parse_overrides, print_step

    if args.target not in ("torch", "triton"):
        raise UsageError(f"--target {args.target} has no collectives; --ep/--cp/--tp/--dp run on torch or triton")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_seed(args.seed)
    prompt = check_prompt(args.prompt).encode("utf-8")
    tiny = k3ir.load(args.tiny)
    row = [tiny.attrs.get("bos_token_id", 256)] + list(prompt)
    if len(row) < sizes["cp"]:
        raise UsageError(f"the prompt is {len(row)} tokens, fewer than --cp {sizes['cp']}; give a longer --prompt")
    torch.set_num_threads(1)                         # ranks share the cores
    joined_mesh()
    mesh = init_mesh(**sizes, device=args.device)
    rank0 = dist.get_rank() == 0
    con = console()
    ok = False
    try:
        if rank0:                                    # the others wait for it at their first collective
            t0 = time.perf_counter()
            big = k3ir.load(args.model, overrides=parse_overrides(args.overrides))
            k3ir.verify_module(big)
            n_ops = sum(len(f.ops) for f in big.functions.values())
            print_step(con, "1. built", f" {args.model}: {len(big.params):,} parameter tensors, "
                       f"{n_ops:,} ops in {', '.join('@' + f for f in big.functions)} "
                       f"({time.perf_counter() - t0:.2f} s, verified)")
            print_report(report(big), con)
        t1 = time.perf_counter()
        layout = " ".join(f"{a}={n}" for a, n in sizes.items())
        exe = k3ir.compile(shard(tiny, mesh, capacity=args.ep_capacity), target=args.target, device=args.device,
                           mesh=mesh)
        sess = DistributedSession(exe, init_params(tiny, args.seed))
        if rank0:
            print_step(con, "2. compiled", f" {args.tiny} sharded {layout} for target '{exe.target}' on "
                       f"{dist.get_world_size()} ranks (random init seed {args.seed}) in {time.perf_counter() - t1:.2f} s")
        ids = np.tile(np.asarray(row, dtype=np.int64)[None], (sizes["ep"] * sizes["dp"], 1))
        t2 = time.perf_counter()
        out = sess.generate(ids, max_new_tokens=args.max_new_tokens, temperature=0.0)
        dt = time.perf_counter() - t2
        new = out[0, ids.shape[1]:].tolist()
        n = (out.shape[1] - 1) - (out.shape[1] - 1) % sizes["cp"]
        full = sess.forward(out[:, :n].numpy())
        step = float((full[0, -1] - sess.prefill(out[:, :n].numpy())[0][0, -1]).abs().max())
        if rank0:
            text = bytes(t for t in new if t < 256).decode("utf-8", errors="replace")
            print_step(con, "3. generated", f" {len(new)} tokens greedily after a {ids.shape[1]}-token prompt "
                       f"{args.prompt!r} in {dt:.2f} s ({len(new) / dt:.1f} tokens/s; {dist.get_world_size()} ranks)")
            con.print(f"   token ids: {new}")
            con.print(f"   as bytes:  {text!r}  (random weights: the text is noise; the path is real)")
            print_step(con, "4. checked", f" forward over {n} tokens vs prefill: max |diff| {step:.2e}")
        ok = True
    finally:
        if ok:
            dist.barrier()                           # leave together: gloo torn down under a peer's collective aborts
        dist.destroy_process_group()
    return 0
