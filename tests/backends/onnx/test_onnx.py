"""ONNX export and the ``onnx`` target (onnxruntime) against the float64 reference."""
from __future__ import annotations

import json

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from _tiny_models import load_tiny, prefill_decode, route_sessions, token_ids
from conftest import rel_err
from k3ir.runtime import Session
from k3ir.runtime.params import init_params

import k3ir


def _sessions(key: str):
    return route_sessions(key, "onnx")


def test_onnx_models_are_standard_and_dynamic():
    m, params, *_ = _sessions("k3-tiny")
    from k3ir.backends.onnx.export import OnnxExporter
    model = OnnxExporter(m, weights="embedded", params=params).export_function("prefill")
    onnx.checker.check_model(model, full_check=True)
    assert {o.domain for o in model.opset_import} == {""} and model.opset_import[0].version == 27
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    ids = model.graph.input[0]
    assert [d.dim_param for d in ids.type.tensor_type.shape.dim] == ["B", "T"]
    assert "LinearAttention" in {n.op_type for n in model.graph.node}   # the KDA recurrence as one standard op


def test_full_k3_structure_export_passes_checker():
    """Opset 20: every KDA layer a Scan over time (opset 27: tests/backends/onnx/test_onnx_opset27.py)."""
    m = k3ir.load("kimi-k3")
    from k3ir.backends.onnx.export import OnnxExporter
    x = OnnxExporter(m, weights="inputs", opset=20)
    model = x.export_function("prefill")
    onnx.checker.check_model(model)
    assert not model.graph.initializer                                     # structure only: no weight data
    names = {i.name for i in model.graph.input}
    assert {p for p in m.params if p.startswith("language_model.")} <= names
    assert sum(1 for n in model.graph.node if n.op_type == "Scan") == len(m.attrs["kda_layers"])
    assert "k3.moe" in x.native and "k3.kda" in x.fallback           # what `k3ir check` will list


def test_scaled_k3_with_random_weights_runs_in_onnxruntime(tmp_path):
    """The K3 config scaled down (same layer schedule for 12 layers, widths / 64) with random
    weights: the exported file with external data runs in onnxruntime and matches torch."""
    over = {"hidden_size": 64, "vision_config.text_hidden_size": 64, "num_hidden_layers": 12, "intermediate_size": 96, "moe_intermediate_size": 32,
            "routed_expert_hidden_size": 32, "num_experts": 16, "num_experts_per_token": 4,
            "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 512,
            "linear_attn_config.num_heads": 2, "linear_attn_config.head_dim": 16, "attn_res_block_size": 4,
            "linear_attn_config.full_attn_layers": [4, 8, 12],
            "linear_attn_config.kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11]}
    m = k3ir.load("kimi-k3", over)
    from k3ir.backends.onnx.export import export_onnx
    from k3ir.runtime.params import init_param
    path = str(tmp_path / "k3s.onnx")
    info = export_onnx(m, path, function="forward", weights="external")      # deterministic init, seed 0
    params = {k: init_param(m.params[k]) for k in info["params"]}             # the text model's weights only
    assert (tmp_path / "k3s.onnx.data").stat().st_size >= 4 * sum(v.size for v in params.values())
    onnx.checker.check_model(path)
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    ids = token_ids(512, 1, 9)
    (got,) = s.run(None, {"input_ids": ids, "logits_to_keep": np.asarray(0, np.int64)})     # every position
    exe = k3ir.compile(m, target="torch", passes=["dce"])                 # unquantised, like the export
    (want,) = exe.run("forward", [ids], exe.prepare_params(params))
    assert info["nodes"] > 0 and rel_err(got, want) < 1e-4


def test_artifact_save_and_session_load(tmp_path):
    m, _, _, exe, sess = _sessions("k3-tiny")
    exe.save(str(tmp_path / "art"))
    man = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert man["target"] == "onnx" and set(man["files"]) == {"forward", "prefill", "decode"}
    loaded = Session.load(str(tmp_path / "art"))
    ids = token_ids(m.attrs["vocab_size"], 1, 5)
    nxt = token_ids(m.attrs["vocab_size"], 1, 1, seed=7)
    a = prefill_decode(loaded, ids, nxt)
    b = prefill_decode(sess, ids, nxt)
    assert rel_err(a[0], b[0]) < 1e-6 and rel_err(a[1], b[1]) < 1e-6


def test_session_load_rejects_non_artifact(tmp_path):
    with pytest.raises(k3ir.K3RuntimeError, match="manifest.json"):
        Session.load(str(tmp_path))


def test_weights_inputs_mode_feeds_weights(tmp_path):
    """``weights="inputs"``: the same graph with weights fed at run time gives the same logits."""
    m, params, _, _, sess = _sessions("kimi-linear-tiny")
    from k3ir.backends.onnx.export import OnnxExporter
    model = OnnxExporter(m, weights="inputs").export_function("forward")
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = token_ids(m.attrs["vocab_size"], 2, 6)
    feeds = {"input_ids": ids, "logits_to_keep": np.asarray(0, np.int64)}                    # every position
    feeds.update({k: np.asarray(v, np.float32) for k, v in params.items()})
    (got,) = s.run(None, feeds)
    assert rel_err(got, sess.forward(ids)) < 1e-6


def test_unknown_weights_mode_is_a_clear_error():
    m, *_ = _sessions("k3-tiny")
    from k3ir.backends.onnx.export import OnnxExporter
    with pytest.raises(k3ir.K3BackendError, match="weights mode"):
        OnnxExporter(m, weights="bogus")


def test_mxfp4_experts_stay_packed_with_in_graph_dequantisation():
    """fuse-moe-dispatch + quantize-experts: the packed u8 expert weights are graph inputs /
    initializers as they are, dequantised inside the graph; logits match the reference."""
    m = load_tiny("k3-tiny")
    passes = ["fuse-moe-dispatch", "quantize-experts{format=mxfp4}", "dce"]
    exe = k3ir.compile(m, target="onnx", passes=passes)
    params = init_params(exe.module, seed=3)
    ref = Session(k3ir.compile(m, target="reference", dtype="float64", passes=passes), params=params)
    ids = token_ids(m.attrs["vocab_size"], 2, 9)
    assert rel_err(Session(exe, params=params).prefill(ids)[0], ref.prefill(ids)[0]) < 1e-4
    from k3ir.backends.onnx.export import OnnxExporter
    x = OnnxExporter(exe.module, weights="inputs")
    model = x.export_function("prefill")
    packed = [i for i in model.graph.input if i.name.endswith("weight_packed")]
    assert packed and all(i.type.tensor_type.elem_type == onnx.TensorProto.UINT8 for i in packed)
    assert x.native.get("k3.grouped_matmul") and "BitShift" in {n.op_type for n in all_nodes(model.graph)}


@pytest.mark.parametrize("weights", ["external", "embedded"])
def test_mxfp4_export_without_bound_weights_holds_the_session_init(tmp_path, weights):
    """A quantised model exported without a checkpoint (``k3ir export k3-tiny --format onnx --quantize mxfp4``): each
    packed expert initializer holds the quantisation of its float source's random init in its packed shape
    (``u8[E, N, K/2]``; it was the float init cast to one byte per value, which onnxruntime refused for external data
    and which failed to reshape embedded), so the file computes what the same export of ``init_params`` computes."""
    import onnxruntime as ort
    from k3ir.backends.onnx.export import export_onnx
    m = load_tiny("k3-tiny")
    passes = ["fuse-moe-dispatch", "quantize-experts{format=mxfp4}", "dce"]
    mod = k3ir.compile(m, target="onnx", passes=passes).module
    params = init_params(mod)
    outs = []
    for name, bound in (("random", None), ("bound", params)):
        path = str(tmp_path / f"{name}.onnx")
        export_onnx(mod, path, function="prefill", weights=weights, params=bound)
        model = onnx.load(path)
        packed = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith("_packed")}
        assert packed and all(a.shape == params[n].shape and a.dtype == np.uint8 for n, a in packed.items())
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        feeds = {"input_ids": token_ids(m.attrs["vocab_size"], 1, 9)}
        for i in sess.get_inputs()[1:]:
            if i.type.startswith("tensor("):
                feeds[i.name] = np.zeros([1 if not isinstance(d, int) else d for d in i.shape],
                                         np.int64 if "int64" in i.type else np.float32)
        outs.append((packed, sess.run(None, feeds)[0]))
    (p0, y0), (p1, y1) = outs
    assert all(np.array_equal(p0[n], p1[n]) for n in p1)
    assert np.isfinite(y0).all() and rel_err(y0, y1) < 1e-6


