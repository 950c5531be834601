"""The GPU verification of every speed claim (issue 22), as device calls of under 10 minutes, in the issue's order.

Each call is a list of steps: first every step's ``--warm`` run in parallel processes (compiles and fla's autotuning
into the on-disk caches; nothing timed, nothing written), then the timed steps one at a time on a quiet GPU, each
under its own timeout and a global ``--budget``, each writing its JSON into ``--out`` (a step that no longer fits
is skipped and listed). Every benchmark measures its baselines and ceilings in the same process (see the scripts).

Here (the CPU machine)::

    python bench/gpu_verification.py plan              # the calls, their steps and the device commands
    python bench/gpu_verification.py prepare           # .gpuhead/ = `git archive HEAD` + COMMIT (what is measured)
    python bench/gpu_verification.py collect DIR       # copy a call's JSON into bench/results/<benchmark>/
    TRITON_INTERPRET=1 python bench/gpu_verification.py run --call 1 --tiny --out /tmp/gv   # the runner on the CPU

On the device (the command ``plan`` prints; from ``.gpuhead``)::

    python3 bench/gpu_verification.py run --call N --out $OUT [--steps a,b] [--budget 540]

Calls: 1 KDA forward (fla autotunes ~100 s per head count: the warm phase runs the four shapes in parallel) and the
MoE layer bf16; 2 Kimi Linear 6.6B decode B1 (with call 1, the minimum that makes the current table honest), KDA
decode H32/H96, MXFP4 MoE with and without router/dispatch/latent projections; 3 KDA forward+backward (both memory
policies, fp32-reference gradients); 4 Kimi Linear 6.6B vs transformers; 5 the gpu-marked tests; 6 serving under
load (``serve-load``); 7 the TVM CUDA artifacts with the TVM runtime alone (issue item 4: ``tvm_cuda_artifact.py``,
after ``python bench/tvm_cuda_artifact.py prepare`` here; carries ``.gpuhead`` and ``.tvmgpu``, not ``.whl``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = sys.executable


def _b(script, *args):
    return [PY, os.path.join(HERE, script), *args]


#: the TVM CUDA artifacts of call 7 (``tvm_cuda_artifact.py prepare`` builds them into ``.tvmgpu/``)
TVM_ARTIFACTS = ("kimi-linear-tiny", "k3-tiny-mxfp4")
#: step name -> (timed command, extra args under --tiny, warm commands (run in parallel first), timeout s, JSON name
#: under --out or None). ``{out}`` is replaced by the step's JSON path.
STEPS = {
    "kda_forward": (_b("bench_kda.py", "--compare", "--out", "{out}"), ["--tiny"],
                    [_b("bench_kda.py", "--compare", "--warm", "--shapes", s) for s in
                     ("1,32768,32,128", "8,4096,32,128", "1,8192,96,128", "1,8192,64,128")], 300, "kda_forward.json"),
    "moe_layer_bf16": (_b("bench_moe_layer.py", "--parts", "bf16", "--out", "{out}"), ["--tiny"],
                       [_b("bench_moe_layer.py", "--parts", "bf16", "--warm")], 200, "bench_moe_layer-bf16.json"),
    "kimi_decode": (_b("bench_models.py", "--sections", "decode", "--out", "{out}"), ["--tiny"],
                    [_b("bench_models.py", "--sections", "kimi", "--no-hf", "--no-prewarm", "--warm-only", w,
                        "--out", os.devnull) for w in ("prefill:1x512", "decode:1")], 240, "kimi_linear_decode.json"),
    "kda_fwdbwd": (_b("bench_kda_bwd.py", "--warm-parallel", "6", "--budget", "500", "--out", "{out}"),
                   ["--tiny", "--budget", "900"], [], 520, "bench_kda_bwd.json"),
    "kda_decode": (_b("bench_kda.py", "--decode", "--out", "{out}"), ["--tiny"],
                   [_b("bench_kda.py", "--decode", "--warm")], 200, "kda_decode.json"),
    "moe_layer_mxfp4": (_b("bench_moe_layer.py", "--parts", "mxfp4", "--out", "{out}"), ["--tiny"],
                        [_b("bench_moe_layer.py", "--parts", "mxfp4", "--warm")], 240, "bench_moe_layer-mxfp4.json"),
    "kimi_vs_transformers": (_b("bench_models.py", "--sections", "kimi", "--budget", "520", "--out", "{out}"),
                             ["--tiny", "--target", "torch", "--budget", "1200"], [], 540, "bench_models-kimi.json"),
    "gpu_tests": ([PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/",
                   "--continue-on-collection-errors", "-rfE", "--junitxml={out}"], None, [], 540, "gpu_tests.xml"),
    "serve_load": (_b("gpu_verification.py", "serve-load", "--out", "{out}", "--duration", "45"), None, [], 560,
                   "serve_load.json"),
    "tvm_cuda_artifact": (_b("tvm_cuda_artifact.py", "run", "--out", "{out}"), None,
                          [_b("tvm_cuda_artifact.py", "warm", "--only", f"{m}-{d}") for m in TVM_ARTIFACTS
                           for d in ("float32", "bfloat16")], 480, "tvm_cuda_artifact.json"),
}
#: the device calls in the issue's order (each under ~9 minutes of steps)
CALLS = {
    1: ["kda_forward", "moe_layer_bf16"],
    2: ["kimi_decode", "kda_decode", "moe_layer_mxfp4"],
    3: ["kda_fwdbwd"],
    4: ["kimi_vs_transformers"],
    5: ["gpu_tests"],
    6: ["serve_load"],
    7: ["tvm_cuda_artifact"],
}
#: what the device machine installs first (wheels carried in .whl/: fla-core, transformers), then the tree (editable)
SETUP = ("cd .gpuhead && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
         "--target /tmp/site ../.whl/*.whl && export PYTHONPATH=/tmp/site && python3 -m pip install -q --no-deps "
         "--no-build-isolation -e . && export PYTHONUNBUFFERED=1")


#: call 7 carries ``.tvmgpu/`` (artifacts, runtime-only TVM, the cp312 apache-tvm-ffi wheel) instead of ``.whl/``
SETUP_TVM = ("cd .gpuhead && python3 -m pip install -q --no-deps --no-build-isolation -e . && "
             "export PYTHONUNBUFFERED=1")


def device_command(call: int) -> str:
    return f"{SETUP_TVM if call == 7 else SETUP} && python3 bench/gpu_verification.py run --call {call} --out $OUT"


def carry(call: int) -> list[str]:
    """The ignored folders call ``call`` needs on the device."""
    return [".gpuhead", ".tvmgpu"] if call == 7 else [".gpuhead", ".whl"]


#: the wheels ``.whl/`` must hold (the GPU image has Python 3.12 and none of these at these versions): fla for the
#: baselines, transformers 5.24 (the test pin) for call 4, the ``serve`` extra's packages the image lacks for
#: calls 5 (the serving tests) and 6 (``k3ir serve``)
WHEELS = ("fla_core==0.6.0", "transformers==5.24.0", "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.55.0",
          "sse_starlette==3.7.1", "pydantic==2.13.4", "pydantic_core==2.46.4", "annotated_types==0.7.0",
          "typing_inspection==0.4.2", "opentelemetry_api==1.45.3", "typing_extensions==4.16.0")
DOWNLOAD = ("python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
            "--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl")


def missing_wheels(names) -> list[str]:
    """The ``WHEELS`` entries without a matching ``NAME-VERSION-*.whl`` among ``names``."""
    have = {tuple(n.split("-")[:2]) for n in names if n.endswith(".whl")}
    return [w for w in WHEELS if tuple(w.split("==")) not in have]


def cmd_plan(_a) -> int:
    wheels = sorted(os.listdir(os.path.join(ROOT, ".whl"))) if os.path.isdir(os.path.join(ROOT, ".whl")) else []
    print("Before the first call, here: python bench/gpu_verification.py prepare   (.gpuhead = committed HEAD)")
    print(f"Wheels in .whl/ (carried): {', '.join(wheels) or 'NONE'}")
    if missing_wheels(wheels):
        print(f"MISSING wheels (fla rows skip, call 4 lacks transformers 5.24, calls 5-6 lack the serve extra): "
              f"{DOWNLOAD} {' '.join(missing_wheels(wheels))}")
    print()
    for n, steps in CALLS.items():
        print(f"call {n}: {', '.join(steps)}  (step timeouts {sum(STEPS[s][3] for s in steps)} s; budget 540 s)")
        print(f'  run(command="{device_command(n)}", carry={json.dumps(carry(n))}, timeout_s=600, kind="nvidia-h200")')
        print("  then here: python bench/gpu_verification.py collect <files_at>\n")
    tvm = os.path.join(ROOT, ".tvmgpu")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tvm) for f in fs)
    print("Call 7 (TVM CUDA artifacts) carries .tvmgpu/: " + (f"{size / 2**20:.1f} MiB" if size else
                                                               "MISSING: python bench/tvm_cuda_artifact.py prepare"))
    return 0


def cmd_prepare(_a) -> int:
    """``.gpuhead/``: the committed HEAD (``git archive``, nothing uncommitted) plus ``COMMIT`` (benchlib reads it)."""
    dst = os.path.join(ROOT, ".gpuhead")
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()
    arch = subprocess.run(["git", "-C", ROOT, "archive", "HEAD"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", dst], input=arch, check=True)
    with open(os.path.join(dst, "COMMIT"), "w") as f:
        f.write(sha + "\n")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst) for f in fs)
    excl = os.path.join(ROOT, ".git", "info", "exclude")
    ignored = False
    if os.path.exists(excl):
        with open(excl) as f:
            ignored = any(ln.strip() == "/.gpuhead/" for ln in f)
    print(f".gpuhead/ = HEAD {sha} ({size / 2**20:.1f} MiB){'' if ignored else '; add /.gpuhead/ to .git/info/exclude'}")
    return cmd_plan(_a)


def cmd_collect(a) -> int:
    """Copy each benchmark JSON of a call (``files_at``; named ``<benchmark>[-<label>].json``) to
    ``bench/results/<benchmark>/<date>-<commit>[-<label>].json`` (benchmark, date, commit from its ``meta``)."""
    n = 0
    for name in sorted(os.listdir(a.dir)):
        src = os.path.join(a.dir, name)
        if not name.endswith(".json") or name == "gpu_verification.json":
            continue
        with open(src) as f:
            meta = json.load(f).get("meta") or {}
        if not meta.get("benchmark"):
            print(f"skip {name}: no meta.benchmark")
            continue
        stem = os.path.splitext(name)[0]
        label = stem[len(meta["benchmark"]):].lstrip("-") if stem.startswith(meta["benchmark"]) else stem
        folder = os.path.join(a.results, meta["benchmark"])
        os.makedirs(folder, exist_ok=True)
        dst = os.path.join(folder, f"{meta['date']}-{meta['commit']}" + (f"-{label}" if label else "") + ".json")
        shutil.copyfile(src, dst)
        print(f"{src} -> {os.path.relpath(dst, ROOT)}")
        n += 1
    print(f"{n} files")
    return 0


def byte_tokenizer_checkpoint(name: str, d: str) -> str:
    """A checkpoint folder ``d`` for the bundled config ``name`` without weights (``k3ir serve`` then draws random
    ones): ``config.json`` and a ``tokenizer.json`` of HF ``tokenizers``' byte-level BPE without merges: prompts
    encode to one id per UTF-8 byte (ids 0..255), and every other id of the model's vocabulary decodes to a distinct
    lower-case ASCII word of 2-4 letters, so each generated token of the random model streams as one text event. A
    bundled config has no tokenizer, and ``k3ir serve`` refuses a vocabulary that is not a byte vocabulary without
    one. Returns the config.json path."""
    import itertools

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    os.makedirs(d, exist_ok=True)
    shutil.copyfile(os.path.join(ROOT, "frontend", "configs", f"{name}.json"), os.path.join(d, "config.json"))
    with open(os.path.join(d, "config.json")) as f:
        vocab_size = int(json.load(f)["vocab_size"])
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    words = ("".join(w) for n in (2, 3, 4) for w in itertools.product("abcdefghijklmnopqrstuvwxyz", repeat=n))
    for w in words:
        if len(vocab) >= vocab_size:
            break
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(d, "tokenizer.json"))
    return os.path.join(d, "config.json")


def cmd_serve_load(a) -> int:
    """Serving on the GPU (issue item 5): ``k3ir serve`` of Kimi Linear 6.6B (random weights) on the triton target in
    bf16 on loopback, then ``bench/load_test.py`` with 32 and 128 concurrent clients for ``--duration`` seconds each
    (its prompt/output mix; throughput, time to first token, inter-token latency percentiles, 5xx, pool after the
    run). One JSON (``benchlib.Report``, rows = the load reports)."""
    import urllib.request
    sys.path.insert(0, HERE)
    from benchlib import Report
    rep = Report("serve_load", a.out, sys.argv)
    port = 8731
    model = a.model
    if os.path.isfile(os.path.join(ROOT, "frontend", "configs", f"{a.model}.json")):
        model = byte_tokenizer_checkpoint(a.model, os.path.join(a.out + ".ckpt"))
        rep.data["meta"]["tokenizer"] = "byte_tokenizer_checkpoint: byte-level BPE without merges, random weights"
    srv = subprocess.Popen([PY, "-m", "k3ir.cli", "serve", model, "--served-name", a.model, "--target", "triton",
                            "--device", "cuda", "--dtype", "bfloat16", "--port", str(port), "--max-batch", "128"],
                           cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if srv.poll() is not None or time.time() - t0 > a.start_timeout:
                rep.add({"error": f"server not up after {time.time() - t0:.0f} s (rc {srv.poll()})"})
                return 1
            time.sleep(2)
        rep.data["meta"]["server_start_s"] = time.time() - t0
        # a warm-up load first (its row says "warmup"): the triton kernels compile on their first batch shapes, which
        # took the whole of a 230-s window on an H100 (109 answers) before any timed load
        for clients, duration, warm in [(128, a.warmup, True)] * (a.warmup > 0) + [(32, a.duration, False),
                                                                                   (128, a.duration, False)]:
            t1 = time.time()
            try:
                p = subprocess.run([PY, os.path.join(HERE, "load_test.py"), "--url", url, "--model", a.model,
                                    "--clients", str(clients), "--duration", str(duration)], cwd=ROOT,
                                   capture_output=True, text=True, timeout=duration * 3 + 120, check=False)
                r = json.loads(p.stdout)
            except subprocess.TimeoutExpired:
                r = {"error": f"load test still running after {duration * 3 + 120:.0f} s"}
            except ValueError:
                r = {"error": f"rc {p.returncode}: {p.stderr[-800:]}"}
            rep.add({"clients": clients, "duration_s": duration, "warmup": warm, "wall_s": time.time() - t1, **r})
    finally:
        srv.terminate()
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
    return 0 if all(not r.get("error") and not r.get("failures") for r in rep.data["rows"]) else 1


def _run_group(cmd, env, timeout) -> str:
    """``cmd`` in its own process group; on timeout the whole group is killed (a step's helper processes must not
    keep the GPU busy during the next step). Returns "ok", "rc N" or "timeout"."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        rc = p.wait(timeout=timeout)
        return "ok" if rc == 0 else f"rc {rc}"
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        return "timeout"


