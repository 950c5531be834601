"""MLIR export (linalg/tensor/func text verified by IREE's bindings) and the ``mlir`` target
(IREE llvm-cpu) against the float64 reference; offline IREE builds for other accelerators."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("iree.compiler")
pytest.importorskip("iree.runtime")

from _tiny_models import load_tiny, prefill_decode, route_sessions, token_ids
from conftest import rel_err
from k3ir.backends.mlir import compile_mlir, emit_mlir
from k3ir.runtime import Session
from k3ir.runtime.params import init_params

import k3ir
from k3ir.builder import Builder
from k3ir.ir import Function, Module
from k3ir.types import TensorType

MXFP4 = ["fuse-moe-dispatch", "quantize-experts{format=mxfp4}", "dce"]
_MXFP4_ROUTES: dict = {}


def _passes(key: str) -> list[str] | None:
    """The pipeline a test key names: ``<model>-mxfp4`` packs the routed experts as MXFP4 (the fused MoE form)."""
    return MXFP4 if key.endswith("-mxfp4") else None


def _sessions(key: str):
    """(module, params, float64 reference, mlir Executable, mlir Session) on the same random weights (seed 3); for
    ``<model>-mxfp4`` the module and the reference both carry the packed experts (the reference dequantises them in
    float64, SPEC.md 7)."""
    if not key.endswith("-mxfp4"):
        return route_sessions(key, "mlir")
    if key not in _MXFP4_ROUTES:
        m = load_tiny(key[:-len("-mxfp4")])
        exe = k3ir.compile(m, target="mlir", passes=MXFP4)
        params = init_params(exe.module, seed=3)
        ref = Session(k3ir.compile(m, target="reference", dtype="float64", passes=MXFP4), params=params)
        _MXFP4_ROUTES[key] = (m, params, ref, exe, Session(exe, params=params))
    return _MXFP4_ROUTES[key]


def _dialects(text: str) -> set[str]:
    return {ln.split("=", 1)[-1].strip().split(" ")[0].split(".")[0] for ln in text.splitlines()
            if " = " in ln and "." in ln.split("=", 1)[-1].strip().split(" ")[0] and "util.global private" not in ln}


def test_mlir_text_is_linalg_and_dynamic():
    """``param_form="arguments"``: upstream dialects only, the weights trailing arguments; ``"globals"`` (the
    default): the same body, each weight one ``util.global`` initialised from the IREE parameter ``k3::<name>`` and
    loaded once at the top of the function, no weight arguments."""
    m, *_ = _sessions("k3-tiny")
    text, order = emit_mlir(m, ["prefill"], param_form="arguments")
    head = next(ln for ln in text.splitlines() if "func.func @prefill" in ln)
    assert "%a0: tensor<?x?xi64>" in head                          # dynamic batch and sequence
    assert "linalg.generic" in text and "scf.for" in text            # KDA recurrence as a loop
    assert _dialects(text) <= {"arith", "math", "linalg", "tensor", "scf"}, _dialects(text)
    names = {op.attrs["name"] for op in m.functions["prefill"].ops if op.name == "k3.param"}
    assert len(order["prefill"]) == len(names) and f"%p{len(names) - 1}: tensor<" in head
    glob, gorder = emit_mlir(m, ["prefill"])
    ghead = next(ln for ln in glob.splitlines() if "func.func @prefill" in ln)
    assert gorder == order and "%p0" not in ghead
    decls = re.findall(r'util.global private (@k3p\d+) = #flow.parameter.named<"k3"::"([^"]+)"> : (tensor<[^>]*>)',
                       glob)
    assert sorted(n for _, n, _ in decls) == sorted(names)
    arg_types = dict(zip(order["prefill"], re.findall(r"%p\d+: (tensor<[^>]*>)", head)))
    assert {n: t for _, n, t in decls} == arg_types                 # the argument types, as globals
    for sym, _, t in decls:
        assert glob.count(f"util.global.load {sym} : {t}") == 1
    assert _dialects(glob) <= {"arith", "math", "linalg", "tensor", "scf", "util"}, _dialects(glob)


def test_mlir_artifact_save_and_session_load(tmp_path):
    m, _, _, exe, sess = _sessions("k3-tiny")
    exe.save(str(tmp_path / "art"))
    man = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert man["target"] == "mlir" and (tmp_path / "art" / "k3.vmfb").stat().st_size > 0
    loaded = Session.load(str(tmp_path / "art"))
    ids = token_ids(m.attrs["vocab_size"], 1, 5)
    nxt = token_ids(m.attrs["vocab_size"], 1, 1, seed=7)
    a, b = prefill_decode(loaded, ids, nxt), prefill_decode(sess, ids, nxt)
    assert rel_err(a[0], b[0]) < 1e-6 and rel_err(a[1], b[1]) < 1e-6


@pytest.mark.slow
def test_mxfp4_artifact_reopens_with_packed_experts(tmp_path):
    """An mlir artifact of k3-tiny with MXFP4 experts keeps the packed bytes (uint8 in weights.safetensors) and, reopened
    by ``Session.load``, hands them to IREE as i4 codes again: prefill + one decode step equal the live session's."""
    from safetensors.numpy import load_file
    m, _, _, exe, sess = _sessions("k3-tiny-mxfp4")
    exe.save(str(tmp_path / "art"))
    stored = load_file(str(tmp_path / "art" / "weights.safetensors"))
    packed = [k for k in stored if k.endswith(".weight_packed")]
    assert packed and all(stored[k].dtype == np.uint8 for k in packed)
    loaded = Session.load(str(tmp_path / "art"))
    ids = token_ids(m.attrs["vocab_size"], 1, 9)
    nxt = token_ids(m.attrs["vocab_size"], 1, 1, seed=7)
    a, b = prefill_decode(loaded, ids, nxt), prefill_decode(sess, ids, nxt)
    assert rel_err(a[0], b[0]) < 1e-6 and rel_err(a[1], b[1]) < 1e-6