def all_nodes(graph):
    """The nodes of ``graph`` and, recursively, of its subgraphs (Loop/Scan bodies)."""
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(a.g)


def test_linear_splits_are_one_matmul_over_weights_joined_at_export(tmp_path):
    """``fuse-linear-splits``: each ``k3.decode_linear`` is one ``MatMul`` over one initializer (its parameters
    joined along N when the file is written: no ``Concat`` of weights, no initializer of a part left) and a
    ``Split``; prefill and decode logits match the float64 reference of the unfused module; the artifact
    (external weights) loads back to the same logits."""
    from k3ir.backends.onnx.export import OnnxExporter
    m = load_tiny("k3-tiny")
    exe = k3ir.compile(m, target="onnx", passes=["fuse-linear-splits", "dce"])
    fused = list(exe.module.functions["prefill"].walk("k3.decode_linear"))
    assert fused and all(o.attrs["splits"] >= 2 for o in fused)
    params = init_params(exe.module, seed=3)
    ref = Session(k3ir.compile(m, target="reference", dtype="float64", passes=[]), params=params)
    sess = Session(exe, params=params)
    ids = token_ids(m.attrs["vocab_size"], 2, 9)
    nxt = token_ids(m.attrs["vocab_size"], 2, 1, seed=7)
    got, want = prefill_decode(sess, ids, nxt), prefill_decode(ref, ids, nxt)
    assert rel_err(got[0], want[0]) < 1e-4 and rel_err(got[1], want[1]) < 1e-4
    model = OnnxExporter(exe.module, params=params).export_function("prefill")
    inits = {t.name: t for t in model.graph.initializer}
    joined = [n for n in inits if "+" in n]
    parts = {p for n in joined for p in n.split("+")}
    assert len(joined) == len(fused) and not parts & set(inits)
    for o in fused:                                               # the joined initializer holds the weights in order
        names = [v.producer.attrs["name"] for v in o.operands[1:]]
        arr = onnx.numpy_helper.to_array(inits["+".join(names)])
        assert np.array_equal(arr, np.concatenate([np.asarray(params[n], np.float32) for n in names]))
    assert not [nd for nd in model.graph.node if nd.op_type == "Concat" and set(nd.input) & (parts | set(joined))]
    assert sum(nd.op_type == "Split" for nd in model.graph.node) >= len(fused)
    exe.save(str(tmp_path / "art"))
    loaded = prefill_decode(Session.load(str(tmp_path / "art")), ids, nxt)
    assert rel_err(loaded[0], got[0]) < 1e-6 and rel_err(loaded[1], got[1]) < 1e-6
