"""ModelConfig -> k3ir Module with ``forward`` (training), ``prefill`` and ``decode`` functions.

Parameters are declared with the checkpoint's key names (``language_model.`` prefix in the
``kimi_k3`` layout), so ``k3ir inspect`` and the checkpoint loader agree by construction.
Routed experts are stacked parameters (``...experts.{e}.w1.weight``, type ``[E, I, D]``).
"""
from __future__ import annotations

from k3ir.builder import Builder
from k3ir.ir import Function, Module, Value
from k3ir.types import StateType, TensorType

from .config import ModelConfig

FUNCTIONS = ("forward", "prefill", "decode")
#: optional extra function for continuous batching (not built by default): ``prefill_varlen
#: (input_ids i64[B,T], cache_lengths i64[B], states...)`` where each MLA cache is right-padded
#: and row b holds ``cache_lengths[b]`` valid tokens; see ``add_varlen_function``.
VARLEN = "prefill_varlen"
#: ``prefill_varlen`` again under another name, with the function attribute ``cp = "replicated"``: the
#: ``shard`` pass keeps its sequence whole on every cp rank (serving under cp runs decode steps and prompt
#: tails shorter than cp through it; ``add_varlen_function(..., replicated=True)``)
VARLEN_REPLICATED = "prefill_varlen_replicated"
#: suffix of the text functions that take ``image_features [M, d]`` after ``input_ids`` and put
#: them at the ``media_placeholder_token_id`` positions (built with the vision pathway, SPEC.md 8)
MEDIA_SUFFIX = "_media"


