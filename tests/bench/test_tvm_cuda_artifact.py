"""``bench/tvm_cuda_artifact.py`` on the CPU: the runtime-only TVM it packs (runtime libraries, no compiler library),
the ``k3ir compile`` commands it runs (the issue's configs), ``gpu_verification.py`` call 7, and its ``run`` path end
to end on an llvm artifact: installed into a fresh folder, run in a ``TVM_USE_RUNTIME_LIB=1`` process that imports
that TVM copy and maps no ``libtvm_compiler.so``, logits against the torch target, tokens/s with 3 repeats."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

pytest.importorskip("tvm")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)

import tvm_cuda_artifact as tca


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("K3IR_")}


def test_runtime_pack_has_the_runtime_libraries_and_not_the_compiler(tmp_path):
    import tvm
    info = tca.pack_tvm_runtime(str(tmp_path / "rt.tar.gz"))
    with tarfile.open(tmp_path / "rt.tar.gz") as tar:
        names = set(tar.getnames())
    pkg = os.path.dirname(tvm.__file__)
    assert {f"tvm/lib/{x}" for x in tca.RUNTIME_LIBS} <= names
    assert not any("libtvm_compiler" in n or "/3rdparty/" in n for n in names)
    want = {os.path.join("tvm", os.path.relpath(os.path.join(d, f), pkg)) for d, _, fs in os.walk(pkg) for f in fs
            if f.endswith(".py") and not set(os.path.relpath(d, pkg).split(os.sep)) & {"3rdparty", "web", "src"}}
    assert want <= names and "tvm/runtime/vm.py" in names
    assert info["tvm"] == tvm.__version__ and info["bytes"] < 8 * 2**20


def test_compile_commands_build_the_issue_configs():
    """The ``--set`` flags of kimi-linear-tiny give the model ``tests/_tiny_models.py`` defines (same parameter
    count from ``k3ir inspect``), and k3-tiny mxfp4 quantises its experts."""
    from _tiny_models import load_tiny

    from k3ir.accounting import report
    cmd = tca.compile_command("kimi-linear-tiny", "bfloat16", "tvm-cuda", "OUT")
    assert cmd[3:9] == ["compile", "kimi-linear-6p6b", "--target", "tvm-cuda", "--dtype", "bfloat16"]
    sets = cmd[cmd.index("--set"):]
    p = subprocess.run([sys.executable, "-m", "k3ir.cli", "inspect", "kimi-linear-6p6b", *sets, "--json"],
                       capture_output=True, text=True, check=False, cwd=ROOT, env=_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["params_total"] == report(load_tiny("kimi-linear-tiny")).params_total
    k3 = tca.compile_command("k3-tiny-mxfp4", "float32", "tvm-cuda", "OUT")
    assert k3[4] == "k3-tiny" and k3[-2:] == ["--quantize", "mxfp4"] and "--set" not in k3


def test_gpu_verification_call_7_carries_the_tvm_folder():
    p = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_verification.py"), "plan"], capture_output=True,
                       text=True, check=True, cwd=ROOT, timeout=60)
    line = next(ln for ln in p.stdout.splitlines() if "--call 7" in ln)
    assert 'carry=[".gpuhead", ".tvmgpu"]' in line and ".whl" not in line and "tvm_cuda_artifact" in p.stdout
    assert 'carry=[".gpuhead", ".whl"]' in next(ln for ln in p.stdout.splitlines() if "--call 1" in ln)


def test_cudart_is_preloaded_from_the_nvidia_wheels_when_not_on_the_linker_path(tmp_path, monkeypatch):
    """``preload_cudart``: nothing to do when ``libcudart.so.13`` loads by name; otherwise the first
    ``nvidia/*/lib/libcudart.so.13`` on ``sys.path`` (torch's CUDA wheels) is loaded globally; None when none loads."""
    import ctypes
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcudart.so.13").write_bytes(b"")
    loaded = []

    def fake_cdll(name, mode=0):
        if name == "libcudart.so.13" or name not in wanted:
            raise OSError(f"{name}: cannot open shared object file")
        loaded.append((name, mode))
        return object()
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.setattr(ctypes, "CDLL", fake_cdll)
    wanted = {str(lib / "libcudart.so.13")}
    assert tca.preload_cudart() == str(lib / "libcudart.so.13") and loaded == [(str(lib / "libcudart.so.13"),
                                                                                ctypes.RTLD_GLOBAL)]
    wanted = set()
    assert tca.preload_cudart() is None


@pytest.mark.slow
def test_run_path_on_cpu_artifacts_with_the_packed_runtime_only(tmp_path):
    """``run --device cpu`` on an llvm artifact of kimi-linear-tiny (float32): the packed TVM installed into a fresh
    folder is the one imported, in runtime-only mode with no compiler library mapped. ``measure`` (the full TVM:
    in runtime-only mode a tvm-cuda artifact needs a CUDA device to pass ``Session.load``'s target check) on a
    bfloat16 tvm-cuda artifact whose device is the CPU (``helpers.gpu_lowered_cpu_artifact``: the GPU loader and
    the bfloat16 rows). Logits within 1e-4 of torch float32 on each artifact's weights; the bfloat16 row also
    compares with torch bfloat16 and records torch's own bfloat16 error; tokens/s of each route with 3 repeats."""
    from _tiny_models import load_tiny
    from helpers import gpu_lowered_cpu_artifact
    from k3ir.backends.tvm.config import tvm_config
    from k3ir.runtime.params import init_params

    import k3ir
    d = tmp_path / "tvmgpu"
    art = d / "artifacts" / "kimi-linear-tiny-float32"
    with tvm_config(opt_level=0):
        exe = k3ir.compile(load_tiny("kimi-linear-tiny"), target="tvm")
        exe.save(str(art), init_params(exe.module, 0))
    gpu_lowered_cpu_artifact("kimi-linear-tiny", str(d / "artifacts" / "kimi-linear-tiny-bfloat16"))
    tca.pack_tvm_runtime(str(d / "tvm-runtime.tar.gz"))
    rows = []
    for cmd, name in (("run", "kimi-linear-tiny-float32"), ("measure", "kimi-linear-tiny-bfloat16")):
        out = tmp_path / f"{name}.json"
        p = subprocess.run([sys.executable, os.path.join(BENCH, "tvm_cuda_artifact.py"), cmd, "--dir", str(d), "--out",
                            str(out), "--device", "cpu", "--site", str(tmp_path / "site"), "--prefill", "8", "--decode",
                            "2", "--check-steps", "3", "--only", name], capture_output=True, text=True, check=False,
                           cwd=ROOT, env=_env(), timeout=900)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        with open(out) as f:
            rep = json.load(f)
        rt = rep["meta"]["runtime"]
        if cmd == "run":
            assert rt["runtime_only"] and rt["tvm_from_site"] and rt["libtvm_runtime_mapped"]
            assert not rt["libtvm_compiler_mapped"]
        rows += rep["rows"]
    f32, bf16 = rows
    assert (bf16["artifact"], f32["artifact"]) == ("kimi-linear-tiny-bfloat16", "kimi-linear-tiny-float32")
    for row, dt in ((f32, "float32"), (bf16, "bfloat16")):
        assert "error" not in row and row["ok"] and row["dtype"] == dt, row.get("error")
        errs = row["rel_err"]["torch:float32"]
        assert errs["max"] < 1e-4 and len(errs["decode"]) == 3 and len(row["greedy_tokens"]) == 3
        assert set(row["tokens_per_s"]) == {"tvm", f"torch:{dt}"}
        for route in row["tokens_per_s"].values():
            for s in route.values():
                assert len(s["runs"]) == 3 and s["min"] <= s["median"] <= s["max"] and s["min"] > 0
    assert f32["target"] == "tvm" and f32["issue_tol_met"] and "torch_bf16_vs_torch_f32" not in f32
    assert bf16["target"] == "tvm-cuda" and bf16["tol"] == 5e-3
    own = bf16["torch_bf16_vs_torch_f32"]["max"]     # torch's bfloat16 activations against its float32 ones
    assert own > 1e-3 and bf16["rel_err"]["torch:bfloat16"]["max"] > 1e-3
    assert bf16["issue_tol_met"] == (bf16["rel_err"]["torch:bfloat16"]["max"] < 5e-3)
