"""Defects from the fresh-user review (2026-11-30): compile dtypes checked per target before
anything runs, checkpoint errors naming the directory and file, ``k3ir.save`` keeping each
tensor's dtype (no silent rounding), the Triton interpreter's expected overflow kept out of user
output, ``k3ir serve`` on a busy port. CPU only, a few seconds in all."""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
import warnings

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported (as test_triton_kda)
from conftest import rel_err
from k3ir.backends import DTYPES, get_backend, list_backends
from k3ir.runtime.cli import main
from k3ir.runtime.params import init_params
from safetensors.torch import load_file

import k3ir
from k3ir.errors import K3BackendError, K3CheckpointError, K3RuntimeError

TINY_CFG = {
    "model_type": "kimi_linear", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "rms_norm_eps": 1e-5,
    "dtype": "bfloat16", "hidden_act": "silu", "intermediate_size": 48, "first_k_dense_replace": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": None, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "mla_use_nope": True,
    "linear_attn_config": {"full_attn_layers": [2], "kda_layers": [1, 3], "num_heads": 2, "head_dim": 8,
                           "short_conv_kernel_size": 4},
    "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 32,
    "routed_scaling_factor": 2.446, "eos_token_id": 1,
}


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("k3ir: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def tiny_bf16(tmp_path):
    """A tiny kimi_linear module whose config says bf16, and float32 params."""
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps(TINY_CFG))
    m = k3ir.load(str(p))
    return m, {k: v.astype(np.float32) for k, v in init_params(m, seed=7).items()}


