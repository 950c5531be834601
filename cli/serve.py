"""``k3ir serve MODEL [--host 127.0.0.1] [--port N]``, and the engine setup ``k3ir generate`` shares
(``k3ir.cli.generate``)."""
from __future__ import annotations

import argparse
import errno
import os
import socket
import sys

from .common import UsageError, check_seed, device_type, load_model, model_arg, random_weights_note, target_type


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="torch", type=target_type, help="backend target (default torch)")
    p.add_argument("--device", default="cpu", help="device for the torch/triton targets (default cpu)", type=device_type)
    p.add_argument("--dtype", default=None, help="compute dtype (default: the target's, float32; float64 for "
                                                 "reference, which computes only in float64)")
    p.add_argument("--block-size", type=int, default=512, help="pool block in tokens, a multiple of 64 (default 512)")
    p.add_argument("--num-blocks", type=int, default=None, help="pool blocks (default: max-batch x 2048 tokens)")
    p.add_argument("--max-batch", type=int, default=32, help="running requests per step (default 32)")
    p.add_argument("--init-seed", type=int, default=0, help="random-init seed when the model has no weights")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; on a shared machine pass --threads 1)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")


#: the environment variable ``k3ir serve`` reads its API key from when ``--api-key`` is not given
API_KEY_ENV = "K3IR_API_KEY"
#: uvicorn's log levels
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_SIZE_FLAGS = {"block_size": "--block-size", "num_blocks": "--num-blocks", "max_batch": "--max-batch"}


def _setup(args):
    from k3ir.runtime.engine import build_engine, engine_size_problem
    from k3ir.runtime.tokenizer import load_tokenizer

    from .compile import check_dtype
    check_seed(args.init_seed, "--init-seed")
    check_seed(getattr(args, "seed", None))
    why = engine_size_problem(args.block_size, args.num_blocks, args.max_batch, names=_SIZE_FLAGS)
    if why:                                              # before the model loads and compiles
        raise UsageError(why)
    args.dtype = check_dtype(args.target, args.dtype)    # a bad --dtype fails before the model loads
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        import torch
        torch.set_num_threads(args.threads)
    module = load_model(args)
    tok = load_tokenizer(args.model, module)
    engine = build_engine(module, target=args.target, dtype=args.dtype, device=args.device, seed=args.init_seed,
                          block_size=args.block_size, num_blocks=args.num_blocks, max_batch=args.max_batch,
                          host_cache_bytes=int(getattr(args, "host_cache_mib", 0) * 2**20))
    return module, tok, engine


