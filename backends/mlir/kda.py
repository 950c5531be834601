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
    """``@kda_chunked_*``: padded, chunked q, k ``[B,NC,C,H,K]``, v ``[B,NC,C,H,V]``, g ``[B,NC,C,H,K]``, beta
    ``[B,NC,C,H]``, state ``[B,H,K,V]`` and the constants L (lower-triangular ones) and I ``[C,C]`` ->
    (o ``[B,NC,C,H,V]``, state) in core ops (module docstring)."""
    name = f"kda_chunked_b{Bd}_h{H}_k{K}_v{V}_c{C}_s{scale!r}".replace(".", "p").replace("-", "m")
    if name in module.functions:
        return module.functions[name]
    step = _chunk_step_function(module, Bd, H, K, V, C)
    fn = Function(name)
    b = Builder(module, fn)
    q, k = b.arg("q", _f32(Bd, NC, C, H, K)), b.arg("k", _f32(Bd, NC, C, H, K))
    v, g = b.arg("v", _f32(Bd, NC, C, H, V)), b.arg("g", _f32(Bd, NC, C, H, K))
    beta, S0 = b.arg("beta", _f32(Bd, NC, C, H)), b.arg("S", _f32(Bd, H, K, V))
    L, eye = b.arg("L", _f32(C, C)), b.arg("I", _f32(C, C))
    G = b.einsum(L, g, equation="ij,bnjhk->bnihk")                                  # in-chunk cumulative log-decay
    Gt = b.transpose(G, perm=[0, 1, 3, 4, 2])                                       # [B,NC,H,K,C]
    diff = b.sub(b.reshape(Gt, shape=[0, 0, 0, 0, C, 1]), b.reshape(Gt, shape=[0, 0, 0, 0, 1, C]))
    decay = b.exp(b.causal_mask(diff))                                              # exp(G_i - G_j), j <= i; else 0
    beta_i = b.reshape(b.transpose(beta, perm=[0, 1, 3, 2]), shape=[0, 0, 0, 0, 1])   # [B,NC,H,C,1]
    strict = b.sub(L, eye)
    A = b.mul(b.mul(b.einsum(decay, k, k, equation="bnhcij,bnihc,bnjhc->bnhij"), beta_i), strict)
    power = b.neg(A)
    inv = b.add(eye, power)                                                         # (I + A)^-1 = prod (I + (-A)^(2^m))
    for _ in range(max(0, math.ceil(math.log2(C)) - 1)):
        power = b.matmul(power, power)
        inv = b.matmul(inv, b.add(eye, power))
    M = b.mul(inv, b.reshape(b.transpose(beta, perm=[0, 1, 3, 2]), shape=[0, 0, 0, 1, C]))   # (I + A)^-1 Diag(beta)
    eG = b.exp(G)
    W = b.einsum(M, b.mul(eG, k), equation="bnhij,bnjhk->bnihk")
    U = b.einsum(M, v, equation="bnhij,bnjhv->bnihv")
    P = b.mul(b.einsum(decay, q, k, equation="bnhcij,bnihc,bnjhc->bnhij"), scale)
    Qg = b.mul(b.mul(eG, q), scale)
    GC = b.slice(G, axis=2, start=C - 1)                                            # [B,NC,1,H,K]
    Kd = b.mul(b.exp(b.sub(GC, G)), k)
    dC = b.reshape(b.exp(GC), shape=[0, 0, H, K])                                   # [B,NC,H,K]
    S1, O = b.scan(S0, W, U, Qg, P, Kd, dC, body=step.name, n_carry=1,
                   result_types=[str(S0.type), str(_f32(Bd, NC, C, H, V))])
    b.ret(O, S1)
    module.add_function(fn)
    return fn


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
    ins = [_chunks(e, x, pad, nc, C) for x in (q, k, v, g, beta)]
    L = np.tril(np.ones((C, C)))
    consts = [_dense_const(e, L), _dense_const(e, np.eye(C))]
    fn = _chunked_function(e.module, B, H, K, V, C, float(inst.scale))
    o, state = e.emit_function(fn, ins + [s] + consts)
    flat_shape = (B, "kda_padded", H, V)
    flat = e.assign(f"tensor.collapse_shape {o.name} [[0], [1, 2], [3], [4]] : {o.type} into "
                    f"{ttype(flat_shape, FLOAT)}", "ck")
    out_shape = (B, T, H, V)
    sizes = ", ".join(_mixed(e, d) for d in out_shape)
    out = e.assign(f"tensor.extract_slice {flat}[0, 0, 0, 0] [{sizes}] [1, 1, 1, 1] : {ttype(flat_shape, FLOAT)} to "
                   f"{ttype(out_shape, FLOAT)}", "kda")
    return Val(out, FLOAT, out_shape), state
