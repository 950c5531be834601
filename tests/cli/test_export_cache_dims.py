"""The symbolic dims the exported ONNX graph declares agree with the shapes onnxruntime returns: a ``present.*``
MLA cache is ``L_plus_T`` long (L cached + T new tokens), not the past cache's ``L``; ``--describe`` prints it."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import run_cli

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def test_prefill_from_empty_cache_matches_declared_dims(capsys, tmp_path):
    path = str(tmp_path / "p.onnx")
    rc, _, err = run_cli(capsys, "export", "k3-tiny", "--format", "onnx", "-o", path)
    assert rc == 0, err
    model = onnx.load(path)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    bound = {"B": 1, "T": 3, "L": 0}                       # a 3-token prefill of a fresh sequence
    feeds = {"input_ids": np.asarray([[5, 17, 42]], np.int64)}
    for spec in s.get_inputs()[1:]:
        if spec.name != "logits_to_keep":
            feeds[spec.name] = np.zeros([d if isinstance(d, int) else bound[d] for d in spec.shape], np.float32)
    outs = dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))
    seen = dict(bound)
    caches = 0
    for o in model.graph.output:
        declared = [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim]
        got = outs[o.name].shape
        assert len(declared) == len(got), (o.name, declared, got)
        for d, n in zip(declared, got):
            if isinstance(d, int):
                assert d == n, (o.name, declared, got)
            else:                                          # one value per symbol across inputs and outputs
                assert seen.setdefault(d, n) == n, (o.name, d, seen[d], n)
        if o.name.endswith("_mla_cache"):
            caches += 1
            assert declared[1] == "L_plus_T" and got[1] == 3, (o.name, declared, got)
    assert caches == 3 and seen["L_plus_T"] == seen["L"] + seen["T"]


def test_describe_names_grown_cache_length(capsys):
    rc, out, _ = run_cli(capsys, "export", "k3-tiny", "--format", "onnx", "--function", "decode", "--describe")
    assert rc == 0
    rows = [ln for ln in out.splitlines() if "l3_mla_cache" in ln]
    assert rows[0].startswith("input") and "[B, L, 40]" in rows[0], rows
    assert rows[1].startswith("output") and "[B, L_plus_1, 40]" in rows[1] and "L_plus_1 = L + 1" in rows[1], rows
