"""Vision ops: the MoonViT tower of Kimi K2.5/K3 and the media merge (SPEC.md 8).

Peer: transformers 5.24 ``kimi_k25`` (``Kimi_K25VisionModel`` + ``Kimi_K25MultimodalProjection``).
Images travel as grids: patches ``[N, GH, GW, C, p, p]`` (the processor's patchify), tokens
``[N, GH, GW, D]``, heads ``[N, GH, GW, H, Dh]``; attention spans all ``GH*GW`` patches of an
image (no mask). Weights use the published checkpoint layout: the fused ``wqkv`` keeps the
original interleaved (complex-pair) RoPE order, so ``k3.rope_2d`` rotates pairs ``(2j, 2j+1)``.
"""
from __future__ import annotations

import math
import re

import numpy as np

from ..opdef import Attr, Op, Operand, Result, op, require, tensor
from ..types import Dim, TensorType
from ._util import f64, numel


def div_dim(d: Dim, k: int) -> Dim:
    """``d / k`` for a grid dimension: ints divide, ``"2*MH"`` gives ``"MH"``."""
    if isinstance(d, int):
        return d // k
    if k == 1:
        return d
    m = re.fullmatch(rf"{k}\*(\w+)", str(d))
    return m.group(1) if m else f"({d})/{k}"


def erf(x):
    """Elementwise erf in float64 (``math.erf``)."""
    x = f64(x)
    return np.vectorize(math.erf, otypes=[np.float64])(x) if x.size else x


# ---- float64 tables (the oracle for the index primitives) ---------------------------------------
def interp_matrix(dst: int, src: int, mode: str = "bicubic", align_corners: bool = False) -> np.ndarray:
    """``[dst, src]`` weights resampling a length-``src`` axis to ``dst`` like
    ``F.interpolate(mode, align_corners)``: bicubic is Keys' kernel with ``a = -0.75``, taps
    clamped to the border (transformers ``get_vision_interpolation_indices_and_weights``)."""
    i = np.arange(dst, dtype=np.float64)
    if align_corners:
        s = i * (src - 1) / max(dst - 1, 1)
    else:
        s = (i + 0.5) * src / dst - 0.5
    fl = np.floor(s)
    offs = np.arange(-1, 3) if mode == "bicubic" else np.arange(0, 2)
    taps = fl[:, None] + offs
    dist = np.abs(s[:, None] - taps)
    if mode == "bicubic":
        a = -0.75
        near = ((a + 2) * dist - (a + 3)) * dist * dist + 1
        far = ((a * dist - 5 * a) * dist + 8 * a) * dist - 4 * a
        w = np.where(dist <= 1, near, far)
    else:
        w = np.clip(1 - dist, 0, None)
    out = np.zeros((dst, src))
    idx = np.clip(taps, 0, src - 1).astype(np.int64)
    for t in range(taps.shape[1]):
        np.add.at(out, (np.arange(dst), idx[:, t]), w[:, t])
    return out