def check_port(host: str, port: int) -> None:
    """UsageError when ``host:port`` cannot be bound (``port N is in use (...)`` for EADDRINUSE),
    checked with a probe socket set up as uvicorn sets its own (SO_REUSEADDR), so a port in
    TIME_WAIT is not reported; port 0 (any free port) is not checked."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UsageError(f"port {port} is in use ({host}:{port}: {e.strerror}; "
                                 "pick another with --port)") from None
            raise UsageError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None


def cmd_serve(args) -> int:
    from k3ir.runtime.server import ServerLimits, create_app, serve
    if args.log_level not in LOG_LEVELS:              # checked here, not by argparse: one line, not the usage
        raise UsageError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {args.log_level!r}")
    if args.served_name is not None and not args.served_name.strip():
        raise UsageError("--served-name must not be empty (leave it out to serve under the model's name)")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    for flag in ("max_request_bytes", "max_prompt_tokens", "max_output_tokens", "max_concurrent", "max_stop_strings",
                 "max_stop_chars"):
        v = getattr(args, flag)
        if v is not None and v < 1:                  # 0 would start a server that refuses every request
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if not 0 <= args.host_cache_mib < float("inf"):
        raise UsageError(f"--host-cache-mib must be a finite number >= 0, got {args.host_cache_mib}")
    for flag in ("body_timeout", "drain_timeout"):
        v = getattr(args, flag)
        if not 0 < v < float("inf"):
            raise UsageError(f"--{flag.replace('_', '-')} must be a finite number of seconds > 0, got {v}")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)   # read once, here
    if api_key is not None and not api_key.strip():
        source = "--api-key" if args.api_key is not None else API_KEY_ENV
        raise UsageError(f"{source} must not be empty (leave it out to serve without an API key)")
    limits = ServerLimits(max_request_bytes=args.max_request_bytes, max_prompt_tokens=args.max_prompt_tokens,
                          max_output_tokens=args.max_output_tokens, max_concurrent=args.max_concurrent,
                          max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars,
                          body_timeout_s=args.body_timeout, drain_timeout_s=args.drain_timeout)
    from .parallel import parallel_sizes
    sizes = parallel_sizes(args, "serve")            # one rank of a torchrun process group, or None
    if sizes is not None:
        return _serve_on_mesh(args, sizes, limits, api_key)
    check_port(args.host, args.port)                 # before loading the model: uvicorn's bind error is a raw log
    module, tok, engine = _setup(args)
    note = random_weights_note(module, args.model, args.init_seed)     # as generate says it, before the server starts
    if note:
        print(note, file=sys.stderr, flush=True)
    app = create_app(engine, tok, args.served_name or module.name, limits, api_key=api_key)
    serve(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _serve_on_mesh(args, sizes: dict[str, int], limits, api_key: str | None) -> int:
    """``k3ir serve`` on this rank of the mesh ``sizes`` (runtime/serve_mesh.py): rank 0 serves HTTP and
    broadcasts each engine step's admissions and cancellations, the others replay them on their engines.
    Every rank ends with a barrier and ``destroy_process_group``. UsageError for a target without
    collectives."""
    import torch
    import torch.distributed as dist
    from k3ir.runtime.distributed import init_mesh
    from k3ir.runtime.engine import engine_size_problem
    from k3ir.runtime.serve_mesh import MeshEngineThread, build_mesh_engine, follow
    from k3ir.runtime.server import create_app, serve
    from k3ir.runtime.tokenizer import load_tokenizer

    from .compile import check_dtype
    from .parallel import joined_mesh
    if args.target not in ("torch", "triton"):
        raise UsageError(f"--target {args.target} has no collectives; --ep/--cp/--tp/--dp run on torch or triton")
    check_seed(args.init_seed, "--init-seed")
    why = engine_size_problem(args.block_size, args.num_blocks, args.max_batch, names=_SIZE_FLAGS)
    if why:
        raise UsageError(why)
    args.dtype = check_dtype(args.target, args.dtype)
    threads = 1 if args.threads is None else args.threads
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    rank0 = os.environ.get("RANK", "0") == "0"
    if rank0:
        check_port(args.host, args.port)
    torch.set_num_threads(threads)
    module = load_model(args)
    note = random_weights_note(module, args.model, args.init_seed)
    if note and rank0:
        print(note, file=sys.stderr, flush=True)
    tok = load_tokenizer(args.model, module)
    joined_mesh()
    mesh = init_mesh(**sizes, device=args.device)
    ok = False
    try:
        # no host tier: the engines of all ranks must make the same batches, step for step
        engine = build_mesh_engine(module, mesh, target=args.target, dtype=args.dtype, device=args.device,
                                   seed=args.init_seed, capacity=args.ep_capacity, block_size=args.block_size,
                                   num_blocks=args.num_blocks, max_batch=args.max_batch)
        if dist.get_rank() == 0:
            app = create_app(engine, tok, args.served_name or module.name, limits, api_key=api_key,
                             runner=MeshEngineThread(engine))
            serve(app, host=args.host, port=args.port, log_level=args.log_level)
        else:
            follow(engine)
        ok = True
    finally:
        if ok:
            dist.barrier()
        dist.destroy_process_group()
    return 0


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    model_arg(p, default="k3-tiny")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-name", help="model id in the API (default: the model's name)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest request body in bytes, chunked too (default 1 MiB; more gets 413)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds from a request's headers until its whole body must have arrived (default 30; "
                        "later gets 408 and the connection closed)")
    p.add_argument("--api-key", default=None,
                   help=f"bearer token every request but GET /health must send (Authorization: Bearer KEY; else 401); "
                        f"default: the environment variable {API_KEY_ENV}, read once at start (it keeps the key out "
                        "of the process list); neither: no key")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM or Ctrl-C, seconds that requests in flight get to finish before they are "
                        "cancelled; no new connections are taken meanwhile (default 30)")
    p.add_argument("--host-cache-mib", type=float, default=1024.0,
                   help="host-memory tier of the prefix cache in MiB: cached blocks evicted from the pool and the "
                        "tails of finished requests wait there for a hit (default 1024; 0: none)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt in tokens (default: the model's max_position_embeddings bounded by the "
                        "pool's capacity, --num-blocks x --block-size less one)")
    p.add_argument("--max-output-tokens", type=int, default=1024,
                   help="largest max_tokens a request may ask for (default 1024; more gets 400)")
    p.add_argument("--max-concurrent", type=int, default=64, help="requests in flight (default 64; more get 429)")
    p.add_argument("--max-stop-strings", type=int, default=16, help="stop strings per request (default 16)")
    p.add_argument("--max-stop-chars", type=int, default=4096,
                   help="characters in all stop strings of a request (default 4096)")
    p.add_argument("--log-level", default="info", type=str.lower, metavar="{" + ",".join(LOG_LEVELS) + "}",
                   help="uvicorn log level (default info)")
    _engine_args(p)
    from .parallel import parallel_args
    parallel_args(p)
    p.set_defaults(func=cmd_serve)