def _small_module() -> Module:
    m = Module("small")
    fn = Function("forward")
    b = Builder(m, fn)
    x = b.arg("x", TensorType("f32", ("B", "T", 64)))
    y = b.linear(b.rmsnorm(x, b.param("w", TensorType("f32", (64,))), eps=1e-6),
                 b.param("lin", TensorType("f32", (32, 64))))
    b.ret(b.softmax(y, axis=-1))
    m.add_function(fn)
    return m


@pytest.mark.parametrize("target", ["rocm", "vulkan-spirv", "metal-spirv"])
def test_offline_iree_targets_build(target, tmp_path):
    from k3ir.backends.mlir.config import mlir_config
    text, _ = emit_mlir(_small_module(), ["forward"])
    with mlir_config(cache=str(tmp_path)):
        vmfb = compile_mlir(text, target)
    assert vmfb[:2] == b"PK" and b"IREE" in vmfb[:256]               # an IREE VM flatbuffer archive


def test_unknown_iree_target_is_a_clear_error():
    text, _ = emit_mlir(_small_module(), ["forward"])
    with pytest.raises(k3ir.K3BackendError, match="unknown IREE target"):
        compile_mlir(text, "tpu")


def test_a_group_compiled_on_first_use_takes_the_forms_the_executable_was_built_with(tmp_path):
    """An executable built under ``mlir_config(linear_form="generic")`` and first run outside that scope compiles the
    generic text (the IREE cache then holds exactly the module of that text, none of the default form)."""
    from k3ir.backends import get_backend
    from k3ir.backends.mlir.config import mlir_config
    m = _small_module()
    with mlir_config(cache=str(tmp_path)):
        with mlir_config(linear_form="generic"):
            exe = get_backend("mlir").build(m, "float32", "cpu")
            text, _ = emit_mlir(m, ["forward"])
        rng = np.random.default_rng(4)
        w, lin = 1 + 0.1 * rng.standard_normal(64), rng.standard_normal((32, 64)) / 8
        exe.prepare_params({"w": w, "lin": lin})
        x = rng.standard_normal((2, 3, 64))
        (got,) = exe.run("forward", [x.astype(np.float32)], {})
        files = list((tmp_path / "iree").glob("*.vmfb"))
        assert len(files) == 1 and compile_mlir(text, "llvm-cpu") == files[0].read_bytes()
    h = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w @ lin.T
    want = np.exp(h - h.max(-1, keepdims=True))
    assert rel_err(got, want / want.sum(-1, keepdims=True)) < 1e-5


