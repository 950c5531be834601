"""ONNX opset 27 (KDA as ``LinearAttention``, the short conv as ``CausalConvWithState``, RMSNorm as
``RMSNormalization``, MLA through ``Attention``) and opset 20 (the ``Scan`` lowering) against the
float64 reference: single ops, then whole tiny models (prefill, 16 decode steps, greedy tokens)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from _tiny_models import load_tiny, token_ids
from conftest import rel_err
from k3ir.backends.onnx.export import OnnxExporter, check_opset, default_opset
from k3ir.runtime import Session
from k3ir.runtime.params import init_params

import k3ir
from k3ir.builder import Builder
from k3ir.ir import Function, Module
from k3ir.opdef import instantiate
from k3ir.ops.kda import kda_recurrent
from k3ir.ops.mla import mla_ref
from k3ir.types import StateType, TensorType

MXFP4 = ["fuse-moe-dispatch", "quantize-experts{format=mxfp4}", "dce"]


def _one_op(opname: str, args: list[tuple[str, object]], attrs: dict) -> Module:
    """A module whose ``@f`` applies ``opname`` to its arguments (name, IR type) and returns its results."""
    m = Module("t")
    fn = Function("f")
    b = Builder(m, fn)
    out = b.op(opname, *[b.arg(n, t) for n, t in args], **attrs)
    b.ret(*(out if isinstance(out, tuple) else (out,)))
    m.add_function(fn)
    k3ir.verify_module(m)
    return m


def _run(m: Module, feeds: dict, opset: int = 27):
    model = OnnxExporter(m, weights="inputs", opset=opset).export_function("f")
    onnx.checker.check_model(model, full_check=True)
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return model, s.run(None, {k: np.asarray(v, np.float32) if np.asarray(v).dtype.kind == "f" else v
                               for k, v in feeds.items()})


def test_linear_attention_scale_is_set_explicitly():
    """scale 0.5 with d_k 16, where LinearAttention's default (1/sqrt(d_k) = 0.25) differs: the node
    carries 0.5 and the output and state match the float64 recurrence from a nonzero state."""
    rng = np.random.default_rng(0)
    B, T, H, K, V = 2, 7, 2, 16, 8
    q, k = (a / np.linalg.norm(a, axis=-1, keepdims=True) for a in rng.standard_normal((2, B, T, H, K)))
    v = rng.standard_normal((B, T, H, V))
    g = -np.abs(rng.standard_normal((B, T, H, K))) * 0.3
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    s0 = rng.standard_normal((B, H, K, V)) * 0.5
    f32 = lambda *shape: TensorType("f32", shape)
    m = _one_op("k3.kda", [("q", f32(B, T, H, K)), ("k", f32(B, T, H, K)), ("v", f32(B, T, H, V)),
                           ("g", f32(B, T, H, K)), ("beta", f32(B, T, H)), ("s", StateType("kda_state", (H, K, V)))],
                {"scale": 0.5})
    model, (o, s1) = _run(m, {"q": q, "k": k, "v": v, "g": g, "beta": beta, "s": s0})
    (node,) = [n for n in model.graph.node if n.op_type == "LinearAttention"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["scale"] == 0.5 and attrs["update_rule"] == b"gated_delta"
    want_o, want_s = kda_recurrent(q, k, v, g, beta, 0.5, s0)
    assert rel_err(o, want_o) < 1e-5 and rel_err(s1, want_s) < 1e-5
    assert rel_err(o, kda_recurrent(q, k, v, g, beta, 0.25, s0)[0]) > 0.1      # the conventions differ here


def test_causal_conv_with_state_carries_history():
    """k3.short_conv (SiLU) from a nonzero conv state ``[B,C,K-1]``: output and new state equal the reference."""
    rng = np.random.default_rng(1)
    B, T, C, W = 2, 3, 6, 4                        # T < K-1: part of the new state is old history
    x, w, s0 = rng.standard_normal((B, T, C)), rng.standard_normal((C, 1, W)), rng.standard_normal((B, C, W - 1))
    m = _one_op("k3.short_conv", [("x", TensorType("f32", (B, T, C))), ("w", TensorType("f32", (C, 1, W))),
                                  ("s", StateType("conv_state", (C, W - 1)))], {})
    model, (y, s1) = _run(m, {"x": x, "w": w, "s": s0})
    assert "CausalConvWithState" in {n.op_type for n in model.graph.node}
    want_y, want_s = instantiate(m.functions["f"].ops[0]).reference(x, w, s0)
    assert rel_err(y, want_y) < 1e-5 and rel_err(s1, want_s) < 1e-6


@pytest.mark.parametrize("absorbed", [False, True])
def test_mla_through_attention_with_cache_and_lengths(absorbed):
    """k3.mla as ONNX Attention after a right-padded cache (row 0 holds 2 valid entries of 5):
    the causal offset and the padding mask match the float64 reference."""
    rng = np.random.default_rng(2)
    B, T, L, H, n, r, vd, R = 2, 3, 5, 2, 8, 4, 6, 10
    q, kv = rng.standard_normal((B, T, H, n + r)), rng.standard_normal((B, T, R + r))
    w, cache = rng.standard_normal((H * (n + vd), R)) * 0.3, rng.standard_normal((B, L, R + r))
    lengths = np.array([2, 5], np.int64)
    attrs = {"heads": H, "nope": n, "rope": r, "v_dim": vd, "scale": 0.3, "absorbed": absorbed}
    m = _one_op("k3.mla", [("q", TensorType("f32", (B, T, H, n + r))), ("kv", TensorType("f32", (B, T, R + r))),
                           ("w", TensorType("f32", (H * (n + vd), R))), ("c", StateType("mla_cache", (R, r))),
                           ("lengths", TensorType("i64", (B,)))], attrs)
    model, (o, full) = _run(m, {"q": q, "kv": kv, "w": w, "c": cache, "lengths": lengths})
    assert "Attention" in {n.op_type for n in model.graph.node}
    want_o, want_full = mla_ref(q, kv, w, cache, lengths=lengths, **attrs)
    assert rel_err(o, want_o) < 1e-5 and rel_err(full, want_full) < 1e-7


def test_default_opset_and_bad_opset():
    assert default_opset() == 27                    # onnxruntime >= 1.32 is installed (the onnx extra's pin)
    assert check_opset(20) == 20
    with pytest.raises(k3ir.K3BackendError, match="opset 27 or 20, not 21"):
        check_opset(21)


def test_opset27_graph_uses_standard_sequence_ops_and_opset20_scans():
    m = load_tiny("kimi-linear-tiny")
    n_kda = len(m.attrs["kda_layers"])
    for fn in ("prefill", "decode"):
        ops27 = Counter(n.op_type for n in OnnxExporter(m, weights="inputs").export_function(fn).graph.node)
        assert ops27["LinearAttention"] == n_kda and ops27["CausalConvWithState"] == 3 * n_kda
        assert ops27["Attention"] == 1 and ops27["RMSNormalization"] > 0 and ops27["Scan"] == 0
        ops20 = Counter(n.op_type for n in OnnxExporter(m, weights="inputs", opset=20).export_function(fn).graph.node)
        assert ops20["Scan"] == n_kda and not {"LinearAttention", "CausalConvWithState", "Attention"} & set(ops20)


def test_full_k3_export_cli_holds_69_linear_attention_nodes(tmp_path, capsys):
    from k3ir.cli import main
    out = tmp_path / "k3.onnx"
    assert main(["export", "kimi-k3", "--format", "onnx", "--weights", "inputs", "-o", str(out)]) == 0
    assert "opset 27" in capsys.readouterr().out
    onnx.checker.check_model(str(out))
    model = onnx.load(str(out))
    assert model.opset_import[0].version == 27
    assert sum(n.op_type == "LinearAttention" for n in model.graph.node) == 69


def test_opset_flag_outside_onnx_is_a_usage_error(tmp_path, capsys):
    from k3ir.cli import main
    assert main(["export", "k3-tiny", "--format", "dot", "--opset", "20", "-o", str(tmp_path / "g.dot")]) == 2
    assert "--opset applies to --format onnx only" in capsys.readouterr().err


def _expert_weight_gathers(graph, weights: set, iteration: str | None = None):
    """(Gather node, per-expert?) for each Gather of an expert weight in ``graph`` and its bodies:
    per-expert when its index is one expert id: a scalar Constant (the sorted form's static slices) or,
    inside a Loop, a Gather of the expert list by the iteration (the loop form)."""
    made = {o: n for n in graph.node for o in n.output}
    for n in graph.node:
        if n.op_type == "Gather" and n.input[0] in weights:
            src = made.get(n.input[1])
            scalar = (src is not None and src.op_type == "Constant"
                      and onnx.numpy_helper.to_array(src.attribute[0].t).shape == ())
            by_iteration = src is not None and src.op_type == "Gather" and src.input[1] == iteration
            yield n, scalar or by_iteration
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _expert_weight_gathers(a.g, weights, a.g.input[0].name if n.op_type == "Loop" else None)


@pytest.mark.parametrize("form", ["sorted", "loop"])
@pytest.mark.parametrize("key", ["kimi-linear-tiny", "k3-tiny-mxfp4"])
def test_moe_takes_whole_expert_matrices_per_expert_never_per_token(key, form):
    """The routed experts (k3.moe, and k3.grouped_matmul with MXFP4 experts) read each expert's matrix
    whole, by one expert id (a constant in the sorted form, the loop's expert id in the loop form), never
    gathered per token; ``sorted``: one Gemm per expert and matrix, no Loop."""
    m = _sessions(key, 27)[3].module
    weights = {p for p in m.params if ".experts." in p}
    E = m.attrs["num_experts"]
    for fn in ("prefill", "decode"):
        model = OnnxExporter(m, weights="inputs", moe_form=form).export_function(fn)
        found = list(_expert_weight_gathers(model.graph, weights))
        assert found and all(per_expert for _, per_expert in found), fn
        assert not any(i in weights for n in model.graph.node if n.op_type != "Gather" for i in n.input)
        kinds = Counter(n.op_type for n in model.graph.node)
        if form == "sorted":
            layers = len({n.input[0].split(".experts.")[0] for n, _ in found})
            per_expert_gemms = 2 if key == "kimi-linear-tiny" else 3       # gate|up concatenated in k3.moe
            assert kinds["Loop"] == 0 and kinds["Gemm"] == per_expert_gemms * E * layers, fn
        else:
            assert kinds["Loop"] > 0 and kinds["Gemm"] == 0, fn


@pytest.mark.parametrize("form", ["sorted", "loop"])
@pytest.mark.parametrize("N", [1, 7])
def test_moe_forms_match_reference(form, N):
    """k3.moe in both forms on 8 experts, top-3, where most experts get no row (one token) or some do
    not (7 tokens, experts 6 and 7 never picked): equal to the float64 reference at the float32 tolerance."""
    rng = np.random.default_rng(4)
    D, I, E, k = 6, 5, 8, 3
    x = rng.standard_normal((1, N, D))
    idx = np.stack([rng.permutation(6)[:k] for _ in range(N)]).reshape(1, N, k)
    wts = rng.uniform(size=(1, N, k))
    ws = [rng.standard_normal((E, I, D)), rng.standard_normal((E, I, D)), rng.standard_normal((E, D, I))]
    f32 = lambda *shape: TensorType("f32", shape)
    m = _one_op("k3.moe", [("x", f32(1, N, D)), ("w", f32(1, N, k)), ("i", TensorType("i64", (1, N, k))),
                           ("w1", f32(E, I, D)), ("w3", f32(E, I, D)), ("w2", f32(E, D, I))], {"act": "situ"})
    model = OnnxExporter(m, weights="inputs", moe_form=form).export_function("f")
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = s.run(None, {"x": x.astype(np.float32), "w": wts.astype(np.float32), "i": idx,
                          **{n: w.astype(np.float32) for n, w in zip(("w1", "w3", "w2"), ws)}})
    want = instantiate(m.functions["f"].ops[-1]).reference(x, wts, idx, *ws)
    assert rel_err(got, want) < 1e-5


_SESSIONS: dict = {}


def _sessions(key: str, opset: int, ort_kernels: bool = True):
    """(module, float64 reference, torch, onnx) Sessions on the same random weights (seed 3);
    ``ort_kernels``: the onnx target's com.microsoft LinearAttention/CausalConvWithState, else the standard ops."""
    if (key, opset, ort_kernels) not in _SESSIONS:
        name, passes = (key[:-len("-mxfp4")], MXFP4) if key.endswith("-mxfp4") else (key, None)
        m = load_tiny(name)
        exe = k3ir.compile(m, target="onnx", passes=passes)
        exe.opset, exe.ort_kernels = opset, ort_kernels
        params = init_params(exe.module, seed=3)
        ref = Session(k3ir.compile(m, target="reference", dtype="float64", passes=passes), params=params)
        torch = Session(k3ir.compile(m, target="torch", passes=passes), params=params)
        _SESSIONS[key, opset, ort_kernels] = (m, ref, torch, Session(exe, params=params))
    return _SESSIONS[key, opset, ort_kernels]


def _greedy(sess, ids, steps: int):
    """Prefill ``ids`` then ``steps`` greedy decode steps: (list of float64 logits, tokens ``[B, steps]``)."""
    logits, state = sess.prefill(ids)
    out, toks = [logits.double().numpy()], []
    for _ in range(steps):
        nxt = out[-1][:, -1].argmax(-1).reshape(-1, 1).astype(np.int64)
        toks.append(nxt)
        logits, state = sess.decode(nxt, state)
        out.append(logits.double().numpy())
    return out, np.concatenate(toks, axis=1) if toks else np.zeros((ids.shape[0], 0), np.int64)


def _check_model(key: str, opset: int, T: int, steps: int, ort_kernels: bool = True):
    m, ref, torch, sess = _sessions(key, opset, ort_kernels)
    ids = token_ids(m.attrs["vocab_size"], 2, T)
    got, got_toks = _greedy(sess, ids, steps)
    _, torch_toks = _greedy(torch, ids, steps)
    assert np.array_equal(got_toks, torch_toks), f"{key} opset {opset} T={T}: greedy tokens differ from torch"
    logits, state = ref.prefill(ids)
    want = [logits.double().numpy()]
    for i in range(steps):
        logits, state = ref.decode(got_toks[:, i:i + 1], state)
        want.append(logits.double().numpy())
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) < 1e-4, f"{key} opset {opset} T={T} step {i}: rel err {rel_err(a, b):.2e}"


@pytest.mark.parametrize("key,opset,ort_kernels", [("k3-tiny", 27, True), ("k3-tiny-mxfp4", 27, True),
                                                   ("kimi-linear-tiny", 27, True), ("kimi-linear-tiny", 27, False),
                                                   ("k3-tiny", 20, False)])
def test_prefill_then_16_decode_steps_match_reference(key, opset, ort_kernels):
    _check_model(key, opset, 17, 16, ort_kernels)


@pytest.mark.slow
@pytest.mark.parametrize("opset,ort_kernels", [(27, True), (27, False), (20, False)])
@pytest.mark.parametrize("key", ["k3-tiny", "k3-tiny-mxfp4", "kimi-linear-tiny"])
def test_prefill_lengths_grid_matches_reference(key, opset, ort_kernels):
    for T in (1, 17, 65, 130):
        _check_model(key, opset, T, 16 if T == 130 else 0, ort_kernels)


def test_ort_kernels_put_the_sequence_ops_in_the_com_microsoft_domain(tmp_path, capsys):
    from k3ir.cli import main
    m = load_tiny("kimi-linear-tiny")
    model = OnnxExporter(m, weights="inputs", ort_kernels=True).export_function("decode")
    dom = {n.op_type: n.domain for n in model.graph.node if n.op_type in ("LinearAttention", "CausalConvWithState")}
    assert dom == {"LinearAttention": "com.microsoft", "CausalConvWithState": "com.microsoft"}
    assert {(o.domain, o.version) for o in model.opset_import} == {("", 27), ("com.microsoft", 1)}
    assert main(["export", "k3-tiny", "--opset", "20", "--ort-kernels", "-o", str(tmp_path / "t.onnx")]) == 2
    assert "--ort-kernels applies to --format onnx at opset 27 only" in capsys.readouterr().err


def test_describe_prints_the_state_interface_without_weights(tmp_path, capsys):
    """``k3ir export --describe``: token ids, then per KDA layer three conv states ``[B,C,K-1]`` and
    the KDA state ``[B,H,d_k,d_v]``, per MLA layer the latent cache ``[B,L,R+P]``; outputs logits
    and ``present.*``; no weights; nothing written."""
    from k3ir.cli import main
    assert main(["export", "kimi-linear-6p6b", "--describe", "--function", "decode"]) == 0
    lines = [ln.split() for ln in capsys.readouterr().out.splitlines()]
    ins = {n: (dt, shape) for kind, n, dt, *shape in lines if kind == "input"}
    outs = [n for kind, n, *_ in lines if kind == "output"]
    full = k3ir.load("kimi-linear-6p6b")
    assert ins["input_ids"] == ("int64", ["[B,", "1]"])
    assert ins["l0_kda_state"] == ("float32", ["[B,", "16,", "128,", "128]"])
    assert ins["l0_conv_q"] == ("float32", ["[B,", "2048,", "3]"])
    assert ins["l3_mla_cache"] == ("float32", ["[B,", "L,", "576]"])
    assert ins.pop("logits_to_keep") == ("int64", ["[]", "optional,", "default", "1", "(0:", "every", "position)"])
    assert len(ins) == 1 + 4 * len(full.attrs["kda_layers"]) + (full.attrs["num_hidden_layers"] - len(full.attrs["kda_layers"]))
    assert outs == ["logits"] + [f"present.{n}" for n in ins if n != "input_ids"]
    assert not list(tmp_path.iterdir())
    assert main(["export", "k3-tiny", "--format", "mlir", "--describe", "-o", str(tmp_path / "x.mlir")]) == 2
    assert "--describe applies to --format onnx only" in capsys.readouterr().err


def _default_logits_to_keep(model) -> int:
    """The file's ``logits_to_keep`` default: the ``Constant`` of the ``If`` branch taken when the input is left out."""
    branches = [a.g for n in model.graph.node if n.op_type == "If" for a in n.attribute if a.name == "else_branch"]
    (default,) = [g for g in branches if g.name == "logits_to_keep_default"]
    return int(onnx.numpy_helper.to_array(default.node[0].attribute[0].t))


@pytest.mark.parametrize("opset", [27, 20])
def test_logits_to_keep_runs_the_head_on_the_last_positions(tmp_path, capfd, opset):
    """The exported prefill's ``logits`` by default are the last position's only (``[B,1,V]``), equal to the last
    row of the float64 reference's ``[B,T,V]``; fed ``logits_to_keep`` = 3 the last three rows, fed 0 all T rows;
    the present states do not change with it; ``--logits-to-keep 0`` makes every position the file's default.
    ``logits_to_keep`` is an optional input, not an initializer: onnxruntime creates the session without a
    warning (it logs one for each initializer that is also a graph input)."""
    from k3ir.backends.onnx.export import export_onnx
    from k3ir.cli import main
    m, ref, _, _ = _sessions("k3-tiny", opset)
    params = init_params(m, seed=3)
    export_onnx(m, str(tmp_path / "p.onnx"), weights="external", params=params, opset=opset)
    model = onnx.load(str(tmp_path / "p.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert model.graph.output[0].type.tensor_type.shape.dim[1].dim_param == "T_logits"
    assert _default_logits_to_keep(model) == 1
    capfd.readouterr()
    so = ort.SessionOptions()
    so.log_severity_level = 2                                   # warnings and errors
    s = ort.InferenceSession(str(tmp_path / "p.onnx"), so, providers=["CPUExecutionProvider"])
    logged = capfd.readouterr().err
    assert "onnxruntime" not in logged, logged
    assert [i.type for i in s.get_inputs() if i.name == "logits_to_keep"] == ["optional(tensor(int64))"]
    ids = token_ids(m.attrs["vocab_size"], 2, 9)
    feeds = {"input_ids": ids}
    for spec in s.get_inputs()[1:]:
        if spec.name != "logits_to_keep":
            feeds[spec.name] = np.zeros([2 if d == "B" else (d if isinstance(d, int) else 0) for d in spec.shape],
                                        np.float32)
    want, _ = ref.prefill(ids)
    want = want.double().numpy()
    default, *states = s.run(None, feeds)
    assert default.shape == (2, 1, m.attrs["vocab_size"])
    assert rel_err(default, want[:, -1:]) < 1e-4
    three, *states3 = s.run(None, {**feeds, "logits_to_keep": np.asarray(3, np.int64)})
    every, *states0 = s.run(None, {**feeds, "logits_to_keep": np.asarray(0, np.int64)})
    assert three.shape[1] == 3 and every.shape[1] == 9
    assert rel_err(three, want[:, -3:]) < 1e-4 and rel_err(every, want) < 1e-4
    assert all(np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(states, states3, states0))
    assert main(["export", "k3-tiny", "--opset", str(opset), "--weights", "inputs", "--logits-to-keep", "0",
                 "-o", str(tmp_path / "all.onnx")]) == 0
    assert _default_logits_to_keep(onnx.load(str(tmp_path / "all.onnx"))) == 0


def test_logits_to_keep_bad_values_are_one_line_errors(capsys):
    from k3ir.cli import main

    from k3ir.errors import K3BackendError
    with pytest.raises(K3BackendError, match="logits_to_keep must be an integer >= 0"):
        OnnxExporter(load_tiny("k3-tiny"), weights="inputs", logits_to_keep=-1)
    assert main(["export", "k3-tiny", "--describe", "--logits-to-keep", "-2"]) == 2
    assert "--logits-to-keep must be >= 0" in capsys.readouterr().err


def test_docs_onnx_decode_script_gives_torchs_greedy_tokens(tmp_path):
    """docs/onnx_decode.py (bare onnxruntime: zero states, prefill, decode) on exported prefill and
    decode files produces the torch session's greedy tokens."""
    import runpy
    from pathlib import Path

    from k3ir.backends.onnx.export import export_onnx
    m, _, torch, _ = _sessions("kimi-linear-tiny", 27)
    params = init_params(m, seed=3)
    for fn in ("prefill", "decode"):
        export_onnx(m, str(tmp_path / f"{fn}.onnx"), function=fn, weights="external", params=params)
    script = runpy.run_path(str(Path(__file__).resolve().parents[3] / "docs" / "onnx_decode.py"))
    prompt = [5, 17, 42, 9]
    got = script["generate"](str(tmp_path / "prefill.onnx"), str(tmp_path / "decode.onnx"), prompt, steps=6)
    _, want = _greedy(torch, np.asarray([prompt], np.int64), 6)
    assert got == want[0].tolist()


def test_docs_onnx_decode_script_runs_one_exported_file_from_the_command_line(tmp_path):
    """``python docs/onnx_decode.py MODEL --prompt ...`` on the default export (one graph for prefill and
    decode) prints the torch session's greedy tokens, and onnxruntime (default log level) no warning; without
    MODEL it prints a usage line, no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    from k3ir.backends.onnx.export import export_onnx
    m, _, torch, _ = _sessions("kimi-linear-tiny", 27)
    export_onnx(m, str(tmp_path / "tiny.onnx"), weights="external", params=init_params(m, seed=3))
    script = str(Path(__file__).resolve().parents[3] / "docs" / "onnx_decode.py")
    r = subprocess.run(check=False, args=[sys.executable, script, str(tmp_path / "tiny.onnx"), "--prompt", "5", "17", "42", "--steps",
                        "5"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "onnxruntime" not in r.stderr, r.stderr
    _, want = _greedy(torch, np.asarray([[5, 17, 42]], np.int64), 5)
    assert r.stdout.strip() == str(want[0].tolist())
    r = subprocess.run(check=False, args=[sys.executable, script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage:" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("opset", [27, 20])
def test_float16_moe_loop_runs_and_matches_reference(opset):
    """float16 compute (onnxruntime's CPU ScatterND has no float16 add-reduction: the expert loop
    reads, adds and writes its rows instead): prefill and one decode step within 5e-3 of float64."""
    m = load_tiny("kimi-linear-tiny")
    params = init_params(m, seed=3)
    exe = k3ir.compile(m, target="onnx", dtype="float16")
    exe.opset = opset
    sess = Session(exe, params=params)
    ref = _sessions("kimi-linear-tiny", 27)[1]
    ids = token_ids(m.attrs["vocab_size"], 2, 9)
    got, st = sess.prefill(ids)
    want, wst = ref.prefill(ids)
    assert rel_err(got.double().numpy(), want.double().numpy()) < 5e-3
    nxt = ids[:, :1]
    assert rel_err(sess.decode(nxt, st)[0].double().numpy(), ref.decode(nxt, wst)[0].double().numpy()) < 5e-3


def test_mxfp4_standard_form_is_float4e2m1_with_blocked_dequantize_linear():
    """``mxfp4_form="dequantize_linear"``: the packed expert bytes typed FLOAT4E2M1 ``[E,N,K]``, the E8M0 scale bytes
    FLOAT8E8M0, one blocked DequantizeLinear (all experts: Gather/Slice take no FLOAT4E2M1), no bit unpacking; onnx's reference evaluator (onnxruntime
    1.32 has no CPU kernel for it) gives the float64 reference of k3.grouped_matmul at the float32 tolerance."""
    from onnx.reference import ReferenceEvaluator

    from k3ir import quant
    rng = np.random.default_rng(6)
    E, N, K, R = 3, 5, 64, 7
    packed, scales = quant.mxfp4_quantize(rng.standard_normal((E * N, K)))
    packed, scales = packed.reshape(E, N, K // 2), scales.reshape(E, N, K // 32)
    x, offsets = rng.standard_normal((R, K)), np.array([0, 3, 3, 7])
    m = Module("t")
    fn = Function("f")
    b = Builder(m, fn)
    y = b.op("k3.grouped_matmul", b.arg("x", TensorType("f32", ("R", K))), b.arg("o", TensorType("i64", (E + 1,))),
             b.param("w", TensorType("mxfp4", (E, N, K))), b.param("s", TensorType("u8", (E, N, K // 32))), quant="mxfp4")
    b.ret(y)
    m.add_function(fn)
    model = OnnxExporter(m, weights="embedded", params={"w": packed, "s": scales},
                         mxfp4_form="dequantize_linear").export_function("f")
    onnx.checker.check_model(model, full_check=True)
    types = {t.name: (t.data_type, list(t.dims)) for t in model.graph.initializer}
    assert types == {"w": (onnx.TensorProto.FLOAT4E2M1, [E, N, K]), "s": (onnx.TensorProto.FLOAT8E8M0, [E, N, K // 32])}
    kinds = Counter(n.op_type for n in model.graph.node)
    assert kinds["DequantizeLinear"] == 1 and kinds["BitShift"] == 0
    (got,) = ReferenceEvaluator(model).run(None, {"x": x.astype(np.float32), "o": offsets})
    want = instantiate(fn.ops[-1]).reference(x, offsets, packed, scales)
    assert rel_err(got, want) < 1e-5
    with pytest.raises(k3ir.K3BackendError, match="opset 27"):
        OnnxExporter(m, opset=20, mxfp4_form="dequantize_linear")