def _header_dtypes(path) -> dict[str, str]:
    """key -> safetensors dtype, read from the file's own header (not through k3ir)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        hdr = json.loads(f.read(n))
    hdr.pop("__metadata__", None)
    return {k: v["dtype"] for k, v in hdr.items()}


# ---- 1. compile dtypes, checked per target before anything runs ---------------------------------
def test_cli_compile_rejects_float8_before_loading(capsys):
    """The dtype check precedes loading: a model path that does not exist is never reached."""
    assert main(["compile", "no/such/model.json", "--target", "triton", "--dtype", "float8"]) == 2
    err = _one_line_error(capsys)
    assert "float8" in err and "'triton'" in err and "no/such" not in err
    for ok in ("float32", "bfloat16", "float16", "float64"):      # the Triton executable takes all four
        assert ok in err


def test_generate_checks_dtype_before_loading(capsys):
    assert main(["generate", "no/such/model.json", "--prompt", "x", "--target", "onnx", "--dtype", "bfloat16"]) == 2
    assert "unsupported dtype 'bfloat16' for target 'onnx' (supported: float32, float16)" in _one_line_error(capsys)


def test_python_compile_rejects_dtype_even_where_target_cannot_run(monkeypatch):
    """On a CPU machine without TRITON_INTERPRET the triton target is unavailable; a bad dtype is
    still reported as the dtype error (it used to be accepted by the CLI's pipeline-only path)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = k3ir.load("k3-tiny")
    with pytest.raises(K3BackendError, match=r"unknown dtype 'float8' for target 'triton' \(supported: float32"):
        k3ir.compile(m, target="triton", dtype="float8")


@pytest.mark.parametrize("target,bad,supported", [("mlir", "float16", "float32"),
                                                  ("onnx", "bfloat16", "float32, float16"),
                                                  ("tvm", "bf16", "float32, float64")])
def test_unsupported_dtype_names_the_target_dtypes(capsys, target, bad, supported):
    """These executables compute only in ``supported`` (their constructors reject the rest, tvm used
    to round bf16 up to float32 silently): the error comes first, on any machine, at exit 2."""
    with pytest.raises(K3BackendError) as e:
        k3ir.compile(k3ir.load("k3-tiny"), target=target, dtype=bad)
    assert str(e.value) == f"unsupported dtype '{bad}' for target '{target}' (supported: {supported})"
    assert main(["compile", "k3-tiny", "--target", target, "--dtype", bad, "--no-build"]) == 2
    assert f"unsupported dtype '{bad}'" in _one_line_error(capsys)


def test_declared_dtypes_build_and_aliases_resolve():
    """Every dtype a usable target declares builds there (the executable records it), aliases
    resolve to the canonical name, and the reference target computes in float64 whatever is asked."""
    m = k3ir.load("k3-tiny")
    for b in list_backends():
        if b.available() is not None or b.name not in ("torch", "triton", "reference"):
            continue
        for dt in b.dtypes or DTYPES:
            exe = k3ir.compile(m, target=b.name, dtype=dt)
            assert exe.dtype == ("float64" if b.name == "reference" else dt), (b.name, dt)
    assert k3ir.compile(m, target="torch", dtype="bf16").dtype == "bfloat16"
    assert get_backend("mlir").dtypes == ("float32",)


# ---- 2. checkpoint errors name the directory and the file ---------------------------------------
def _sharded(tmp_path, tiny):
    m, params = tiny
    d = tmp_path / "ckpt"
    k3ir.save(m, params, str(d), max_shard_bytes=30_000)
    shards = sorted(p.name for p in d.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    return d, shards


def _truncate_data(d, shards):
    """Cut the last 100 bytes of the second shard: its header stays intact, its last tensor's data goes."""
    p = d / shards[1]
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 100)
    with open(p, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        hdr = json.loads(f.read(n))
    hdr.pop("__metadata__", None)
    return max(hdr, key=lambda k: hdr[k]["data_offsets"][1])     # the tensor whose bytes are cut


CASES = {
    "truncated data": lambda d, s: ([s[1], "truncated", _truncate_data(d, s)]),
    "truncated header": lambda d, s: (os.truncate(d / s[0], 5), [s[0], "truncated"])[1],
    "index not JSON": lambda d, s: ((d / "model.safetensors.index.json").write_text("{"),
                                    ["model.safetensors.index.json", "invalid JSON"])[1],
    "index without weight_map": lambda d, s: ((d / "model.safetensors.index.json").write_text("{}"),
                                              ["model.safetensors.index.json", "weight_map"])[1],
    "index names absent shard": lambda d, s: (os.remove(d / s[-1]), ["model.safetensors.index.json", s[-1],
                                                                    "does not exist"])[1],
    "index missing, shard missing": lambda d, s: (os.remove(d / "model.safetensors.index.json"), os.remove(d / s[1]),
                                                  ["no model.safetensors.index.json", s[1], "is missing"])[2],
}


@pytest.mark.parametrize("what", sorted(CASES))
def test_checkpoint_errors_name_directory_and_file(tmp_path, tiny_bf16, capsys, what):
    d, shards = _sharded(tmp_path, tiny_bf16)
    needles = CASES[what](d, shards)
    with pytest.raises(K3CheckpointError) as e:
        k3ir.load(str(d))
    msg = str(e.value)
    assert msg.startswith(str(d)), msg                        # the checkpoint directory, as the user gave it
    for n in needles:
        assert n in msg, (n, msg)
    assert main(["inspect", str(d)]) == 2
    assert _one_line_error(capsys) == f"k3ir: error: {msg}\n"


def test_complete_shards_without_index_still_load(tmp_path, tiny_bf16):
    d, _ = _sharded(tmp_path, tiny_bf16)
    os.remove(d / "model.safetensors.index.json")
    w = k3ir.load(str(d)).weights
    name = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(w[name], tiny_bf16[1][name])


# ---- 3. save keeps each tensor's dtype; an explicit narrower dtype warns ---------------------------
def test_save_float32_params_of_a_bf16_model_round_trip_exactly(tmp_path, tiny_bf16, caplog):
    m, params = tiny_bf16
    assert m.params["model.layers.0.self_attn.q_proj.weight"].type.dtype == "bf16"     # the config's dtype
    with caplog.at_level(logging.WARNING, logger="k3ir"):
        k3ir.save(m, params, str(tmp_path))
    assert not [r for r in caplog.records if "rounds" in r.getMessage()]
    floats = {k: v for k, v in _header_dtypes(tmp_path / "model.safetensors").items() if v.startswith(("F", "BF"))}
    assert floats and set(floats.values()) == {"F32"}
    w = k3ir.load(str(tmp_path)).weights
    assert set(w) == set(params)
    for k, v in params.items():
        np.testing.assert_array_equal(w[k], v, err_msg=k)


def test_save_keeps_torch_and_float64_dtypes_and_a_loaded_bf16_checkpoint_stays_bf16(tmp_path, tiny_bf16):
    m, params = tiny_bf16
    q = "model.layers.0.self_attn.q_proj.weight"
    f64 = {k: init_params(m, seed=7)[k] if k == q else v for k, v in params.items()}       # one float64 array
    mixed = {k: torch.from_numpy(v).to(torch.bfloat16) if k != q else v for k, v in f64.items()}
    k3ir.save(m, mixed, str(tmp_path / "a"))
    dts = _header_dtypes(tmp_path / "a" / "model.safetensors")
    assert dts[q] == "F64" and dts["model.layers.0.self_attn.o_proj.weight"] == "BF16"
    a = k3ir.load(str(tmp_path / "a"))
    np.testing.assert_array_equal(a.weights[q], f64[q])                          # float64 bit for bit
    bf = mixed["model.layers.0.self_attn.o_proj.weight"].float().numpy()
    np.testing.assert_array_equal(a.weights["model.layers.0.self_attn.o_proj.weight"], bf)
    k3ir.save(a, None, str(tmp_path / "b"))                                       # re-save the bound weights
    assert _header_dtypes(tmp_path / "b" / "model.safetensors") == dts             # stored dtypes kept
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    ref = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert all(torch.equal(b[k], ref[k]) for k in ref)


def test_explicit_narrower_dtype_warns_and_rounds(tmp_path, tiny_bf16, caplog):
    m, params = tiny_bf16
    with caplog.at_level(logging.WARNING, logger="k3ir"):
        k3ir.save(m, params, str(tmp_path / "bf"), dtype="bf16")
    msgs = [r.getMessage() for r in caplog.records if "rounds" in r.getMessage()]
    n_float = sum(1 for d in m.params.values() if d.type.dtype in ("bf16", "f32"))
    assert len(msgs) == 1 and f"{n_float} float32 tensor(s) to bfloat16" in msgs[0], msgs
    q = "model.layers.0.self_attn.q_proj.weight"
    got = k3ir.load(str(tmp_path / "bf")).weights[q]
    np.testing.assert_array_equal(got, torch.from_numpy(params[q]).to(torch.bfloat16).float().numpy())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="k3ir"):
        k3ir.save(m, params, str(tmp_path / "f32"), dtype="float32")          # same precision: silent
    assert not [r for r in caplog.records if "rounds" in r.getMessage()]


# ---- 4. the Triton interpreter's expected overflow ----------------------------------------------
def test_interpreter_guard_silences_gate_overflow_and_stays_exact():
    """The K3 gate ``lb sigmoid(a (z + dt_bias))`` with z = -200 computes exp(200) in fp32 inside
    the interpreted kernel (inf, so sigmoid = 0, which is right): no RuntimeWarning reaches the
    user and the output matches the float64 recurrence (kda_recurrent, kda_gate_ref)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the guard is for the CPU interpreter")
    from k3ir.backends.triton import kda_forward
    from k3ir.backends.triton.executable import interpreter_guard

    from k3ir.ops.kda import kda_gate_ref, kda_recurrent
    g = torch.Generator().manual_seed(3)
    B, T, H, K = 1, 20, 2, 16
    q, k, v = (torch.randn(B, T, H, K, generator=g) for _ in range(3))
    z = torch.randn(B, T, H, K, generator=g)
    z[:, ::3] = -200.0
    beta, A_log, dt_bias = torch.randn(B, T, H, generator=g), torch.zeros(H), torch.randn(H * K, generator=g)
    run = interpreter_guard("k3.kda", lambda inst, *a: kda_forward(*a, lower_bound=-5.0, output_final_state=True))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        o, s = run(None, q, k, v, z, beta, A_log, dt_bias)
    assert not [w for w in rec if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in rec]
    n = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)
    gl = kda_gate_ref(z.numpy(), A_log.numpy(), dt_bias.numpy(), "lower_bound", -5.0)
    o_ref, s_ref = kda_recurrent(n(q.double().numpy()), n(k.double().numpy()), v.numpy(), gl,
                                 1 / (1 + np.exp(-beta.double().numpy())), K ** -0.5)
    assert rel_err(o.double().numpy(), o_ref) < 1e-5 and rel_err(s.double().numpy(), s_ref) < 1e-5


def test_interpreter_guard_turns_unexpected_non_finite_into_an_error():
    from k3ir.backends.triton.executable import interpreter_guard
    x = torch.ones(3)
    bad = interpreter_guard("k3.fused_kda", lambda inst, a: (a / 0.0, a))
    with pytest.raises(K3RuntimeError, match="k3.fused_kda: .*non-finite"):
        bad(None, x)
    passed = bad(None, torch.tensor([float("inf")]))       # non-finite in, non-finite out: not this op's fault
    assert torch.isinf(passed[0]).all()


# ---- 5. serve on a busy port ---------------------------------------------------------------------
def test_serve_on_a_busy_port_is_one_line_exit_2(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "k3-tiny", "--port", str(port)]) == 2
    err = _one_line_error(capsys)
    assert err.startswith(f"k3ir: error: port {port} is in use (127.0.0.1:{port}: "), err


def test_check_port_accepts_a_free_port():
    from k3ir.runtime.cli_serve import check_port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_port("127.0.0.1", port)                # closed again: free (SO_REUSEADDR as uvicorn)


def test_binary_file_is_one_line_error(tmp_path, capsys):
    """A binary file where a config / IR file is expected: exit 2 and one line naming the file (was a raw
    UnicodeDecodeError traceback)."""
    from k3ir.runtime.cli import main
    f = tmp_path / "rnd.bin"
    f.write_bytes(bytes(range(200, 256)) * 4)
    assert main(["print", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(f) in err[0] and "not a UTF-8 text file" in err[0]


def test_random_init_too_big_for_memory_is_an_error(monkeypatch, tmp_path, capsys):
    """Random init of a model that cannot fit in memory fails up front with the size (the full Kimi K3 needs
    ~22.9 TB in float64), for the Python API and the CLI (was a NumPy MemoryError traceback or a silent kill)."""
    import os

    from k3ir.runtime.cli import main
    from k3ir.runtime.params import init_params

    import k3ir
    from k3ir.errors import K3RuntimeError
    m = k3ir.load("k3-tiny")
    n = sum(int(d.type.numel()) for d in m.params.values())
    real = os.sysconf
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": (8 * n) // 4096 // 2}     # half of what the init needs
    monkeypatch.setattr(os, "sysconf", lambda k: pages.get(k, None) if k in pages else real(k))
    with pytest.raises(K3RuntimeError, match="random init of .* needs .* GB"):
        init_params(m)
    monkeypatch.setattr(os, "sysconf", real)
    assert main(["train", "kimi-k3", "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    import re
    assert re.search(r"random init of kimi-k3 needs [0-9]{2},[0-9]{3} GB", err) and "Traceback" not in err


def test_bad_torch_dtype_is_rejected_even_next_to_dtype():
    """``torch_dtype`` (the older key) is validated even when ``dtype`` is present and wins (--set
    torch_dtype=float33 was accepted); "auto" means the file's dtype."""
    from k3ir.frontend.config import load_config

    from k3ir.errors import K3ConfigError
    with pytest.raises(K3ConfigError, match="torch_dtype.*float33"):
        load_config("k3-tiny", {"torch_dtype": "float33"})
    assert load_config("k3-tiny", {"torch_dtype": "auto"}).dtype == load_config("k3-tiny").dtype
    assert load_config("kimi-linear-6p6b", {"torch_dtype": "float32"}).dtype == "bf16"   # "dtype" wins


def test_loading_a_missing_artifact_directory_says_so(tmp_path):
    from k3ir.runtime import Session

    from k3ir.errors import K3RuntimeError
    with pytest.raises(K3RuntimeError, match="no such directory"):
        Session.load(str(tmp_path / "missing"))
    with pytest.raises(K3RuntimeError, match="not a compiled artifact"):
        Session.load(str(tmp_path))