def test_parameter_globals_with_data_tiling_equal_arguments_and_rebind_per_params_dict(tmp_path):
    """``MlirConfig(param_form="globals", data_tiling=True)`` (the default) and ``("arguments", False)`` (the form
    before) give the same outputs on the same weights, both equal to numpy in float64 within 1e-5; data tiling is in
    the IREE cache key (a second module); a ``run`` with another prepared params dict rebinds the globals to it, and
    the first dict again to the first weights; a module bound before ``prepare_params`` is a one-line error."""
    from k3ir.backends import get_backend
    from k3ir.backends.mlir.config import mlir_config
    m = _contractions_module()
    rng = np.random.default_rng(11)
    w1, v1 = rng.standard_normal((32, 64)) / 8, rng.standard_normal((32, 16)) / 4
    w2, v2 = rng.standard_normal((32, 64)) / 8, rng.standard_normal((32, 16)) / 4
    x, a, c = rng.standard_normal((2, 7, 64)), rng.standard_normal((2, 7, 4, 8)), rng.standard_normal((2, 7, 8, 5))
    ins = [t.astype(np.float32) for t in (x, a, c)]
    with mlir_config(cache=str(tmp_path)):
        with pytest.raises(k3ir.K3BackendError, match="no weights for"):
            get_backend("mlir").build(m, "float32", "cpu").run("forward", ins, {})
        outs = {}
        for form, tiled in (("globals", True), ("arguments", False)):
            with mlir_config(param_form=form, data_tiling=tiled):
                exe = get_backend("mlir").build(m, "float32", "cpu")
            p1 = exe.prepare_params({"w": w1, "v": v1})
            p2 = exe.prepare_params({"w": w2, "v": v2})
            outs[form] = [exe.run("forward", ins, p)[0] for p in (p1, p2, p1)]
        assert len(list((tmp_path / "iree").glob("*.vmfb"))) == 2
    for form, (o1, o2, o1again) in outs.items():
        assert rel_err(o1, x @ w1.T @ v1) < 1e-5 and rel_err(o2, x @ w2.T @ v2) < 1e-5, form
        assert np.array_equal(o1, o1again), form
    assert rel_err(outs["globals"][0], outs["arguments"][0]) < 1e-6


def _contractions_module() -> Module:
    """``@forward(x [B,T,64], a [B,T,4,8], c [B,T,8,5])``: a ``k3.linear`` (weight ``[32,64]``), a ``k3.matmul`` by
    a 2-D parameter ``[32,16]``, a batched ``k3.matmul`` of equal batch dims and an ``k3.einsum`` (always generic)."""
    m = Module("contractions")
    fn = Function("forward")
    b = Builder(m, fn)
    x = b.arg("x", TensorType("f32", ("B", "T", 64)))
    a, c = b.arg("a", TensorType("f32", ("B", "T", 4, 8))), b.arg("c", TensorType("f32", ("B", "T", 8, 5)))
    y = b.matmul(b.linear(x, b.param("w", TensorType("f32", (32, 64)))), b.param("v", TensorType("f32", (32, 16))))
    b.ret(y, b.matmul(a, c), b.einsum(a, c, equation="btij,btjk->btik"))
    m.add_function(fn)
    return m


@pytest.mark.parametrize("form", ["matmul", "generic"])
def test_weight_contractions_as_named_matmuls_over_collapsed_rows(form, tmp_path):
    """``MlirConfig.linear_form``: ``matmul`` collapses the leading dims (dynamic B, T) into rows and runs the named
    ``linalg.matmul`` (the ``[N,K]`` weight through the transposed-B map) and ``linalg.batch_matmul`` (equal batch
    dims), the einsum stays generic; ``generic`` emits no named contraction. The text differs, so the IREE cache
    keys (by the text) differ; both equal numpy in float64 within 1e-5 for two (B, T); an unknown form is a
    K3ConfigError."""
    from k3ir.backends import get_backend
    from k3ir.backends.mlir.config import mlir_config
    m = _contractions_module()
    with mlir_config(linear_form=form, cache=str(tmp_path)):
        text, _ = emit_mlir(m, ["forward"])
        exe = get_backend("mlir").build(m, "float32", "cpu")
        if form == "matmul":
            assert text.count("linalg.matmul") == 2 and text.count("linalg.batch_matmul") == 1
            assert text.count("affine_map<(m, n, k) -> (n, k)>") == 1          # the weight [32, 64] as stored
            assert "tensor.collapse_shape %a0 [[0, 1], [2]] : tensor<?x?x64xf32> into tensor<?x64xf32>" in text
            assert text.count("linalg.generic") == 1                            # the einsum
            with mlir_config(linear_form="generic"):
                assert emit_mlir(m, ["forward"])[0] != text
        else:
            assert "linalg.matmul" not in text and "linalg.batch_matmul" not in text
    rng = np.random.default_rng(5)
    w, v = rng.standard_normal((32, 64)) / 8, rng.standard_normal((32, 16)) / 4
    exe.prepare_params({"w": w, "v": v})
    for B, T in ((2, 7), (1, 1)):
        x, a, c = rng.standard_normal((B, T, 64)), rng.standard_normal((B, T, 4, 8)), rng.standard_normal((B, T, 8, 5))
        got = [exe.to_numpy(o) for o in exe.run("forward", [t.astype(np.float32) for t in (x, a, c)], {})]
        assert got[0].shape == (B, T, 16) and got[1].shape == (B, T, 4, 5)
        assert rel_err(got[0], x @ w.T @ v) < 1e-5 and rel_err(got[1], a @ c) < 1e-5 and rel_err(got[2], a @ c) < 1e-5
    with pytest.raises(k3ir.K3ConfigError, match="linear_form"), mlir_config(linear_form="named"):
        pass