class _ModelBuilder:
    def __init__(self, cfg: ModelConfig, module: Module):
        self.cfg, self.m = cfg, module
        self.dt = cfg.dtype

    # ---- parameters --------------------------------------------------------------
    def p(self, b: Builder, key: str, shape, dtype: str | None = None, **attrs) -> Value:
        name = f"{self.cfg.key_prefix}{key}"
        return b.param(name, TensorType(dtype or self.dt, tuple(shape)), **attrs)

    # ---- blocks ------------------------------------------------------------------
    def kda(self, b: Builder, x: Value, i: int, states: list[Value] | None):
        c = self.cfg
        H, D, K = c.kda_num_heads, c.kda_head_dim, c.conv_kernel
        HD, d = H * D, c.hidden_size
        pre = f"model.layers.{i}.self_attn."
        outs = {}
        proj = {}
        for j, n in enumerate("qkv"):
            y = b.linear(x, self.p(b, pre + f"{n}_proj.weight", (HD, d)), _name=f"{n}")
            st = states[j] if states else None
            y, outs[n] = b.op("k3.short_conv", y, self.p(b, pre + f"{n}_conv1d.weight", (HD, 1, K)),
                              st, activation="silu", _name=[f"{n}_conv", f"conv_{n}_state"])
            proj[n] = b.reshape(y, shape=[0, 0, H, D])
        q, k = b.l2norm(proj["q"], eps=1e-6), b.l2norm(proj["k"], eps=1e-6)
        z = b.linear(b.linear(x, self.p(b, pre + "f_a_proj.weight", (D, d))),
                     self.p(b, pre + "f_b_proj.weight", (HD, D)))
        g = b.kda_gate(b.reshape(z, shape=[0, 0, H, D]), self.p(b, pre + "A_log", (1, 1, H, 1), "f32"),
                       self.p(b, pre + "dt_bias", (HD,), "f32"), form=c.kda_gate_form,
                       lower_bound=c.gate_lower_bound if c.gate_lower_bound is not None else -5.0)
        beta = b.sigmoid(b.cast(b.linear(x, self.p(b, pre + "b_proj.weight", (H, d))), dtype="f32"))
        o, s_out = b.op("k3.kda", q, k, proj["v"], g, beta, states[3] if states else None,
                        scale=D ** -0.5, chunk_size=64, _name=["kda_o", "kda_state"])
        if c.full_rank_gate:
            gz = b.linear(x, self.p(b, pre + "g_proj.weight", (HD, d)))
        else:
            gz = b.linear(b.linear(x, self.p(b, pre + "g_a_proj.weight", (D, d))),
                          self.p(b, pre + "g_b_proj.weight", (HD, D)))
        o = b.gated_rmsnorm(o, b.reshape(gz, shape=[0, 0, H, D]), self.p(b, pre + "o_norm.weight", (D,)),
                            eps=c.rms_norm_eps)
        a = b.linear(b.reshape(o, shape=[0, 0, HD]), self.p(b, pre + "o_proj.weight", (d, HD)))
        return a, [outs["q"], outs["k"], outs["v"], s_out]

    def mla(self, b: Builder, x: Value, i: int, states: list[Value] | None, lengths: Value | None = None):
        c = self.cfg
        H, n, r, vd, R, d = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                             c.kv_lora_rank, c.hidden_size)
        pre = f"model.layers.{i}.self_attn."
        if c.q_lora_rank:
            cq = b.rmsnorm(b.linear(x, self.p(b, pre + "q_a_proj.weight", (c.q_lora_rank, d))),
                           self.p(b, pre + "q_a_layernorm.weight", (c.q_lora_rank,)), eps=1e-6)
            q = b.linear(cq, self.p(b, pre + "q_b_proj.weight", (H * (n + r), c.q_lora_rank)))
        else:
            q = b.linear(x, self.p(b, pre + "q_proj.weight", (H * (n + r), d)))
        q = b.reshape(q, shape=[0, 0, H, n + r])
        kv = b.linear(x, self.p(b, pre + "kv_a_proj_with_mqa.weight", (R + r, d)))
        ckv = b.rmsnorm(b.slice(kv, axis=2, start=0, end=R), self.p(b, pre + "kv_a_layernorm.weight", (R,)),
                        eps=1e-6)
        kv = b.concat(ckv, b.slice(kv, axis=2, start=R), axis=2)
        o, cache = b.op("k3.mla", q, kv, self.p(b, pre + "kv_b_proj.weight", (H * (n + vd), R)),
                        states[0] if states else None, lengths, heads=H, nope=n, rope=r, v_dim=vd,
                        scale=(n + r) ** -0.5, absorbed=False, _name=["mla_o", "mla_cache"])
        o = b.reshape(o, shape=[0, 0, H * vd])
        if c.mla_use_output_gate:
            o = b.mul(o, b.sigmoid(b.linear(x, self.p(b, pre + "g_proj.weight", (H * vd, d)))))
        return b.linear(o, self.p(b, pre + "o_proj.weight", (d, H * vd))), [cache]

    def glu(self, b: Builder, x: Value, pre: str, inter: int, d: int) -> Value:
        c = self.cfg
        g = b.linear(x, self.p(b, pre + "gate_proj.weight", (inter, d)))
        u = b.linear(x, self.p(b, pre + "up_proj.weight", (inter, d)))
        h = (b.situ_glu(g, u, b1=c.situ_beta, b2=c.situ_linear_beta) if c.hidden_act == "situ"
             else b.swiglu(g, u))
        return b.linear(h, self.p(b, pre + "down_proj.weight", (d, inter)))

    def moe(self, b: Builder, x: Value, i: int) -> Value:
        c = self.cfg
        d, E, I = c.hidden_size, c.num_experts, c.moe_intermediate_size
        pre = f"model.layers.{i}.block_sparse_moe."
        wts, idx, _ = b.op("k3.router", x, self.p(b, pre + "gate.weight", (E, d)),
                           self.p(b, pre + "gate.e_score_correction_bias", (E,), "f32"),
                           top_k=c.top_k, renormalize=c.moe_renormalize,
                           routed_scaling_factor=c.routed_scaling_factor,
                           _name=["router_w", "router_idx", "router_scores"])
        Dl = c.latent_size or d
        z = b.linear(x, self.p(b, pre + "routed_expert_down_proj.weight", (Dl, d))) if c.latent_size else x
        ex = pre + "experts.{e}."
        y = b.moe(z, wts, idx, self.p(b, ex + "w1.weight", (E, I, Dl), stack="e"),
                  self.p(b, ex + "w3.weight", (E, I, Dl), stack="e"),
                  self.p(b, ex + "w2.weight", (E, Dl, I), stack="e"),
                  act="situ" if c.hidden_act == "situ" else "silu", b1=c.situ_beta, b2=c.situ_linear_beta)
        if c.latent_size:
            if c.latent_moe_use_norm:
                y = b.rmsnorm(y, self.p(b, pre + "routed_expert_norm.weight", (Dl,)), eps=c.rms_norm_eps)
            y = b.linear(y, self.p(b, pre + "routed_expert_up_proj.weight", (d, Dl)))
        if c.num_shared_experts:
            y = b.add(y, self.glu(b, x, pre + "shared_experts.", I * c.num_shared_experts, d))
        return y

    def ffn(self, b: Builder, x: Value, i: int) -> Value:
        c = self.cfg
        if c.is_moe(i):
            return self.moe(b, x, i)
        return self.glu(b, x, f"model.layers.{i}.mlp.", c.intermediate_size, c.hidden_size)

    def res_mix(self, b: Builder, sources: list[Value], key: str) -> Value:
        d = self.cfg.hidden_size
        return b.attn_res(self.p(b, f"{key}_proj.weight", (1, d)), self.p(b, f"{key}_norm.weight", (d,)),
                          *sources, eps=self.cfg.rms_norm_eps)

    # ---- functions -----------------------------------------------------------------
    def state_types(self, i: int) -> list[tuple[str, StateType]]:
        c = self.cfg
        if c.layer_kind(i) == "mla":
            return [(f"l{i}_mla_cache", StateType("mla_cache", (c.kv_lora_rank, c.qk_rope_head_dim)))]
        HD, W = c.kda_num_heads * c.kda_head_dim, c.conv_kernel - 1
        conv = StateType("conv_state", (HD, W))
        return [(f"l{i}_conv_q", conv), (f"l{i}_conv_k", conv), (f"l{i}_conv_v", conv),
                (f"l{i}_kda_state", StateType("kda_state", (c.kda_num_heads, c.kda_head_dim, c.kda_head_dim)))]

    def function(self, kind: str, media: bool = False) -> Function:
        c = self.cfg
        fn = Function(f"{kind}{MEDIA_SUFFIX}" if media else kind, attrs={"kind": kind})
        b = Builder(self.m, fn)
        T = 1 if kind == "decode" else "T"
        ids = b.arg("input_ids", TensorType("i64", ("B", T)))
        feats = b.arg("image_features", TensorType(self.dt, ("M", c.hidden_size))) if media else None
        lengths = b.arg("cache_lengths", TensorType("i64", ("B",))) if kind == VARLEN else None
        stateful = kind != "forward"
        state_args: dict[int, list[Value]] = {}
        if stateful:
            for i in range(c.num_hidden_layers):
                state_args[i] = [b.arg(n, t) for n, t in self.state_types(i)]
        h = b.embedding(ids, self.p(b, "model.embed_tokens.weight", (c.vocab_size, c.hidden_size)), _name="embed")
        if media:
            h = b.merge_media(h, ids, feats, token_id=int(c.media_placeholder_token_id))
        blocks: list[Value] = []
        new_states: list[Value] = []
        B = c.attn_res_block_size
        for i in range(c.num_hidden_layers):
            b.prefix, b.layer = f"l{i}.", i
            pre = f"model.layers.{i}."
            x_in = h
            if B:
                pref: Value | None = h
                if blocks:
                    h = self.res_mix(b, blocks + [pref], pre + "self_attention_res")
                if i % B == 0:
                    blocks.append(pref)
                    pref = None
            x = b.rmsnorm(h, self.p(b, pre + "input_layernorm.weight", (c.hidden_size,)), eps=c.rms_norm_eps)
            st = state_args.get(i)
            if c.layer_kind(i) == "mla":
                a, outs = self.mla(b, x, i, st, lengths)
            else:
                a, outs = self.kda(b, x, i, st)
            new_states += outs
            if B:
                pref = a if pref is None else b.add(pref, a)
                h = self.res_mix(b, blocks + [pref], pre + "mlp_res")
            else:
                h = b.add(x_in, a)
            y = self.ffn(b, b.rmsnorm(h, self.p(b, pre + "post_attention_layernorm.weight", (c.hidden_size,)),
                                      eps=c.rms_norm_eps), i)
            h = b.add(pref, y) if B else b.add(h, y)
        b.prefix, b.layer = "", None
        if B:
            h = self.res_mix(b, blocks + [h], "model.output_attn_res")
        h = b.rmsnorm(h, self.p(b, "model.norm.weight", (c.hidden_size,)), eps=c.rms_norm_eps)
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        logits = b.lm_head(h, self.p(b, head, (c.vocab_size, c.hidden_size)), _name="logits")
        b.ret(logits, *new_states) if stateful else b.ret(logits)
        return fn


