"""MLIR lowering of ``k3.kda`` in the chunked form of SPEC.md 3 (``MlirConfig.kda_form="chunked"``, the default for
prefill); ``"scan"`` and every one-token step keep the op's decomposition (an ``scf.for`` over tokens).

The sequence is zero-padded to a multiple of the chunk ``C = MlirConfig.kda_chunk`` (a padded token has g = 0,
beta = 0 and k = 0, so it leaves the state alone; its outputs are cut off) and viewed as ``[B, NC, C, ...]``.
Everything that does not need the state runs for all chunks at once in linalg contractions: the in-chunk
cumulative log-decay ``G`` (a product with the lower-triangular ones), the decays ``exp(G_i - G_j)`` for
``j <= i`` taken elementwise (exact for either gate form: masked to -inf above the diagonal before the exp),
``A_ij = beta_i <k_i, k_j exp(G_i - G_j)>`` (j < i), ``(I + A)^-1`` as the finite product
``(I - A)(I + A^2)(I + A^4)...`` (A is strictly lower triangular, so ``A^C = 0``: log2(C) squarings), ``W``, ``U``
and the in-chunk scores ``P``. Only the state pass is sequential: an ``scf.for`` over the NC chunks
(``k3.scan``) with ``V' = U - W S``, ``O = (Q exp G) S + P V'``, ``S' = exp(G_C) S + (exp(G_C - G) K)^T V'``.
The chunk functions are core-op IR functions added to the module (like the decomposition's step function), so
every op goes through the same lowering table.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from k3ir.builder import Builder
from k3ir.ir import Function
from k3ir.types import TensorType

from .config import get_mlir_config
from .lowering import _mixed, lowers
from .values import FLOAT, Val, ttype

if TYPE_CHECKING:                       # annotations only: emit imports this module
    from .emit import MlirEmitter

NC = "kda_chunks"          #: the symbolic chunk count of the chunk functions' types (bound per KDA op)


def _chunked_form(op) -> str | None:
    """Chunked in prefill (MlirConfig.kda_form="chunked"); one-token steps and kda_form="scan" take the recurrence."""
    form = get_mlir_config().kda_form
    if form != "chunked":
        return f"MlirConfig.kda_form={form!r}: the token recurrence"
    if op.operands[0].type.shape[1] == 1:
        return "one token: the recurrence step"
    return None


def _f32(*shape) -> TensorType:
    return TensorType("f32", shape)


def _chunk_step_function(module, Bd, H: int, K: int, V: int, C: int) -> Function:
    """``@kda_chunk_step_*``: one chunk's state pass (the scan body): ``(S, W, U, Qg, P, Kd, decay) -> (S', O)``;
    ``Bd`` the batch dim (a name or a static size, as the operands have it)."""
    name = f"kda_chunk_step_b{Bd}_h{H}_k{K}_v{V}_c{C}"
    if name in module.functions:
        return module.functions[name]
    fn = Function(name)
    b = Builder(module, fn)
    S = b.arg("S", _f32(Bd, H, K, V))
    W, U = b.arg("W", _f32(Bd, C, H, K)), b.arg("U", _f32(Bd, C, H, V))
    Qg, P = b.arg("Qg", _f32(Bd, C, H, K)), b.arg("P", _f32(Bd, H, C, C))
    Kd, decay = b.arg("Kd", _f32(Bd, C, H, K)), b.arg("decay", _f32(Bd, H, K))
    Vp = b.sub(U, b.einsum(W, S, equation="bchk,bhkv->bchv"))
    O = b.add(b.einsum(Qg, S, equation="bchk,bhkv->bchv"), b.einsum(P, Vp, equation="bhij,bjhv->bihv"))
    S1 = b.add(b.mul(S, b.reshape(decay, shape=[0, 0, 0, 1])), b.einsum(Kd, Vp, equation="bchk,bchv->bhkv"))
    b.ret(S1, O)
    module.add_function(fn)
    return fn


def _chunked_function(module, Bd, H: int, K: int, V: int, C: int, scale: float) -> Function:
    """``@kda_chunked_*``: padded, chunked q, k ``[B,NC,C,H,K]``, v ``[B,NC,C,H,V]``, the in-chunk cumulative
    log-decay G ``[B,NC,C,H,K]``, beta ``[B,NC,C,H]``, state ``[B,H,K,V]``, the constants L (lower-triangular ones)
    and I ``[C,C]`` and the decay-weighted products ``Akk``, ``Aqk`` ``[B,NC,H,C,C]`` (``_decayed_scores``) ->
    (o ``[B,NC,C,H,V]``, state) in core ops (module docstring)."""
    name = f"kda_chunked_b{Bd}_h{H}_k{K}_v{V}_c{C}_s{scale!r}".replace(".", "p").replace("-", "m")
    if name in module.functions:
        return module.functions[name]
    step = _chunk_step_function(module, Bd, H, K, V, C)
    fn = Function(name)
    b = Builder(module, fn)
    q, k = b.arg("q", _f32(Bd, NC, C, H, K)), b.arg("k", _f32(Bd, NC, C, H, K))
    v, G = b.arg("v", _f32(Bd, NC, C, H, V)), b.arg("G", _f32(Bd, NC, C, H, K))
    beta, S0 = b.arg("beta", _f32(Bd, NC, C, H)), b.arg("S", _f32(Bd, H, K, V))
    L, eye = b.arg("L", _f32(C, C)), b.arg("I", _f32(C, C))
    Akk, Aqk = b.arg("Akk", _f32(Bd, NC, H, C, C)), b.arg("Aqk", _f32(Bd, NC, H, C, C))
    beta_i = b.reshape(b.transpose(beta, perm=[0, 1, 3, 2]), shape=[0, 0, 0, 0, 1])   # [B,NC,H,C,1]
    strict = b.sub(L, eye)
    A = b.mul(b.mul(Akk, beta_i), strict)
    power = b.neg(A)
    inv = b.add(eye, power)                                                         # (I + A)^-1 = prod (I + (-A)^(2^m))
    for _ in range(max(0, math.ceil(math.log2(C)) - 1)):
        power = b.matmul(power, power)
        inv = b.matmul(inv, b.add(eye, power))
    M = b.mul(inv, b.reshape(b.transpose(beta, perm=[0, 1, 3, 2]), shape=[0, 0, 0, 1, C]))   # (I + A)^-1 Diag(beta)
    eG = b.exp(G)
    W = b.einsum(M, b.mul(eG, k), equation="bnhij,bnjhk->bnihk")
    U = b.einsum(M, v, equation="bnhij,bnjhv->bnihv")
    P = b.mul(Aqk, scale)
    Qg = b.mul(b.mul(eG, q), scale)
    GC = b.slice(G, axis=2, start=C - 1)                                            # [B,NC,1,H,K]
    Kd = b.mul(b.exp(b.sub(GC, G)), k)
    dC = b.reshape(b.exp(GC), shape=[0, 0, H, K])                                   # [B,NC,H,K]
    S1, O = b.scan(S0, W, U, Qg, P, Kd, dC, body=step.name, n_carry=1,
                   result_types=[str(S0.type), str(_f32(Bd, NC, C, H, V))])
    b.ret(O, S1)
    module.add_function(fn)
    return fn


def _cumulative(e: MlirEmitter, g: Val, L: Val) -> Val:
    """The in-chunk cumulative log-decay ``G[b,n,i,h,c] = sum_j L[i,j] g[b,n,j,h,c]`` of chunked g ``[B,NC,C,H,K]``
    (L: the lower-triangular ones ``[C,C]``), one ``linalg.generic`` contraction."""
    def region(a, o):
        return [e.body_op(f"arith.addf {o[0]}, {e.body_op(f'arith.mulf {a[0]}, {a[1]} : f32')} : f32")]
    (G,) = e.gen(6, ["parallel"] * 5 + ["reduction"], [(L, ["d2", "d5"]), (g, ["d0", "d1", "d5", "d3", "d4"])],
                 [(e.filled(g.shape, FLOAT, 0.0), g.type, FLOAT, ["d0", "d1", "d2", "d3", "d4"])], region)
    return Val(G, FLOAT, g.shape)


def _decayed_scores(e: MlirEmitter, G: Val, k: Val, q: Val) -> tuple[Val, Val]:
    """``Akk[b,n,h,i,j] = sum_c k[i,c] k[j,c] exp(G[i,c] - G[j,c])`` and ``Aqk`` (q in place of the first k) for
    ``j <= i``, 0 above the diagonal, from chunked G, k, q ``[B,NC,C,H,K]`` (rows i, j of chunk n, head h): one
    ``linalg.generic`` with two results that computes each decay once, inside the contraction (the difference masked
    to -inf above the diagonal before the exp: exact for either gate form), reading the last axis (K) contiguously;
    never a ``[B,NC,H,K,C,C]`` tensor of decays. Returns (Akk, Aqk) ``[B,NC,H,C,C]``."""
    B, N, C, H, _ = G.shape
    shape = (B, N, H, C, C)
    ninf = e.cscalar(float("-inf"))

    def region(a, o):
        gi, gj, ki, qi, kj = a
        keep = e.body_op(f"arith.cmpi ule, {e.body_op('linalg.index 4 : index')}, "
                         f"{e.body_op('linalg.index 3 : index')} : index")
        d = e.body_op(f"arith.select {keep}, {e.body_op(f'arith.subf {gi}, {gj} : f32')}, {ninf} : f32")
        kd = e.body_op(f"arith.mulf {kj}, {e.body_op(f'math.exp {d} : f32')} : f32")
        return [e.body_op(f"arith.addf {o[0]}, {e.body_op(f'arith.mulf {ki}, {kd} : f32')} : f32"),
                e.body_op(f"arith.addf {o[1]}, {e.body_op(f'arith.mulf {qi}, {kd} : f32')} : f32")]
    row_i, row_j = ["d0", "d1", "d3", "d2", "d5"], ["d0", "d1", "d4", "d2", "d5"]
    out = (ttype(shape, FLOAT), FLOAT, ["d0", "d1", "d2", "d3", "d4"])
    akk, aqk = e.gen(6, ["parallel"] * 5 + ["reduction"], [(G, row_i), (G, row_j), (k, row_i), (q, row_i), (k, row_j)],
                     [(e.filled(shape, FLOAT, 0.0),) + out, (e.filled(shape, FLOAT, 0.0),) + out], region)
    return Val(akk, FLOAT, shape), Val(aqk, FLOAT, shape)


def _dense_const(e: MlirEmitter, a: np.ndarray) -> Val:
    rows = ", ".join("[" + ", ".join(f"{x:.1f}" for x in r) + "]" for r in a)
    t = ttype(a.shape, FLOAT)
    return Val(e.assign(f"arith.constant dense<[{rows}]> : {t}", "c"), FLOAT, a.shape)


def _chunks(e: MlirEmitter, x: Val, pad: str, nc: str, C: int) -> Val:
    """``x [B,T,...]`` zero-padded to ``Tp`` on axis 1 and viewed as ``[B,NC,C,...]``."""
    r = len(x.shape)
    zero = e.cscalar(0.0)
    padded_shape = (x.shape[0], "kda_padded") + tuple(x.shape[2:])
    lows = ", ".join(["0"] * r)
    highs = ", ".join(["0", pad] + ["0"] * (r - 2))
    pt = ttype(padded_shape, x.elem)
    p = e.fresh("pad")
    e.emit(f"{p} = tensor.pad {x.name} low[{lows}] high[{highs}] {{")
    e.emit(f"^bb0({', '.join(f'%i{i}_{p[1:]}: index' for i in range(r))}):")
    e.emit(f"  tensor.yield {zero} : {x.elem}")
    e.emit(f"}} : {x.type} to {pt}")
    shape = (x.shape[0], NC, C) + tuple(x.shape[2:])
    groups = ", ".join(["[0]", "[1, 2]"] + [f"[{i + 1}]" for i in range(2, r)])
    dims = ", ".join([_mixed(e, x.shape[0]), nc, str(C)] + [_mixed(e, d) for d in x.shape[2:]])
    out = e.assign(f"tensor.expand_shape {p} [{groups}] output_shape [{dims}] : {pt} into {ttype(shape, x.elem)}", "ck")
    return Val(out, x.elem, shape)


@lowers("k3.kda", when=_chunked_form)
def _kda(e: MlirEmitter, op, inst, q, k, v, g, beta, s=None):
    """``k3.kda`` in the chunked form (module docstring)."""
    C = int(get_mlir_config().kda_chunk)
    B, T, H, K = q.shape
    V = int(v.shape[3])
    H, K = int(H), int(K)
    t = e.dim(T)
    nc = e.assign(f"arith.ceildivui {t}, {e.cindex(C)} : index", "nc")
    tp = e.assign(f"arith.muli {nc}, {e.cindex(C)} : index", "tp")
    pad = e.assign(f"arith.subi {tp}, {t} : index", "pad")
    e.dims_cache[NC] = nc
    e.dims_cache["kda_padded"] = tp
    if s is None:
        s = Val(e.filled((B, H, K, V), FLOAT, 0.0), FLOAT, (B, H, K, V))
    qc, kc, vc, gc, bc = (_chunks(e, x, pad, nc, C) for x in (q, k, v, g, beta))
    L, eye = _dense_const(e, np.tril(np.ones((C, C)))), _dense_const(e, np.eye(C))
    G = _cumulative(e, gc, L)
    akk, aqk = _decayed_scores(e, G, kc, qc)
    fn = _chunked_function(e.module, B, H, K, V, C, float(inst.scale))
    o, state = e.emit_function(fn, [qc, kc, vc, G, bc, s, L, eye, akk, aqk])
    flat_shape = (B, "kda_padded", H, V)
    flat = e.assign(f"tensor.collapse_shape {o.name} [[0], [1, 2], [3], [4]] : {o.type} into "
                    f"{ttype(flat_shape, FLOAT)}", "ck")
    out_shape = (B, T, H, V)
    sizes = ", ".join(_mixed(e, d) for d in out_shape)
    out = e.assign(f"tensor.extract_slice {flat}[0, 0, 0, 0] [{sizes}] [1, 1, 1, 1] : {ttype(flat_shape, FLOAT)} to "
                   f"{ttype(out_shape, FLOAT)}", "kda")
    return Val(out, FLOAT, out_shape), state