def _kda_module(H: int, K: int, V: int, scale: float) -> Module:
    """``@forward(q, k, v, g, beta, state)`` -> (o, state) of one ``k3.kda`` with a symbolic batch and length."""
    from k3ir.types import StateType
    m = Module("kda")
    fn = Function("forward")
    b = Builder(m, fn)
    f32 = lambda *shape: TensorType("f32", shape)
    q, k = b.arg("q", f32("B", "T", H, K)), b.arg("k", f32("B", "T", H, K))
    v, g = b.arg("v", f32("B", "T", H, V)), b.arg("g", f32("B", "T", H, K))
    beta, s = b.arg("beta", f32("B", "T", H)), b.arg("s", StateType("kda_state", (H, K, V)))
    o, s1 = b.op("k3.kda", q, k, v, g, beta, s, scale=scale)
    b.ret(o, s1)
    m.add_function(fn)
    return m


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_chunked_kda_equals_the_recurrence_from_a_nonzero_state(gate):
    """k3.kda in MLIR's chunked form (chunks of 16, zero padding) from a random state, lengths on both sides of
    the chunk boundaries (1, 15, 16, 17, 40 in one build): output and final state equal the float64 recurrence
    (SPEC.md 11: float32 within 1e-5)."""
    from k3ir.backends import get_backend

    from k3ir.ops.kda import kda_recurrent
    text, _ = emit_mlir(_kda_module(2, 16, 8, 0.25), ["forward"])
    assert "tensor.pad" in text and "arith.ceildivui" in text                     # the chunked form, not the scan
    exe = get_backend("mlir").build(_kda_module(2, 16, 8, 0.25), "float32", "cpu")
    exe.prepare_params({})
    rng = np.random.default_rng(5)
    for T in (1, 15, 16, 17, 40):
        q, k = (a / np.linalg.norm(a, axis=-1, keepdims=True) for a in rng.standard_normal((2, 2, T, 2, 16)))
        v, z = rng.standard_normal((2, T, 2, 8)), rng.standard_normal((2, T, 2, 16))
        g = -5 / (1 + np.exp(-z)) if gate == "lower_bound" else -np.logaddexp(0, z)
        beta = 1 / (1 + np.exp(-rng.standard_normal((2, T, 2))))
        s0 = rng.standard_normal((2, 2, 16, 8)) * 0.5
        o, s1 = (exe.to_numpy(a) for a in exe.run("forward", [a.astype(np.float32) for a in (q, k, v, g, beta, s0)], {}))
        want_o, want_s = kda_recurrent(q, k, v, g, beta, 0.25, s0)
        assert rel_err(o, want_o) < 1e-5 and rel_err(s1, want_s) < 1e-5, T


@pytest.mark.parametrize("form", ["taps", "decomposed"])
def test_short_conv_forms_equal_the_reference_with_symbolic_length_and_state(form):
    """k3.short_conv (weight [C,1,4], SiLU) with a symbolic batch and length and a random state: ``conv_form="taps"``
    (one generic reading the history-extended input at the tap offsets, no per-tap slice) and ``"decomposed"``
    equal the op's float64 reference (SPEC.md 11: float32 within 1e-5) for T = 1, 2, 3 (shorter than the history),
    9; an unknown form is a K3ConfigError."""
    from k3ir.backends import get_backend
    from k3ir.backends.mlir.config import mlir_config

    from k3ir.opdef import instantiate
    from k3ir.types import StateType
    m = Module("conv")
    fn = Function("forward")
    b = Builder(m, fn)
    x, w = b.arg("x", TensorType("f32", ("B", "T", 6))), b.arg("w", TensorType("f32", (6, 1, 4)))
    y, s1 = b.op("k3.short_conv", x, w, b.arg("s", StateType("conv_state", (6, 3))), activation="silu")
    b.ret(y, s1)
    m.add_function(fn)
    with mlir_config(conv_form=form):
        text, _ = emit_mlir(m, ["forward"])
        exe = get_backend("mlir").build(m, "float32", "cpu")
        exe.prepare_params({})
        history_slices = len(re.findall(r"tensor\.extract_slice %cat\d+\[", text))  # slices of history + x
        assert history_slices == (1 if form == "taps" else 5)           # taps: the new state's rows only; else + 4 taps
        rng = np.random.default_rng(7)
        ref = instantiate(next(op for op in fn.ops if op.name == "k3.short_conv"))
        for T in (1, 2, 3, 9):
            xs, ws, st = rng.standard_normal((2, T, 6)), rng.standard_normal((6, 1, 4)), rng.standard_normal((2, 6, 3))
            got = [exe.to_numpy(a) for a in exe.run("forward", [a.astype(np.float32) for a in (xs, ws, st)], {})]
            want = ref.reference(xs, ws, st)
            assert rel_err(got[0], want[0]) < 1e-5 and rel_err(got[1], want[1]) < 1e-5, T
    with pytest.raises(k3ir.K3ConfigError, match="conv_form"), mlir_config(conv_form="direct"):
        pass


