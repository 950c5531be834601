"""The per-function summary of ``k3ir compile`` (``@decode: 18 k3.attn_res_fused, ...``) counts every op of the
registry's ``fused`` family that the passes produced, checked against the op counts of the IR it wrote."""
from __future__ import annotations

import os
import re
from collections import Counter

from conftest import run_cli

import k3ir


def test_ir_only_summary_counts_every_fused_op(capsys, tmp_path):
    from k3ir.opdef import all_ops
    rc, out, err = run_cli(capsys, "compile", "k3-tiny", "--target", "triton", "--ir-only", "-o", str(tmp_path))
    assert rc == 0, err
    m = k3ir.parse_file(os.path.join(tmp_path, "module.k3"))
    fused = {n for n, d in all_ops().items() if d.family == "fused"}
    line = re.search(r"^@decode: (.*?)\n(?=@|parameters:)", out, re.DOTALL | re.MULTILINE).group(1)     # rich wraps long lines
    shown = {name: int(n) for n, name in re.findall(r"(\d+)\s+(k3\.\w+)", line)}
    want = {k: n for k, n in Counter(op.name for op in m.functions["decode"].ops).items() if k in fused}
    # the decode phase of the triton pipeline produced these (fuse-decode-linear, fuse-kda-output, ...)
    for name in ("k3.decode_linear", "k3.fused_kda_ungated", "k3.mla_kv_norm", "k3.moe_experts"):
        assert want.get(name, 0) > 0, (name, want)
    assert {k: v for k, v in shown.items() if k in fused} == want, (line, want)