def module_attrs(cfg: ModelConfig) -> dict:
    eos = cfg.eos_token_id
    return {
        "model_type": cfg.model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers, "mla_layers": list(cfg.mla_layers),
        "kda_layers": list(cfg.kda_layers), "dtype": cfg.dtype,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": eos if not isinstance(eos, list) else eos[0],
        "pad_token_id": cfg.pad_token_id, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
        "key_prefix": cfg.key_prefix, "expert_quant": cfg.expert_quant or "none",
        "quant_ignore": list(cfg.quant_ignore), "attn_res_block_size": cfg.attn_res_block_size or 0,
        "kda_gate": cfg.kda_gate_form,
    }


def add_varlen_function(module: Module, replicated: bool = False) -> Module:
    """Add ``@prefill_varlen`` to a model module built by ``build_module`` (in place; no-op if
    present): like ``@prefill`` plus ``cache_lengths i64[B]`` after ``input_ids``, so rows whose
    MLA caches have different lengths (right-padded to the longest) run in one batch. Returned
    MLA caches keep the padding: row b's valid entries are ``[:cache_lengths[b]]`` and ``[L:]``.
    ``replicated``: also add ``@prefill_varlen_replicated``, the same function with the attribute
    ``cp = "replicated"`` (the ``shard`` pass splits no sequence of it over cp)."""
    if VARLEN not in module.functions:
        module.add_function(_ModelBuilder(module.config, module).function(VARLEN))
    if replicated and VARLEN_REPLICATED not in module.functions:
        fn = _ModelBuilder(module.config, module).function(VARLEN)
        fn.name = VARLEN_REPLICATED
        fn.attrs["cp"] = "replicated"
        module.add_function(fn)
    return module


def build_module(cfg: ModelConfig, functions=FUNCTIONS) -> Module:
    """Build the IR for ``cfg``: parameters plus ``forward``/``prefill``/``decode``."""
    m = Module(cfg.name, module_attrs(cfg))
    mb = _ModelBuilder(cfg, m)
    for kind in functions:
        m.add_function(mb.function(kind))
    if cfg.vision is not None:
        _add_vision(m, mb, cfg, functions)
    m.config = cfg
    return m


def _add_vision(m: Module, mb: _ModelBuilder, cfg: ModelConfig, functions) -> None:
    """``@encode_images`` plus ``@forward_media``/``@prefill_media`` (when a placeholder id is set)."""
    from .vision import build_encode_images, vision_spec
    spec = vision_spec(cfg.vision, cfg.hidden_size, cfg.path)
    m.add_function(build_encode_images(m, spec, cfg.dtype))
    m.attrs["vision"] = {"patch_size": spec.patch, "merge_kernel_size": list(spec.merge),
                         "media_placeholder_token_id": cfg.media_placeholder_token_id}
    if cfg.media_placeholder_token_id is not None:
        for kind in ("forward", "prefill"):
            if kind in functions:
                m.add_function(mb.function(kind, media=True))