def test_prefill_text_chunks_kda_and_sorts_expert_rows_and_keeps_the_earlier_forms():
    """Default MlirConfig: prefill's KDA layers are padded to chunks (``tensor.pad``) and the MoE runs per expert on
    slices of the sorted rows (no ``[B,T,E,I]`` all-expert tensor); decode keeps the recurrence step;
    ``kda_form="scan"``/``moe_form="dense"`` give the earlier lowering back; an unknown form is a K3ConfigError."""
    from k3ir.backends.mlir.config import mlir_config
    m, *_ = _sessions("k3-tiny")
    E, I = next(p.type.shape[:2] for n, p in m.params.items() if n.endswith("experts.{e}.w1.weight"))
    dense = f"x{E}x{I}xf32>"
    pre, _ = emit_mlir(m, ["prefill"])
    dec, _ = emit_mlir(m, ["decode"])
    kda_layers = len(m.attrs["kda_layers"])
    assert pre.count("tensor.pad") == 5 * kda_layers and "tensor.pad" not in dec
    assert dense not in pre and dense not in dec
    assert pre.count("tensor.extract_slice") > 3 * E
    with mlir_config(moe_form="dense", kda_form="scan"):
        old, _ = emit_mlir(m, ["prefill"])
    assert "tensor.pad" not in old and dense in old
    with pytest.raises(k3ir.K3ConfigError, match="moe_form"), mlir_config(moe_form="grouped"):
        pass


@pytest.mark.slow
@pytest.mark.parametrize("key", ["k3-tiny", "kimi-linear-tiny", "k3-tiny-mxfp4"])
def test_prefill_lengths_and_16_decode_steps_match_reference_and_torch(key):
    """IREE llvm-cpu (chunked KDA, sorted MoE; packed MXFP4 experts for ``k3-tiny-mxfp4``) against the float64
    reference for T in {1, 17, 65, 130}, then 16 greedy decode steps carrying the state from T=130: logits within
    1e-4, greedy tokens equal torch's."""
    m, params, ref, _, sess = _sessions(key)
    torch = Session(k3ir.compile(m, target="torch", passes=_passes(key)), params=params)
    for T in (1, 17, 65, 130):
        ids = token_ids(m.attrs["vocab_size"], 2, T)
        got, st = sess.prefill(ids)
        want, wst = ref.prefill(ids)
        assert rel_err(got.double().numpy(), want.double().numpy()) < 1e-4, T
    tst = torch.prefill(ids)[1]
    nxt = got.double().numpy()[:, -1].argmax(-1).reshape(-1, 1)
    for step in range(16):
        got, st = sess.decode(nxt, st)
        want, wst = ref.decode(nxt, wst)
        tl, tst = torch.decode(nxt, tst)
        assert rel_err(got.double().numpy(), want.double().numpy()) < 1e-4, step
        nxt = got.double().numpy()[:, -1].argmax(-1).reshape(-1, 1)
        assert np.array_equal(nxt, tl.double().numpy()[:, -1].argmax(-1).reshape(-1, 1)), step


