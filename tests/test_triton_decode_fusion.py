"""Decode-step fusions of the triton target (lowering.plan, executable.fused_kda) on a tiny Kimi Linear:
RMSNorm deferred into the gemv prologue (KDA projections, MLA q/kv_a, dense MLP), the MLA q and kv_a
linears in one gemv over concatenated weights, the MoE combine summed in the shared-expert down gemv,
the KDA low-rank up-projections in one launch. Logits against the float64 reference backend, launches
counted per kernel (TRITON_INTERPRET=1 on a CPU machine)."""
from __future__ import annotations

import collections
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import
triton = pytest.importorskip("triton")

from conftest import rel_err
from k3ir.runtime import Session

import k3ir

KL = {"num_hidden_layers": 4, "hidden_size": 256, "vocab_size": 512, "num_experts": 8, "moe_intermediate_size": 128,
      "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 64,
      "layer_types": ["linear_attention"] * 3 + ["full_attention"],
      "mlp_layer_types": ["dense"] + ["sparse"] * 3,
      "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 64, "num_heads": 2,
                             "short_conv_kernel_size": 4}}


def _count_launches(work):
    """{kernel name: launches} of the Triton kernels ``work()`` runs."""
    kinds = [triton.runtime.jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        kinds.append(InterpretedFunction)
    except ImportError:
        pass
    seen = collections.Counter()
    origs = {k: k.run for k in kinds}

    def hook(orig):
        def run(self, *args, grid, warmup, **kw):
            if not warmup:
                seen[getattr(getattr(self, "fn", None), "__name__", None) or getattr(self, "__name__", "?")] += 1
            return orig(self, *args, grid=grid, warmup=warmup, **kw)
        return run
    for k in kinds:
        k.run = hook(origs[k])
    try:
        work()
    finally:
        for k in kinds:
            k.run = origs[k]
    return seen


def test_kimi_linear_decode_fusions_match_reference_and_save_launches():
    torch.set_num_threads(1)
    m = k3ir.load("kimi-linear-6p6b", KL)
    exe = k3ir.compile(m, target="triton", dtype="float32", device="cpu")
    acts = collections.Counter(a[0] if a[0] != "combine" else "combine_" + str(a[1:]) for a in exe.plans["decode"].values())
    # 3 KDA input norms, the MLA input norm, the dense MLP norm, 3 MoE norms (router consumers)
    assert acts["norm"] == 8 and acts["lin_cat"] == 1 and acts["combine_('lazy',)"] == 3
    ref = Session(k3ir.compile(m, target="reference"))
    tri = Session(exe, params=ref.params)
    ids = np.random.default_rng(0).integers(3, 500, (2, 7))
    want, s_ref = ref.prefill(ids)
    got, s_tri = tri.prefill(ids)
    assert rel_err(got.double().numpy(), want) < 1e-4
    nxt = np.array([[5], [40]])
    want, s_ref = ref.decode(nxt, s_ref)
    out = {}
    launches = _count_launches(lambda: out.update(r=tri.decode(nxt, s_tri)))
    got, s_tri = out["r"]
    assert rel_err(got.double().numpy(), want) < 1e-4
    want, _ = ref.decode(nxt[::-1].copy(), s_ref)          # the next step from the fused step's state
    got, _ = tri.decode(nxt[::-1].copy(), s_tri)
    assert rel_err(got.double().numpy(), want) < 1e-4
    # rmsnorm launches: the final norm, MLA's latent norm and the 3 MoE norms (router consumers);
    # gemv: KDA 3 x (projections, low-rank pair, out), MLA (q+kv_a, out), dense (glu, down), 3 x shared (glu, down)
    assert launches["rmsnorm_kernel"] == 5
    assert launches["gemv_kernel"] == 3 * 3 + 2 + 2 + 3 * 2
    assert launches["combine_kernel"] == 0