def rope_2d_angles(gh: int, gw: int, dim: int, theta: float) -> np.ndarray:
    """Angles ``[gh, gw, dim/2]`` of MoonViT's axial RoPE: pair ``j`` (dims ``2j, 2j+1``) turns by
    ``col * f_{j/2}`` for even ``j`` and ``row * f_{(j-1)/2}`` for odd ``j``, with
    ``f_m = theta^(-4m/dim)`` (the peer's inv_freq over ``dim/2``, interleaved w, h)."""
    f = theta ** (-np.arange(0, dim // 2, 2, dtype=np.float64) / (dim // 2))      # [dim/4]
    rows, cols = np.meshgrid(np.arange(gh, dtype=np.float64), np.arange(gw, dtype=np.float64), indexing="ij")
    ang = np.stack([cols[..., None] * f, rows[..., None] * f], axis=-1)             # [gh, gw, dim/4, 2]
    return ang.reshape(gh, gw, dim // 2)


def time_embedding_table(frames: int, dim: int) -> np.ndarray:
    """The peer's additive time table ``[frames + 1, dim]``: row 0 is zero (single images), row
    ``f + 1`` is ``[sin(f w), cos(f w)]`` with ``w_i = 10000^(-2i/dim)``."""
    w = 1.0 / 10000 ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    fr = np.outer(np.arange(frames, dtype=np.float64), w)
    return np.concatenate([np.zeros((1, dim)), np.concatenate([np.sin(fr), np.cos(fr)], axis=1)])


# ---- generic ops ------------------------------------------------------------------------------
@op("k3.layernorm", "model")
class LayerNorm(Op):
    """``(x - mean) / sqrt(var + eps) * w + b`` over the last axis (fp32 or wider); x ``[..., d]``,
    w, b ``[d]``."""
    x = Operand()
    weight = Operand()
    bias = Operand()
    out = Result()
    eps = Attr(float, 1e-5)

    def infer(self, x, w, b):
        x = tensor(x, "x")
        for t, what in ((w, "weight"), (b, "bias")):
            require(t.rank == 1 and str(t.shape[0]) == str(x.shape[-1]), f"{what} {t} does not fit {x}")
        return [x]

    def reference(self, x, w, b):
        x = f64(x)
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + self.eps) * f64(w) + f64(b)

    def decompose(self, b, x, w, bias):
        xc = b.sub(x, b.reduce_mean(x, axes=[-1], keepdims=True))
        var = b.reduce_mean(b.square(xc), axes=[-1], keepdims=True)
        return b.add(b.mul(b.mul(xc, b.rsqrt(b.add(var, self.eps))), w), bias)

    def flops(self, ot, rt, env):
        return 7.0 * numel(ot[0].shape, env)


#: Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7): erf(a) = 1 - t P(t) exp(-a^2), t = 1/(1 + p a)
_AS_P = 0.3275911
_AS_C = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


@op("k3.gelu", "model")
class GELU(Op):
    """GELU: ``approximate="none"``: ``x/2 (1 + erf(x/sqrt 2))`` (nn.GELU, the projector);
    ``"tanh"``: ``x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (gelu_pytorch_tanh, the ViT MLP).
    The exact form decomposes through A&S 7.1.26 (absolute erf error < 1.5e-7)."""
    x = Operand()
    out = Result()
    approximate = Attr(str, "none", choices=("none", "tanh"))

    def infer(self, x):
        return [tensor(x, "x")]

    def verify(self):
        require(self.approximate in ("none", "tanh"), f"approximate must be none|tanh, got {self.approximate!r}")

    def reference(self, x):
        x = f64(x)
        if self.approximate == "tanh":
            return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
        return 0.5 * x * (1 + erf(x / math.sqrt(2)))

    def decompose(self, b, x):
        if self.approximate == "tanh":
            inner = b.mul(b.add(x, b.mul(b.mul(b.square(x), x), 0.044715)), math.sqrt(2 / math.pi))
            return b.mul(b.mul(x, 0.5), b.add(b.tanh(inner), 1.0))
        # gelu = x/2 + |x|/2 (1 - q), q = t P(t) exp(-a^2), a = |x|/sqrt 2 (erf is odd)
        ax = b.maximum(x, b.neg(x))
        a = b.mul(ax, 1 / math.sqrt(2))
        t = b.reciprocal(b.add(b.mul(a, _AS_P), 1.0))
        poly = b.mul(t, _AS_C[-1])
        for c in reversed(_AS_C[:-1]):
            poly = b.mul(b.add(poly, c), t)
        q = b.mul(poly, b.exp(b.neg(b.square(a))))
        return b.add(b.mul(x, 0.5), b.mul(b.mul(ax, 0.5), b.sub(1.0, q)))

    def flops(self, ot, rt, env):
        return 8.0 * numel(rt[0].shape, env)


# ---- index primitives: core ops (leaves like k3.constant) giving tables for a runtime grid size -----
@op("k3.interp_weights")
class InterpWeights(Op):
    """Resampling weights ``f32[G, size]`` (``G`` = ``like.shape[axis]``) that map a length-``size``
    axis to ``G`` like ``F.interpolate(mode, align_corners)`` (see ``interp_matrix``)."""
    like = Operand()
    out = Result()
    axis = Attr(int)
    size = Attr(int)
    mode = Attr(str, "bicubic", choices=("bicubic", "bilinear"))
    align_corners = Attr(bool, False)

    def infer(self, like):
        like = tensor(like, "like")
        require(-like.rank <= self.axis < like.rank, f"axis {self.axis} out of range for {like}")
        return [TensorType("f32", (like.shape[self.axis], self.size))]

    def verify(self):
        require(self.size >= 1, "size must be >= 1")
        require(self.mode in ("bicubic", "bilinear"), f"mode must be bicubic|bilinear, got {self.mode!r}")

    def reference(self, like):
        return interp_matrix(np.shape(like)[self.axis], self.size, self.mode, self.align_corners)


@op("k3.rope_2d_table")
class Rope2DTable(Op):
    """``(cos, sin)``, each ``f32[GH, GW, dim/2]``, of MoonViT's axial RoPE for a grid ``like``
    ``[N, GH, GW, ...]`` (see ``rope_2d_angles``)."""
    like = Operand()
    cos = Result()
    sin = Result()
    dim = Attr(int)
    theta = Attr(float, 10000.0)

    def infer(self, like):
        like = tensor(like, "like")
        require(like.rank >= 3, f"like must be [N, GH, GW, ...], got {like}")
        t = TensorType("f32", (like.shape[1], like.shape[2], self.dim // 2))
        return [t, t]

    def verify(self):
        require(self.dim % 4 == 0, f"2-D RoPE needs a head dim divisible by 4, got {self.dim}")

    def reference(self, like):
        s = np.shape(like)
        ang = rope_2d_angles(s[1], s[2], self.dim, self.theta)
        return np.cos(ang), np.sin(ang)


# ---- MoonViT ops ------------------------------------------------------------------------------------
@op("k3.patch_embed", "model")
class PatchEmbed(Op):
    """Conv2d with stride = kernel = ``p`` on patchified pixels: ``[N, GH, GW, C, p, p]``, weight
    ``[D, C, p, p]``, bias ``[D]`` -> ``[N, GH, GW, D]``."""
    pixels = Operand()
    weight = Operand()
    bias = Operand()
    out = Result()

    def infer(self, x, w, bias):
        x, w = tensor(x, "pixels"), tensor(w, "weight")
        require(x.rank == 6, f"pixels must be [N, GH, GW, C, p, p], got {x}")
        require(w.rank == 4 and [str(d) for d in w.shape[1:]] == [str(d) for d in x.shape[3:]],
                f"weight {w} does not fit patches {x}")
        require(bias.rank == 1 and str(bias.shape[0]) == str(w.shape[0]), f"bias {bias} does not fit {w}")
        return [TensorType(w.dtype, x.shape[:3] + (w.shape[0],))]

    def reference(self, x, w, bias):
        return np.einsum("nijcuv,dcuv->nijd", f64(x), f64(w)) + f64(bias)

    def decompose(self, b, x, w, bias):
        D, C, p, q = w.type.shape
        flat = b.reshape(x, shape=[0, 0, 0, C * p * q])
        return b.add(b.linear(flat, b.reshape(w, shape=[D, C * p * q])), bias)

    def flops(self, ot, rt, env):
        return 2.0 * numel(rt[0].shape, env) * numel(ot[1].shape[1:], env)


@op("k3.vit_pos_emb", "model")
class ViTPosEmb(Op):
    """Add the learned 2-D position table ``[H0, W0, D]`` resampled to the grid of x
    ``[N, GH, GW, D]`` (bicubic, half-pixel, border taps: the peer's interpolation). Single
    images take the peer's zero time row, so no time term is added (video is not supported)."""
    x = Operand()
    table = Operand()
    out = Result()
    mode = Attr(str, "bicubic", choices=("bicubic", "bilinear"))

    def infer(self, x, t):
        x, t = tensor(x, "x"), tensor(t, "table")
        require(x.rank == 4, f"x must be [N, GH, GW, D], got {x}")
        require(t.rank == 3 and str(t.shape[2]) == str(x.shape[3]), f"table {t} does not fit {x}")
        return [x]

    def reference(self, x, t):
        x, t = f64(x), f64(t)
        ah = interp_matrix(x.shape[1], t.shape[0], self.mode)
        aw = interp_matrix(x.shape[2], t.shape[1], self.mode)
        return x + np.einsum("ih,hwd,jw->ijd", ah, t, aw)

    def decompose(self, b, x, t):
        H0, W0, _ = t.type.shape
        ah = b.interp_weights(x, axis=1, size=int(H0), mode=self.mode)
        aw = b.interp_weights(x, axis=2, size=int(W0), mode=self.mode)
        pos = b.einsum(aw, b.einsum(ah, t, equation="ih,hwd->iwd"), equation="jw,iwd->ijd")
        return b.add(x, pos)


@op("k3.rope_2d", "model")
class Rope2D(Op):
    """MoonViT axial RoPE on ``x [N, GH, GW, H, Dh]`` in the interleaved layout: pair
    ``(x[2j], x[2j+1])`` turns by angle ``j`` of ``rope_2d_angles`` (fp32 or wider)."""
    x = Operand()
    out = Result()
    theta = Attr(float, 10000.0)

    def infer(self, x):
        x = tensor(x, "x")
        require(x.rank == 5 and isinstance(x.shape[4], int) and x.shape[4] % 4 == 0,
                f"x must be [N, GH, GW, H, Dh] with Dh divisible by 4, got {x}")
        return [x]

    def reference(self, x):
        x = f64(x)
        ang = rope_2d_angles(x.shape[1], x.shape[2], x.shape[4], self.theta)[:, :, None, :]
        cos, sin = np.cos(ang), np.sin(ang)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def decompose(self, b, x):
        Dh = int(x.type.shape[4])
        cos, sin = b.rope_2d_table(x, dim=Dh, theta=self.theta)
        cos, sin = (b.reshape(c, shape=[0, 0, 1, Dh // 2]) for c in (cos, sin))
        pairs = b.reshape(x, shape=[0, 0, 0, 0, Dh // 2, 2])
        x0 = b.reshape(b.slice(pairs, axis=5, start=0, end=1), shape=[0, 0, 0, 0, Dh // 2])
        x1 = b.reshape(b.slice(pairs, axis=5, start=1, end=2), shape=[0, 0, 0, 0, Dh // 2])
        y0 = b.reshape(b.sub(b.mul(x0, cos), b.mul(x1, sin)), shape=[0, 0, 0, 0, Dh // 2, 1])
        y1 = b.reshape(b.add(b.mul(x0, sin), b.mul(x1, cos)), shape=[0, 0, 0, 0, Dh // 2, 1])
        return b.reshape(b.concat(y0, y1, axis=5), shape=[0, 0, 0, 0, Dh])

    def flops(self, ot, rt, env):
        return 3.0 * numel(rt[0].shape, env)


@op("k3.vit_attention", "model")
class ViTAttention(Op):
    """Bidirectional attention within each image: q, k, v ``[N, GH, GW, H, Dh]``; every patch
    attends to all ``GH*GW`` patches of its image; ``softmax(q k^T * scale)`` in fp32."""
    q = Operand()
    k = Operand()
    v = Operand()
    out = Result()
    scale = Attr(float)

    def infer(self, q, k, v):
        for t, what in ((q, "q"), (k, "k"), (v, "v")):
            t = tensor(t, what)
            require(t.rank == 5, f"{what} must be [N, GH, GW, H, Dh], got {t}")
        require([str(d) for d in q.shape] == [str(d) for d in k.shape], f"q {q} and k {k} differ")
        require([str(d) for d in q.shape[:4]] == [str(d) for d in v.shape[:4]], f"v {v} does not fit {q}")
        return [v]

    def reference(self, q, k, v):
        q, k, v = f64(q), f64(k), f64(v)
        N, GH, GW, H, _ = q.shape
        qs, ks, vs = (t.reshape(N, GH * GW, H, -1) for t in (q, k, v))
        s = np.einsum("nshd,nthd->nhst", qs, ks) * self.scale
        s = np.exp(s - s.max(-1, keepdims=True))
        a = s / s.sum(-1, keepdims=True)
        return np.einsum("nhst,nthd->nshd", a, vs).reshape(N, GH, GW, H, -1)

    def decompose(self, b, q, k, v):
        s = b.mul(b.cast(b.einsum(q, k, equation="nijhd,nklhd->nhijkl"), dtype="f32"), self.scale)
        e = b.exp(b.sub(s, b.reduce_max(s, axes=[4, 5], keepdims=True)))
        a = b.div(e, b.reduce_sum(e, axes=[4, 5], keepdims=True))
        return b.einsum(b.cast(a, dtype=v.type.dtype), v, equation="nhijkl,nklhd->nijhd")

    def flops(self, ot, rt, env):
        N, GH, GW, H, Dh = (numel((d,), env) for d in ot[0].shape)
        Dv = numel((ot[2].shape[4],), env)
        S = GH * GW
        return 2.0 * N * H * S * S * (Dh + Dv)


@op("k3.patch_merge", "model")
class PatchMerge(Op):
    """Merge ``kh x kw`` neighbouring patches: ``[N, GH, GW, D] -> [N, GH/kh, GW/kw, kh*kw*D]``;
    the merged vector concatenates the kernel's patches row-major (``(r % kh) * kw + c % kw``),
    the peer's ``temporal_merge`` order for single images."""
    x = Operand()
    out = Result()
    kh = Attr(int, 2)
    kw = Attr(int, 2)

    def infer(self, x):
        x = tensor(x, "x")
        require(x.rank == 4 and isinstance(x.shape[3], int), f"x must be [N, GH, GW, D], got {x}")
        for d, k in ((x.shape[1], self.kh), (x.shape[2], self.kw)):
            require(not isinstance(d, int) or d % k == 0, f"grid {d} is not divisible by the merge kernel {k}")
        return [x.with_shape((x.shape[0], div_dim(x.shape[1], self.kh), div_dim(x.shape[2], self.kw),
                              self.kh * self.kw * x.shape[3]))]

    def verify(self):
        require(self.kh >= 1 and self.kw >= 1, "merge kernel must be >= 1")

    def reference(self, x):
        x = f64(x)
        N, GH, GW, D = x.shape
        if GH % self.kh or GW % self.kw:
            from ..errors import K3RuntimeError
            raise K3RuntimeError(f"patch grid {GH}x{GW} is not divisible by the merge kernel {self.kh}x{self.kw}")
        y = x.reshape(N, GH // self.kh, self.kh, GW // self.kw, self.kw, D).transpose(0, 1, 3, 2, 4, 5)
        return y.reshape(N, GH // self.kh, GW // self.kw, self.kh * self.kw * D)

    def decompose(self, b, x):
        _, GH, GW, D = x.type.shape
        MH, MW = div_dim(GH, self.kh), div_dim(GW, self.kw)
        y = b.transpose(b.reshape(x, shape=[0, 0, MW, self.kw * D]), perm=[0, 2, 1, 3])   # [N, MW, GH, kw D]
        y = b.reshape(y, shape=[0, 0, MH, self.kh * self.kw * D])                        # [N, MW, MH, kh kw D]
        return b.transpose(y, perm=[0, 2, 1, 3])


# ---- text side ------------------------------------------------------------------------------------
@op("k3.merge_media", "model")
class MergeMedia(Op):
    """Replace the embeddings of media placeholder tokens: h ``[B, T, d]``, ids ``i64[B, T]``,
    features ``[M, d]``; the k-th placeholder in row-major ``(b, t)`` order takes feature row k
    (the peer's ``masked_scatter``). The placeholder count must equal ``M``
    (K3RuntimeError otherwise)."""
    h = Operand()
    ids = Operand()
    features = Operand()
    out = Result()
    token_id = Attr(int)

    def infer(self, h, ids, f):
        h, ids, f = tensor(h, "h"), tensor(ids, "ids"), tensor(f, "features")
        require(ids.dtype in ("i64", "i32") and ids.rank == 2, f"ids must be i64[B, T], got {ids}")
        require(h.rank == 3 and [str(d) for d in h.shape[:2]] == [str(d) for d in ids.shape], f"h {h} vs {ids}")
        require(f.rank == 2 and str(f.shape[1]) == str(h.shape[2]), f"features {f} do not fit {h}")
        return [h]

    def reference(self, h, ids, f):
        h = f64(h).copy()
        mask = np.asarray(ids) == self.token_id
        check_media_count(int(mask.sum()), np.shape(f)[0], self.token_id)
        h[mask] = f64(f)
        return h

    def decompose(self, b, h, ids, f):
        diff = b.sub(b.cast(ids, dtype="f32"), float(self.token_id))
        mask = b.sub(1.0, b.minimum(b.square(diff), 1.0))                               # [B, T] 1 at placeholders
        cum = b.cumsum(mask, axis=1)
        rows = b.reduce_sum(mask, axes=[1], keepdims=True)
        idx = b.add(cum, b.sub(b.cumsum(rows, axis=0), rows))
        idx = b.cast(b.maximum(b.sub(idx, 1.0), 0.0), dtype="i64")
        return b.where(b.reshape(mask, shape=[0, 0, 1]), b.take(f, idx), h)


def check_media_count(n_tokens: int, n_features: int, token_id: int) -> None:
    """Raise K3RuntimeError unless the placeholder count equals the feature count."""
    if n_tokens != n_features:
        from ..errors import K3RuntimeError
        raise K3RuntimeError(f"input_ids hold {n_tokens} media placeholder tokens (id {token_id}) but the "
                             f"images give {n_features} feature rows")