def _grouped_mxfp4_module(E: int, N: int, K: int, rows: str) -> Module:
    """``@forward(x [rows,K], offsets i64[E+1])`` -> one ``k3.grouped_matmul`` with packed MXFP4 weights ``w`` and E8M0
    scales ``s`` (parameters); ``rows`` names the row dim (``T`` in it: a prompt's rows)."""
    m = Module("grouped")
    fn = Function("forward")
    b = Builder(m, fn)
    y = b.op("k3.grouped_matmul", b.arg("x", TensorType("f32", (rows, K))), b.arg("o", TensorType("i64", (E + 1,))),
             b.param("w", TensorType("mxfp4", (E, N, K))), b.param("s", TensorType("u8", (E, N, K // 32))), quant="mxfp4")
    b.ret(y)
    m.add_function(fn)
    return m


@pytest.mark.parametrize("rows", ["T", "B"])
def test_grouped_matmul_keeps_mxfp4_packed_and_dequantises_per_expert(rows):
    """k3.grouped_matmul with MXFP4 weights: the MLIR takes the stored bytes as ``i4[E,N,K]`` codes (two a byte, low
    nibble first, IREE's packing) and the scale bytes as ``i8[E,N,K/32]`` (no float ``[E,N,K]`` tensor anywhere);
    prompt rows (``T``) get each expert's matrix dequantised by one elementwise generic before its contraction, the
    rows of a one-token step (``B``) decode each weight inside the contraction (one 4-loop generic reading codes and
    scales). Every byte value (all 16 codes in both nibbles) and scale bytes 0 (the subnormal 2^-127), 1, 110..140
    run through IREE; segments that skip rows (before offsets[0], after offsets[E]) give zero rows, an empty expert
    none: equal to the float64 reference (``k3ir.quant``'s decoder) within the float32 tolerance (SPEC.md 11)."""
    from k3ir.backends import get_backend

    from k3ir.opdef import instantiate
    E, N, K, R = 4, 16, 64, 11
    rng = np.random.default_rng(8)
    packed = rng.integers(0, 256, size=(E, N, K // 2)).astype(np.uint8)
    packed.reshape(-1)[:256] = np.arange(256)                      # every pair of codes at least once
    scales = rng.integers(110, 141, size=(E, N, K // 32)).astype(np.uint8)
    scales[0, 0, 0] = 0
    scales[1, 2, 1] = 1
    m = _grouped_mxfp4_module(E, N, K, rows)
    text, order = emit_mlir(m, ["forward"], param_form="arguments")
    head = next(ln for ln in text.splitlines() if "func.func @forward" in ln)
    assert order["forward"] == ["w", "s"]
    assert f"%p0: tensor<{E}x{N}x{K}xi4>" in head and f"%p1: tensor<{E}x{N}x{K // 32}xi8>" in head
    floats = text.replace(f"?x{K}xf32>", "").replace(f"tensor<{N}x{K}xf32>", "")
    assert f"x{K}xf32>" not in floats                                  # the rows [?, K] and one expert's [N, K]
    assert f"{E}x{N}x{K}xf32" not in text
    if rows == "T":                                                    # matrix dequantised blocked, viewed [N, K]
        assert text.count(f"tensor<{N}x{K // 32}x32xf32> into tensor<{N}x{K}xf32>") == E
        assert text.count("linalg.matmul") == E
    generics = [ln for ln in text.splitlines() if "linalg.generic" in ln and "xi4>" in ln]
    assert len(generics) == E
    assert all(('"reduction"' in g) == (rows == "B") for g in generics), generics[0]
    exe = get_backend("mlir").build(m, "float32", "cpu")
    exe.prepare_params({"w": packed, "s": scales})
    want_fn = instantiate(m.functions["forward"].ops[-1]).reference
    x = rng.standard_normal((R, K))
    for offsets in ([0, 3, 3, 8, 11], [2, 5, 5, 9, 10]):              # all rows; rows 0, 1 and 10 in no segment
        offsets = np.array(offsets, dtype=np.int64)
        (got,) = exe.run("forward", [x.astype(np.float32), offsets], {})
        want = want_fn(x, offsets, packed, scales)
        assert rel_err(exe.to_numpy(got), want) < 1e-5, offsets
        if offsets[0]:
            assert not np.asarray(got)[:2].any() and not np.asarray(got)[10:].any()


def test_mxfp4_model_text_reads_expert_matrices_whole_never_per_token():
    """k3-tiny with ``--quantize mxfp4`` (the fused MoE form) emits: every routed-expert argument is a packed
    tensor (``i4`` codes, ``i8`` scales), read only by ``tensor.extract_slice %p[x, 0, 0] [1, ...]`` with a constant expert x (one whole
    matrix per expert, never a per-token gather), once per expert and matrix in prefill and decode; the float
    ``k3.moe`` form reads its expert weights the same way."""
    for key in ("k3-tiny-mxfp4", "k3-tiny"):
        m, _, _, exe, _ = _sessions(key)
        E = m.attrs["num_experts"]
        for fn in ("prefill", "decode"):
            text, order = emit_mlir(exe.module, [fn], param_form="arguments")
            experts = {f"%p{i}": n for i, n in enumerate(order[fn]) if ".experts." in n and "shared" not in n}
            layers = sum(op.name in ("k3.moe", "k3.moe_dispatch") for op in exe.module.functions[fn].ops)
            assert layers and len(experts) == (6 if key.endswith("mxfp4") else 3) * layers, (key, fn)
            head = next(ln for ln in text.splitlines() if f"func.func @{fn}" in ln)
            for p, name in experts.items():
                arg_type = re.search(rf"{p}: (tensor<[^>]*>)", head).group(1)
                assert arg_type.endswith(("xi4>", "xi8>")) == key.endswith("mxfp4"), (name, arg_type)
                uses = [ln for ln in text.splitlines() if re.search(rf"{p}\b", ln) and "func.func" not in ln]
                starts = sorted(int(re.search(rf"{p}\[(\d+), 0, 0\] \[1,", u).group(1)) for u in uses)
                assert starts == list(range(E)), (key, fn, name, uses[:2])


def _bf16_round(params: dict, module: Module) -> dict:
    """``params`` with the values of bf16-declared parameters rounded to bf16 (as a bf16 checkpoint holds them)."""
    import ml_dtypes
    return {k: np.asarray(v).astype(ml_dtypes.bfloat16).astype(np.float64) if module.params[k].type.dtype == "bf16"
            else v for k, v in params.items()}


def test_bf16_weights_are_bf16_arguments_widened_where_read(tmp_path):
    """``MlirConfig.weights="bf16"``: the bf16-declared parameters (embedding table, projection, norm weight) are
    ``bf16`` arguments, the f32-declared one stays f32; the gather and the contraction widen per element, the norm
    weight is widened once; the result equals the float64 reference on the bf16-rounded weights (SPEC.md 11:
    1e-5); the executable rounds float32 weights itself, and an artifact reopens with the same argument types."""
    from k3ir.backends import get_backend
    from k3ir.backends.mlir.config import mlir_config
    m = Module("bf16")
    fn = Function("forward")
    b = Builder(m, fn)
    ids = b.arg("ids", TensorType("i64", ("B", "T")))
    h = b.embedding(ids, b.param("emb", TensorType("bf16", (50, 64))))
    h = b.rmsnorm(h, b.param("norm", TensorType("bf16", (64,))), eps=1e-6)
    y = b.linear(h, b.param("proj", TensorType("bf16", (32, 64))))
    b.ret(b.add(y, b.param("bias", TensorType("f32", (32,)))))
    m.add_function(fn)
    rng = np.random.default_rng(2)
    params = {"emb": rng.standard_normal((50, 64)), "norm": 1 + 0.1 * rng.standard_normal(64),
              "proj": rng.standard_normal((32, 64)) / 8, "bias": rng.standard_normal(32)}
    text, order = emit_mlir(m, ["forward"], weights="bf16", param_form="arguments")
    head = next(ln for ln in text.splitlines() if "func.func @forward" in ln)
    types = dict(zip(order["forward"], re.findall(r"%p\d+: (tensor<[^>]*>)", head)))
    assert types == {"emb": "tensor<50x64xbf16>", "norm": "tensor<64xbf16>", "proj": "tensor<32x64xbf16>",
                     "bias": "tensor<32xf32>"}
    assert text.count("arith.extf") == 2          # in the gather, the norm weight once
    mm = [ln for ln in text.splitlines() if "linalg.matmul" in ln]       # the named op widens where it reads
    assert len(mm) == 1 and "tensor<?x64xf32>, tensor<32x64xbf16>)" in mm[0]
    with mlir_config(linear_form="generic"):                            # and the generic contraction in its body
        assert emit_mlir(m, ["forward"], weights="bf16")[0].count("arith.extf") == 3
    assert "xbf16>" not in emit_mlir(m, ["forward"], weights="f32")[0]
    with mlir_config(weights="bf16"):
        exe = get_backend("mlir").build(m, "float32", "cpu")
    exe.prepare_params({k: v.astype(np.float32) for k, v in params.items()})
    x = rng.integers(0, 50, size=(2, 5))
    ref = get_backend("reference").build(m, "float64", "cpu")
    want = ref.run("forward", [x], ref.prepare_params(_bf16_round(params, m)))[0]
    (got,) = exe.run("forward", [x], {})
    assert rel_err(exe.to_numpy(got), np.asarray(want)) < 1e-5
    full = ref.run("forward", [x], ref.prepare_params(params))[0]
    assert rel_err(exe.to_numpy(got), np.asarray(full)) > 1e-4          # the rounding is real: bf16, not f32
    exe.save(str(tmp_path / "art"), params={k: v.astype(np.float32) for k, v in params.items()})
    assert json.loads((tmp_path / "art" / "manifest.json").read_text())["weights"] == "bf16"
    loaded = Session.load(str(tmp_path / "art"))
    assert loaded.exe.weights == "bf16"
    again = loaded.exe.run("forward", [x], loaded.params)[0]
    assert np.array_equal(loaded.exe.to_numpy(again), exe.to_numpy(got))


@pytest.mark.slow
def test_k3_tiny_with_bf16_weights_matches_the_reference_on_bf16_rounded_weights():
    """k3-tiny through IREE with ``MlirConfig.weights="bf16"`` (every bf16-declared weight a bf16 argument): prefill
    T=17 and 4 greedy decode steps within 1e-4 of the float64 reference fed the same bf16-rounded weights."""
    from k3ir.backends.mlir.config import mlir_config
    m = load_tiny("k3-tiny")
    params = _bf16_round(init_params(m, seed=3), m)
    with mlir_config(weights="bf16"):
        sess = Session(k3ir.compile(m, target="mlir"), params=params)
    ref = Session(k3ir.compile(m, target="reference", dtype="float64"), params=params)
    ids = token_ids(m.attrs["vocab_size"], 2, 17)
    (got, st), (want, wst) = sess.prefill(ids), ref.prefill(ids)
    assert rel_err(got.double().numpy(), want.double().numpy()) < 1e-4
    for step in range(4):
        nxt = want.double().numpy()[:, -1].argmax(-1).reshape(-1, 1)
        (got, st), (want, wst) = sess.decode(nxt, st), ref.decode(nxt, wst)
        assert rel_err(got.double().numpy(), want.double().numpy()) < 1e-4, step



def test_logits_to_keep_slices_the_heads_input_in_the_text():
    """``MlirConfig.logits_to_keep=1``: the head reads ``x[:, T-1:T]`` (one ``tensor.extract_slice`` to
    ``[B,1,D]``) and prefill returns ``[B,1,V]``; 0 (the default) has no such slice; 2 is a config error."""
    from k3ir.backends.mlir.config import mlir_config

    from k3ir.errors import K3ConfigError
    m = load_tiny("k3-tiny")
    D, V = m.attrs["hidden_size"], m.attrs["vocab_size"]
    head = rf"tensor\.extract_slice %[\w#]+\[0, %\w+, 0\] \[%\w+, 1, {D}\] \[1, 1, 1\] : tensor<\?x\?x{D}xf32> to"
    with mlir_config(logits_to_keep=1):
        last, _ = emit_mlir(k3ir.compile(m, target="mlir").module, ("prefill",))
    every, _ = emit_mlir(k3ir.compile(m, target="mlir").module, ("prefill",))
    assert len(re.findall(head, last)) == 1 and not re.findall(head, every)
    sig = lambda text: next(ln for ln in text.splitlines() if "func.func @prefill" in ln)
    assert f"tensor<?x1x{V}xf32>" in sig(last) and f"tensor<?x?x{V}xf32>" in sig(every)
    with pytest.raises(K3ConfigError, match="logits_to_keep=2"), mlir_config(logits_to_keep=2):
        pass


@pytest.mark.slow
def test_logits_to_keep_runs_the_head_on_the_last_position_only(tmp_path):
    """``MlirConfig.logits_to_keep=1`` compiled by IREE: the prefill's logits are ``[B,1,V]``, the float64 reference's
    last row within 1e-4; two decode steps from its state match the reference's; the artifact records the setting."""
    from k3ir.backends.mlir.config import mlir_config
    m, params, ref, *_ = _sessions("k3-tiny")
    ids = token_ids(m.attrs["vocab_size"], 2, 9)
    with mlir_config(logits_to_keep=1):
        exe = k3ir.compile(m, target="mlir")
        sess = Session(exe, params=params)
        got, state = sess.prefill(ids)
        want, ref_state = ref.prefill(ids)
        assert tuple(got.shape) == (2, 1, m.attrs["vocab_size"])
        assert rel_err(got.double().numpy(), want.double().numpy()[:, -1:]) < 1e-4
        for step in range(2):
            nxt = token_ids(m.attrs["vocab_size"], 2, 1, seed=11 + step)
            got, state = sess.decode(nxt, state)
            want, ref_state = ref.decode(nxt, ref_state)
            assert rel_err(got.double().numpy(), want.double().numpy()) < 1e-4
        exe.save(str(tmp_path / "art"))
    assert json.loads((tmp_path / "art" / "manifest.json").read_text())["logits_to_keep"] == 1