def cmd_run(a) -> int:
    """Run one call's steps: warm commands in parallel, then the timed steps in order within ``--budget``."""
    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    steps = [s for s in (a.steps.split(",") if a.steps else CALLS[a.call]) if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        print(f"gpu_verification: unknown steps {unknown}; known: {', '.join(STEPS)}", file=sys.stderr)
        return 2
    log = {"call": a.call, "steps": steps, "tiny": a.tiny, "budget_s": a.budget, "results": []}
    log_path = os.path.join(a.out, "gpu_verification.json")

    def save():
        log["elapsed_s"] = time.time() - t0
        with open(log_path, "w") as f:
            json.dump(log, f, indent=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3IR_")}      # the shipped defaults only
    log["k3ir_env_removed"] = sorted(set(os.environ) - set(env))
    if log["k3ir_env_removed"]:
        print(f"gpu_verification: K3IR_* variables removed for the steps: {log['k3ir_env_removed']}", flush=True)
    runnable = [s for s in steps if not (a.tiny and STEPS[s][1] is None)]
    for s in set(steps) - set(runnable):
        log["results"].append({"step": s, "status": "skipped", "note": "no --tiny form (GPU only)"})
    warm = [] if a.tiny or a.no_warm else [c for s in runnable for c in STEPS[s][2]]
    if warm:
        print(f"== warm: {len(warm)} processes in parallel", flush=True)
        procs = [subprocess.Popen(c, cwd=ROOT, env=env, start_new_session=True) for c in warm]
        cap = min(a.warm_cap, a.budget * 0.6)
        for c, p in zip(warm, procs):
            try:
                p.wait(timeout=max(1.0, cap - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log["results"].append({"step": "warm " + " ".join(c[2:]), "rc": p.returncode, "s": time.time() - t0})
        save()
    for s in runnable:
        cmd, tiny_args, _, timeout, name = STEPS[s]
        left = a.budget - (time.time() - t0)
        if left < 30:
            log["results"].append({"step": s, "status": "skipped", "note": f"{left:.0f} s of the budget left"})
            save()
            continue
        out = os.path.join(a.out, name)
        full = [c.replace("{out}", out) for c in cmd] + (tiny_args if a.tiny else [])
        print(f"== {s} ({time.time() - t0:.0f} s): {' '.join(full)}", flush=True)
        t = time.time()
        status = _run_group(full, env, min(timeout if not a.tiny else 3600, left))
        log["results"].append({"step": s, "status": status, "s": time.time() - t, "json": name,
                               "written": os.path.exists(out)})
        save()
    print("\n| step | status | s | JSON |\n|---|---|---|---|")
    for r in log["results"]:
        print(f"| {r['step']} | {r.get('status', r.get('rc'))} | {r.get('s', 0):.0f} | {r.get('json', '-')} |")
    save()
    return 0 if all(r.get("status", "ok") in ("ok", "skipped") for r in log["results"]) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("plan", help="print the calls and the device commands")
    sub.add_parser("prepare", help="write .gpuhead/ (git archive HEAD + COMMIT) and print the commands")
    c = sub.add_parser("collect", help="copy a call's JSON files into bench/results/")
    c.add_argument("dir")
    c.add_argument("--results", default=os.path.join(HERE, "results"), help="results folder (default bench/results)")
    r = sub.add_parser("run", help="run one call's steps (on the device; --tiny: on the CPU)")
    r.add_argument("--call", type=int, default=1, choices=sorted(CALLS))
    r.add_argument("--steps", default=None, help=f"comma-separated steps instead of the call's: {', '.join(STEPS)}")
    r.add_argument("--out", required=True, help="folder for the JSON files ($OUT on the device)")
    r.add_argument("--budget", type=float, default=540.0, help="seconds for the whole call")
    r.add_argument("--warm-cap", type=float, default=300.0, help="seconds the parallel warm phase may take")
    r.add_argument("--no-warm", action="store_true", help="no parallel warm phase")
    r.add_argument("--tiny", action="store_true", help="every step at its --tiny size (CPU, TRITON_INTERPRET=1)")
    sl = sub.add_parser("serve-load", help="the serving step (GPU): k3ir serve + load_test.py at 32 and 128 clients")
    sl.add_argument("--out", required=True)
    sl.add_argument("--model", default="kimi-linear-6p6b")
    sl.add_argument("--duration", type=float, default=60.0)
    sl.add_argument("--warmup", type=float, default=90.0, help="seconds of untimed load at 128 clients first (0: none)")
    sl.add_argument("--start-timeout", type=float, default=240.0)
    a = ap.parse_args()
    return {"plan": cmd_plan, "prepare": cmd_prepare, "collect": cmd_collect, "run": cmd_run,
            "serve-load": cmd_serve_load}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
