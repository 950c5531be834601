"""The one device layout of MXFP4 expert weights on the triton target (issue 6): fragment words.

Both MXFP4 grouped-GEMM kernels read it: the Gluon kernel (``moe_gluon``, few rows per expert) and the Triton
kernels of ``moe`` (``_w_tile_frag`` below, any row count, prefill). The permutation is done ONCE, at prepare
time (``prepare_params`` -> ``to_fragments``), expert chunk by expert chunk and in place when the executable owns
the tensor, so the device holds exactly one copy of the expert bytes (same size as the packed original).

Layout (``E`` experts, ``N`` rows, ``K`` columns; ``N % 16 == 0``, ``K % 64 == 0``), as ``MXPacked``:
``words int32[E, N/16, K/64, 32, 4]``: word ``[e, mb, kc, lane, kr]`` is lane ``g*4+t``'s A fragment of one
``mma.m16n8k16`` (PTX ISA "Matrix Fragments for mma.m16n8k16") for the 16x16 block of rows ``16 mb..`` and
columns ``64 kc + 16 kr..``: register ``j = rh + 2 kh`` holds rows ``g + 8 rh``, columns ``2t + 8 kh + {0, 1}``
(low half = the even column). Each element's 4 E2M1 bits sit where a rotate + mask drops them into the bf16 bit
pattern ``fp4 * 2^-126`` (``FRAG_SHIFTS``, ``COMP``, ``WORD_POS``); the storage is the weight tensor's own (a
``uint8[E, N, K/2]`` tensor: the bytes of expert ``e`` stay in expert ``e``'s byte range). ``sc1
int32[E, N/16, 8, K/64]``: word ``[e, mb, g, kc]`` holds the multiplier exponents ``min(s,128)+126`` of (row g,
group 2kc), (g, 2kc+1), (g+8, 2kc), (g+8, 2kc+1) in bytes 0..3 (same bytes as the ``uint8[E, N, K/32]`` E8M0
scales, whose storage it takes); ``sc2`` the same for ``max(s,128)-1``, a new tensor, only when some scale byte
is > 128 (None otherwise). Value of an element: ``bf16(bits) * 2^(sc1-127) [* 2^(sc2-127)] = fp4 * 2^(s-127)``
(SPEC.md 7).

Marking: ``prepare`` (and ``mark``, for bytes already in the layout) turns the uint8 weight and scale tensors into
``FragTensor`` (class swap in place, same storage). The class survives clone / ``.to`` / slicing, so a copy is read
in the fragment layout from its own storage (or refused when its sc2 cannot be known), never as packed bytes;
ops that read the bytes as numbers raise ``FragmentLayoutError`` (a K3BackendError and ValueError). The kernels
address expert ``e`` at ``e * N * K / 8`` words (no strides): non-contiguous tensors (a stride-0 ``expand``) are
refused by ``lookup`` / ``check_packed`` before any launch.

A 16-row x 64-column block is 512 contiguous bytes, so a ``[BW, BK]`` tile (BW % 16 == 0, BK % 64 == 0) reads
``BW/16`` runs of ``BK/64 x 512`` contiguous bytes: 16-byte vector loads (a lane's 4 words), fully coalesced.

Triton kernels on this layout (``_w_tile_frag``, ``moe`` QUANT 8), offline sm_90 with Triton 3.6
(``PYTHONPATH=/tmp/triton36 python bench/probes/moe_offline.py frag --sass``), K3 shapes, innermost K loop per thread:
T=256 GLU ("t" 64/16+16 BK128) 128 registers, 390 SASS instructions = 3.05 per weight element (the byte layout's
asm1: 222 registers, 6.34/el: no LDS.U8 gathering, no PRMT re-pairing: the decoded words land in the wgmma A
registers), down 163 registers 3.03/el (asm1 6.41); T=8192 GLU ("t" 64/128+64 BK64 w8) 255 registers, 250
instructions per BK step (asm1 439), down 246 / 159 (asm1 267); no spills anywhere; two multipliers +0.7/el.
"""
from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from k3ir.errors import K3BackendError

# --- the fragment word ----------------------------------------------------------------------------------------
# Output register j of a word is ``rotr(w, r) & FRAG_MASK`` for j = 0, 1, 2 (r = FRAG_SHIFTS[j]) and, for j = 3
# (no fourth rotation of the mask tiles the word, checked by exhaustive search),
# ``(rotr(w, 6) & 0x81808180) | (rotr(w, 14) & 0x00400040)``.
# In each bf16 half: E2M1 m -> bit 6, e0 -> 7, e1 -> 8, sign -> 15: the bf16 value is fp4 * 2^-126.
FRAG_MASK = 0x81C081C0
FRAG_SHIFTS = (0, 4, 10)
COMP = ((6, 0x81808180), (14, 0x00400040))        # (rotation, mask) pairs of register 3
_HALF_BITS = (6, 7, 8, 15)                          # bf16 bit of nibble bit b (m, e0, e1, sign), low half


def _word_bit_positions():
    """pos[j][h][b]: the word bit holding nibble bit b of register j's half h (see FRAG_SHIFTS, COMP)."""
    pos = []
    for j in range(4):
        rj = []
        for h in range(2):
            rb = []
            for b in range(4):
                p = _HALF_BITS[b] + 16 * h
                r = FRAG_SHIFTS[j] if j < 3 else next(rr for rr, m in COMP if (m >> p) & 1)
                rb.append((p + r) % 32)
            rj.append(rb)
        pos.append(rj)
    flat = [q for rj in pos for rb in rj for q in rb]
    assert sorted(flat) == list(range(32)), "fragment bit placement must use every word bit once"
    return pos


WORD_POS = _word_bit_positions()


def _decode_asm(two: bool) -> str:
    """PTX for one fragment word (pack=2: $4/$5 = the word twice, $6/$7 = multiplier word twice, $8/$9 the
    second multiplier): outputs $0..$3 = bf16x2 registers j = 0..3 (rows g, g+8, g, g+8; columns 2t.., 2t..,
    2t+8.., 2t+8..). The multiplier word holds row g's bf16 multiplier in its low half, row g+8's in its high."""
    s = ("{\n.reg .b32 a, b, z, m0, m1, n0, n1;\n.reg .b16 ml, mh, nl, nh;\nmov.b32 z, 0x80008000;\n"
         "mov.b32 {ml, mh}, $6;\nmov.b32 m0, {ml, ml};\nmov.b32 m1, {mh, mh};\n")
    if two:
        s += "mov.b32 {nl, nh}, $8;\nmov.b32 n0, {nl, nl};\nmov.b32 n1, {nh, nh};\n"
    for j in range(4):
        m = "m0" if j % 2 == 0 else "m1"
        if j == 0:
            s += f"and.b32 a, $4, {FRAG_MASK:#010x};\n"
        elif j < 3:
            s += f"shf.r.wrap.b32 a, $4, $4, {FRAG_SHIFTS[j]};\nand.b32 a, a, {FRAG_MASK:#010x};\n"
        else:
            (r0, k0), (r1, k1) = COMP
            s += (f"shf.r.wrap.b32 a, $4, $4, {r0};\nand.b32 a, a, {k0:#010x};\n"
                  f"shf.r.wrap.b32 b, $4, $4, {r1};\nand.b32 b, b, {k1:#010x};\nor.b32 a, a, b;\n")
        s += f"fma.rn.bf16x2 ${j}, a, {m}, z;\n"          # a * m + (-0): exact, keeps the sign of zero
        if two:
            s += f"fma.rn.bf16x2 ${j}, ${j}, {'n0' if j % 2 == 0 else 'n1'}, z;\n"
    return s + "}"


# Triton 3.6 reads only constexpr globals inside @jit functions (gl.constexpr is tl.constexpr)
DEC1 = tl.constexpr(_decode_asm(False))
DEC2 = tl.constexpr(_decode_asm(True))


class MXPacked(NamedTuple):
    """MXFP4 expert weights in the fragment-word layout (module docstring): words, sc1, sc2 (or None), N, K."""
    words: torch.Tensor
    sc1: torch.Tensor
    sc2: torch.Tensor | None
    N: int
    K: int

    @property
    def two(self) -> bool:
        return self.sc2 is not None


def _byte_luts() -> list[list[int]]:
    """lut[j][byte]: the word bits of register j for one packed byte (low nibble = half 0, high = half 1), as
    int32 values (two's complement)."""
    luts = []
    for j in range(4):
        row = []
        for v in range(256):
            w = 0
            for h in range(2):
                c = (v >> (4 * h)) & 15
                for b in range(4):
                    w |= ((c >> b) & 1) << WORD_POS[j][h][b]
            row.append(w - (1 << 32) if w >= 1 << 31 else w)
        luts.append(row)
    return luts


_LUTS = _byte_luts()


def _pack_words(p: torch.Tensor) -> torch.Tensor:
    """packed uint8[E, N, K/2] -> int32 words [E, N/16, K/64, 32, 4] (module docstring). Register j = rh + 2 kh
    of a word holds the two elements 2t + 8 kh + {0, 1} of row g + 8 rh: exactly one packed byte."""
    E, N, K2 = p.shape
    b = p.reshape(E, N // 16, 2, 8, K2 // 32, 4, 2, 4)                      # e mb rh g kc kr kh t
    b = b.permute(0, 1, 4, 3, 7, 5, 6, 2).long()                            # e mb kc g t kr kh rh  (j = 2 kh + rh)
    b = b.reshape(E, N // 16, K2 // 32, 32, 4, 4)
    lut = torch.tensor(_LUTS, dtype=torch.int32, device=p.device)
    w = lut[0][b[..., 0]] | lut[1][b[..., 1]] | lut[2][b[..., 2]] | lut[3][b[..., 3]]
    return w.contiguous()


def _pack_scales(e8: torch.Tensor) -> torch.Tensor:
    """exponent bytes int64[E, N, K/32] -> int32 [E, N/16, 8, K/64] (word [e, mb, g, kc], bytes: (g, 2kc),
    (g, 2kc+1), (g+8, 2kc), (g+8, 2kc+1)): a row group's words are contiguous along K."""
    E, N, G = e8.shape
    s = e8.reshape(E, N // 16, 2, 8, G // 2, 2).permute(0, 1, 3, 4, 2, 5)          # e mb g kc rh grp
    s = s.reshape(E, N // 16, 8, G // 2, 4)
    w = s[..., 0] | (s[..., 1] << 8) | (s[..., 2] << 16) | (s[..., 3] << 24)
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32).contiguous()


def fits(packed: torch.Tensor, scales: torch.Tensor | None) -> bool:
    """Whether ``packed uint8[E, N, K/2]`` with ``scales uint8[E, N, K/32]`` can take the layout (N % 16 == 0,
    K % 64 == 0, contiguous, one byte per element)."""
    if scales is None or packed.dim() != 3 or packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        return False
    E, N, K2 = packed.shape
    return (N % 16 == 0 and (2 * K2) % 64 == 0 and tuple(scales.shape) == (E, N, K2 // 16)
            and packed.is_contiguous() and scales.is_contiguous())


def to_fragments(packed: torch.Tensor, scales: torch.Tensor, inplace: bool = False, chunk: int = 16) -> MXPacked:
    """Permute MXFP4 experts (``packed uint8[E, N, K/2]``, low nibble = even element; ``scales uint8[E, N,
    K/32]`` E8M0) into the fragment-word layout, ``chunk`` experts at a time on the tensors' device (extra memory:
    one chunk). ``inplace``: the words overwrite ``packed``'s storage and sc1 ``scales``' (their bytes are then
    NOT the original format any more: ``prepare``/``mark`` mark them); else new tensors. Raises ValueError unless
    ``fits`` (FragmentLayoutError for tensors already in the layout)."""
    if isinstance(packed, FragTensor) or isinstance(scales, FragTensor):
        raise FragmentLayoutError("MXFP4 expert weights already in the fragment layout: not permuted twice")
    if not fits(packed, scales):
        raise ValueError(f"MXFP4 fragment layout needs contiguous uint8 packed [E, N, K/2] and scales [E, N, K/32] "
                         f"with N % 16 == 0 and K % 64 == 0; got packed {tuple(packed.shape)} {packed.dtype}, scales "
                         f"{tuple(getattr(scales, 'shape', ()))}")
    E, N, K2 = packed.shape
    K = 2 * K2
    two = bool((scales > 128).any().item()) if scales.numel() else False
    wo = packed if inplace else torch.empty_like(packed)
    so = scales if inplace else torch.empty_like(scales)
    s2 = torch.empty(E * N * K // 128, dtype=torch.int32, device=packed.device) if two else None
    wflat, sflat = wo.view(-1).view(torch.int32), so.view(-1).view(torch.int32)
    per_w, per_s = N * K // 8, N * K // 128        # int32 words per expert
    for e0 in range(0, E, chunk):
        e1 = min(E, e0 + chunk)
        words = _pack_words(packed[e0:e1])
        sb = scales[e0:e1].to(torch.int64)
        s1 = _pack_scales(torch.clamp(sb, max=128) + 126)
        if two:
            s2[e0 * per_s:e1 * per_s] = _pack_scales(torch.clamp(sb, min=128) - 1).view(-1)
        wflat[e0 * per_w:e1 * per_w] = words.view(-1)       # expert e's bytes stay in expert e's range
        sflat[e0 * per_s:e1 * per_s] = s1.view(-1)
        del words, sb, s1
    return MXPacked(wflat.view(E, N // 16, K // 64, 32, 4), sflat.view(E, N // 16, 8, K // 64),
                    s2.view(E, N // 16, 8, K // 64) if two else None, N, K)


def pack_mxfp4(packed: torch.Tensor, scales: torch.Tensor, chunk: int = 16) -> MXPacked:
    """``to_fragments`` into new tensors (the inputs are left as they are)."""
    return to_fragments(packed, scales, inplace=False, chunk=chunk)


class FragmentLayoutError(K3BackendError, ValueError):
    """MXFP4 expert tensors in the fragment layout used in a way that would misread them (a ValueError too)."""


class FragTensor(torch.Tensor):
    """A ``uint8`` expert tensor whose bytes hold the fragment layout (the words, or sc1). The class is the
    marker: it survives ``clone()``, ``.to()``, ``.cpu()``, ``.contiguous()``, slicing and ``empty_like``, so a
    copy is never taken for packed bytes (``lookup`` rebuilds its ``MXPacked`` from the copy's own storage), and
    ops that would read the bytes as numbers (bitwise ops and shifts, any result of another dtype than uint8
    except a ``view``) raise ``FragmentLayoutError`` (e.g. the torch dequantisation of the original layout).
    The kernels get plain int32 views (``MXPacked``), never this class."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _deny():
            raise FragmentLayoutError(f"{getattr(func, '__name__', func)} on MXFP4 expert weights in the fragment "
                                      "layout (moe_layout): their bytes are not packed E2M1 pairs any more")
        out = super().__torch_function__(func, types, args, kwargs)
        if (isinstance(out, torch.Tensor) and out.dtype != torch.uint8 and func not in _views()
                and any(isinstance(a, FragTensor) for a in args)):
            raise FragmentLayoutError(f"{getattr(func, '__name__', func)} reads MXFP4 expert weights in the fragment "
                                      f"layout as {out.dtype} (moe_layout): their bytes are not packed E2M1 pairs")
        return out

    def __repr__(self, *, tensor_contents=None):
        return (f"FragTensor(MXFP4 fragment layout, shape={tuple(self.shape)}, device={self.device}, "
                f"{'two multipliers' if isinstance(self, FragScales2) else 'one multiplier'})")

    def __deepcopy__(self, memo):
        return self.clone()

    def __reduce_ex__(self, proto):
        raise FragmentLayoutError("MXFP4 expert weights in the fragment layout are a device layout of the triton "
                                  "target: pickle/save the original packed bytes, not the prepared tensors")


class FragScales2(FragTensor):
    """sc1 of weights that also need sc2 (some scale byte > 128): a copy of it cannot recover sc2 (an error)."""


_DENY: set = set()
_VIEWS: set = set()


_DENY_NAMES = ("__and__", "__rand__", "__iand__", "__or__", "__ror__", "__ior__", "__xor__", "__rxor__", "__ixor__",
               "__rshift__", "__rrshift__", "__irshift__", "__lshift__", "__rlshift__", "__ilshift__", "__invert__",
               "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "bitwise_right_shift", "bitwise_left_shift",
               "numpy", "__array__", "tolist")     # host copies of the raw bytes: k3ir.save(m, session.params) would
#                                                   write the fragment layout as if it were packed E2M1 pairs


def _deny() -> set:
    """Tensor methods and torch functions that read the bytes as packed E2M1 pairs (bitwise ops, shifts) or hand
    them to NumPy (``.numpy()``, ``np.asarray``, ``.tolist()``: a checkpoint written from them would be wrong)."""
    if not _DENY:
        _DENY.update(f for src in (torch.Tensor, torch) for n in _DENY_NAMES if (f := getattr(src, n, None)))
    return _DENY


def _views() -> set:
    if not _VIEWS:
        _VIEWS.update({torch.Tensor.view, torch.Tensor.as_subclass})
    return _VIEWS


class _Meta(NamedTuple):
    pk: MXPacked
    scales: object          # weakref to the scale tensor this MXPacked was built with
    version: tuple          # (w._version, scales._version) when it was built


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if isinstance(t, FragTensor) else t


def check_packed(pk: MXPacked, where: str = "MXFP4 fragment layout") -> MXPacked:
    """Raise ``FragmentLayoutError`` unless ``pk``'s words / sc1 / sc2 are contiguous int32 tensors of the shapes
    of the module docstring for ``E = words.shape[0]`` experts on one device (a stride-0 ``expand`` of one expert
    or any other view the kernels' ``e * (N/16) * (K/64)`` block offsets would read past). Python-level only."""
    E = pk.words.shape[0] if pk.words.dim() == 5 else -1
    shapes = ((pk.words, (E, pk.N // 16, pk.K // 64, 32, 4)), (pk.sc1, (E, pk.N // 16, 8, pk.K // 64)))
    if pk.sc2 is not None:
        shapes += ((pk.sc2, (E, pk.N // 16, 8, pk.K // 64)),)
    for name, (t, shp) in zip(("words", "sc1", "sc2"), shapes):
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != shp
                or not t.is_contiguous() or t.device != pk.words.device or pk.N % 16 or pk.K % 64):
            desc = (f"{tuple(t.shape)} {t.dtype} strides {t.stride()} on {t.device}" if isinstance(t, torch.Tensor)
                    else type(t).__name__)
            raise FragmentLayoutError(f"{where}: {name} must be a contiguous int32 tensor {shp} (N={pk.N}, "
                                      f"K={pk.K}) on {pk.words.device}, got {desc}; the kernels address expert e "
                                      "at e * N * K / 8 words, so a stride-0 expand() or a strided view would read "
                                      "out of bounds (make it contiguous, or prepare the weights again)")
    return pk


def _views_of(w: torch.Tensor, scales: torch.Tensor, sc2) -> MXPacked:
    """``MXPacked`` views of the bytes of ``w`` (uint8 [E, N, K/2]) and ``scales`` (uint8 [E, N, K/32]) that
    already hold the fragment layout; raises FragmentLayoutError unless both are contiguous and consistent."""
    w, scales = _plain(w), _plain(scales)
    if not fits(w, scales) or w.device != scales.device:
        raise FragmentLayoutError(
            f"MXFP4 fragment layout: weights {tuple(w.shape)} {w.dtype} strides {w.stride()} and scales "
            f"{tuple(getattr(scales, 'shape', ()))} strides {scales.stride() if isinstance(scales, torch.Tensor) else ''}"
            " must be contiguous uint8 [E, N, K/2] and [E, N, K/32] on one device (N % 16 == 0, K % 64 == 0); a "
            "stride-0 expand() or strided view of prepared experts would make the kernels read out of bounds")
    E, N, K2 = w.shape
    K = 2 * K2
    pk = MXPacked(w.view(-1).view(torch.int32).view(E, N // 16, K // 64, 32, 4),
                  scales.view(-1).view(torch.int32).view(E, N // 16, 8, K // 64), sc2, N, K)
    return check_packed(pk)


def mark(w: torch.Tensor, scales: torch.Tensor, sc2: torch.Tensor | None = None) -> MXPacked:
    """Declare that the bytes of ``w`` (uint8 [E, N, K/2]) and ``scales`` (uint8 [E, N, K/32]) ALREADY hold the
    fragment layout (words and sc1; ``sc2 int32[E, N/16, 8, K/64]`` when two multipliers are needed): both
    objects become ``FragTensor`` in place (class swap, same storage) and ``moe.grouped_matmul(x, off, w, scales,
    "mxfp4")`` reads them in that layout. Returns their ``MXPacked``. Raises FragmentLayoutError on a
    non-contiguous / inconsistent tensor (e.g. a stride-0 ``expand``)."""
    pk = _views_of(w, scales, sc2)
    w.__class__ = FragTensor
    scales.__class__ = FragScales2 if sc2 is not None else FragTensor
    w._k3frag = _Meta(pk, weakref.ref(scales), (w._version, scales._version))
    scales._k3frag_sc2 = sc2
    return pk


def lookup(w, scales) -> MXPacked | None:
    """The ``MXPacked`` of weights in the fragment layout (``FragTensor``), None for weights in the original
    packed layout. A copy / moved / sliced FragTensor (``clone``, ``.to``, ``w[a:b]``) is read from its own
    storage (cached on the object); sc2 comes from the scale tensor ``prepare``/``mark`` made. Raises
    FragmentLayoutError when only one of ``w``/``scales`` is in the layout, when ``w`` was written after its
    permutation, when a copied scale tensor needed sc2 (``FragScales2``: not recoverable from a copy), or on
    non-contiguous tensors (the kernels would read out of bounds). Python-level checks only."""
    fw, fs = isinstance(w, FragTensor), isinstance(scales, FragTensor)
    if not (fw or fs):
        return None
    if fw != fs:
        raise FragmentLayoutError("MXFP4 weights and scales must both be in the fragment layout or both in the "
                                  f"original packed layout (weights: {'fragment' if fw else 'packed'}, scales: "
                                  f"{'fragment' if fs else 'packed'}): prepare them together (moe_layout.prepare)")
    m = w.__dict__.get("_k3frag")
    with torch._C.DisableTorchFunctionSubclass():       # metadata reads without the subclass dispatch (~3 us each)
        ver = (w._version, scales._version)
    if m is not None and m.scales() is scales:
        if m.version != ver:
            raise FragmentLayoutError("MXFP4 expert weights in the fragment layout were modified after their "
                                      "permutation: prepare them again from the original bytes (moe_layout.prepare)")
        return m.pk
    sc2 = scales.__dict__.get("_k3frag_sc2")
    if isinstance(scales, FragScales2) and sc2 is None:
        raise FragmentLayoutError("a copy of MXFP4 fragment-layout scales that needed a second multiplier (a scale "
                                  "byte > 128): the copy has no sc2; prepare the copy from the original bytes")
    if sc2 is not None and tuple(sc2.shape[:1]) != tuple(w.shape[:1]):
        raise FragmentLayoutError(f"MXFP4 fragment layout: sc2 of {sc2.shape[0]} experts with weights of "
                                  f"{w.shape[0]} (a slice of scales with two multipliers): prepare the slice again")
    pk = _views_of(w, scales, sc2)
    w._k3frag = _Meta(pk, weakref.ref(scales), ver)
    return pk


def prepare(w: torch.Tensor, scales: torch.Tensor, inplace: bool = True, chunk: int = 16):
    """Permute one expert tensor into the fragment layout and mark it (``mark``: ``FragTensor``); returns
    ``(w', scales')``: the tensors to pass to ``moe.grouped_matmul`` from now on (``w``/``scales`` themselves,
    class-swapped, when ``inplace``: their original bytes are then gone). Raises ValueError unless ``fits``, and
    FragmentLayoutError for tensors already in the layout (never permuted twice)."""
    if isinstance(w, FragTensor) or isinstance(scales, FragTensor):
        raise FragmentLayoutError("MXFP4 expert weights already in the fragment layout: not permuted twice")
    pk = to_fragments(w, scales, inplace=inplace, chunk=chunk)
    wo = w if inplace else pk.words.view(-1).view(torch.uint8).view(w.shape)
    so = scales if inplace else pk.sc1.view(-1).view(torch.uint8).view(scales.shape)
    mark(wo, so, pk.sc2)
    return wo, so


def _mxfp4_slots(op) -> dict[int, int]:
    """operand index -> 2 (an MXFP4 expert weight) or 3 (its scales) of a ``k3.grouped_matmul`` (quant mxfp4:
    operands x, offsets, w, scales) or a ``k3.moe_experts`` (quant mxfp4: rows, offsets, then each expert weight
    followed by its scales); {} for any other op."""
    if op.attrs.get("quant") != "mxfp4":
        return {}
    if op.name == "k3.grouped_matmul":
        return {2: 2, 3: 3} if len(op.operands) > 3 else {}
    if op.name == "k3.moe_experts":
        nw = (2 if op.attrs.get("glu", True) else 0) + (1 if op.attrs.get("down", True) else 0)
        return {2 + 2 * j + r: 2 + r for j in range(nw) for r in (0, 1)}
    return {}


def mxfp4_pairs(module) -> list[tuple[str, str]]:
    """(weight, scales) parameter names of the module's MXFP4 expert weights whose every use is an MXFP4
    ``k3.grouped_matmul`` or ``k3.moe_experts`` taking them as an expert weight and its scales (anything else keeps
    the original layout)."""
    uses: dict = {}
    pairs: dict = {}
    for fn in module.functions.values():
        pname = {id(op.results[0]): op.attrs["name"] for op in fn.ops if op.name == "k3.param"}
        for op in fn.ops:
            slots = _mxfp4_slots(op)
            for i, v in enumerate(op.operands):
                n = pname.get(id(v)) if v is not None else None
                if n is None:
                    continue
                kind = slots.get(i, -1)
                uses.setdefault(n, set()).add(kind)
                if kind == 2:
                    pairs.setdefault(n, set()).add(pname.get(id(op.operands[i + 1])))
    out = []
    for w, ss in pairs.items():
        if len(ss) == 1 and None not in ss:
            s = next(iter(ss))
            if uses.get(w) == {2} and uses.get(s) == {3}:
                out.append((w, s))
    return out


def _ptr(a) -> int | None:
    if isinstance(a, torch.Tensor):
        return a.data_ptr()
    ai = getattr(a, "__array_interface__", None)
    return ai["data"][0] if ai else None


def prepare_params(module, params: dict, given: dict) -> int:
    """Prepare-time permutation of a module's MXFP4 expert tensors (``mxfp4_pairs``) in ``params`` (the
    executable's prepared tensors; ``given``: what the caller passed). In place where the executable owns the
    tensor (a copy made by ``prepare_params``: host arrays moved to the device), else into new tensors (the
    caller's arrays are never modified; while the caller holds its device tensors both exist), one expert tensor
    at a time. Tensors already in the layout (``FragTensor``) are kept. Returns the number of tensors permuted."""
    n = 0
    for wn, sn in mxfp4_pairs(module):
        w, s = params.get(wn), params.get(sn)
        if isinstance(w, FragTensor) or isinstance(s, FragTensor):
            lookup(w, s)        # already in the layout (a prepared tensor passed again): checked, kept
            continue
        if not isinstance(w, torch.Tensor) or not fits(w, s):
            continue            # not this layout's shape
        own = _ptr(given.get(wn)) != w.data_ptr() and _ptr(given.get(sn)) != s.data_ptr()
        params[wn], params[sn] = prepare(w, s, inplace=own)
        n += 1
    return n


# --- the Triton tile reader -----------------------------------------------------------------------------------
@triton.jit
def _rotr(u, r: tl.constexpr):
    return ((u >> r) | (u << (32 - r))) & 0xFFFFFFFF


@triton.jit
def _nib_val(reg, H: tl.constexpr, f):
    """fp32 value of the E2M1 element in half H of a placed bf16x2 register (int64 bits), times ``f``."""
    b = (reg >> (16 * H)) & 0xFFFF
    c = (((b >> 6) & 7) | ((b >> 12) & 8)).to(tl.int32)
    mag = c & 7
    bits = tl.where(mag < 2, mag * (126 << 23), (mag << 22) + (126 << 23)) | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * f


@triton.jit
def _kr4(a, b):
    """[..., 8] x2 (groups 2kc, 2kc+1) -> [..., 8, 1, 4] along kr = 2 grp + j (broadcast over t)."""
    m = tl.join(a, b)
    m = tl.reshape(tl.join(m, m), (a.shape[0], a.shape[1], a.shape[2], 4))
    return tl.expand_dims(m, 3)


@triton.jit
def _frag_join(o0, o1, o2, o3, BN: tl.constexpr, BK: tl.constexpr):
    """The four register outputs ``[MB, KQ, 8, 4, 4, 2(h)]`` -> the tile ``[BN, BK]`` (row 16 mb + 8 rh + g,
    column 64 kq + 16 kr + 8 kh + 2 t + h)."""
    r = tl.join(tl.join(o0, o1), tl.join(o2, o3))            # [mb, kq, g, t, kr, h, rh, kh]
    r = tl.permute(r, (0, 6, 2, 1, 4, 7, 3, 5))               # [mb, rh, g, kq, kr, kh, t, h]
    return tl.reshape(r, (BN, BK))


@triton.jit
def _w_tile_frag(w, s, t, e, n0, k0, N, K, EXACT: tl.constexpr, TWO: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, DT: tl.constexpr):
    """Weight tile ``W_e[n0:n0+BN, k0:k0+BK]`` in dtype DT from the fragment layout (w: words, s: sc1, t: sc2
    when TWO; n0 % 16 == 0, k0 % 64 == 0, BN % 16 == 0, BK % 64 == 0; rows >= N read as 0). EXACT: integer
    bit extraction + fp32 scale (the interpreter); else the PTX decode of the Gluon kernel (bf16x2 fma)."""
    MB: tl.constexpr = BN // 16
    KQ: tl.constexpr = BK // 64
    NB = N // 16
    KC = K // 64
    mb = (n0 // 16 + tl.arange(0, MB)).to(tl.int64)
    blk = (e.to(tl.int64) * NB + mb) * KC + k0 // 64                      # [MB]: the (mb, kc0) block
    i_mb = blk[:, None, None, None, None]
    i_kq = tl.arange(0, KQ)[None, :, None, None, None]
    i_g = tl.arange(0, 8)[None, None, :, None, None]
    i_t = tl.arange(0, 4)[None, None, None, :, None]
    i_kr = tl.arange(0, 4)[None, None, None, None, :]
    mw = (mb < NB)[:, None, None, None, None]
    wd = tl.load(w + (i_mb + i_kq) * 128 + i_g * 16 + i_t * 4 + i_kr, mask=mw, other=0)   # [MB, KQ, 8, 4, 4]
    sblk = (e.to(tl.int64) * NB + mb) * 8
    soff = (sblk[:, None, None] + tl.arange(0, 8)[None, None, :]) * KC + k0 // 64 + tl.arange(0, KQ)[None, :, None]
    ms = (mb < NB)[:, None, None]
    sw = tl.load(s + soff, mask=ms, other=0)                                                 # [MB, KQ, 8]
    if EXACT:
        u = wd.to(tl.int64) & 0xFFFFFFFF
        q0 = u & 0x81C081C0
        q1 = _rotr(u, 4) & 0x81C081C0
        q2 = _rotr(u, 10) & 0x81C081C0
        q3 = (_rotr(u, 6) & 0x81808180) | (_rotr(u, 14) & 0x00400040)
        se = sw.to(tl.int64) & 0xFFFFFFFF
        ex0 = (se & 0xFF) - 126                         # bytes: (g, 2kc), (g, 2kc+1), (g+8, 2kc), (g+8, 2kc+1)
        ex1 = ((se >> 8) & 0xFF) - 126
        ex2 = ((se >> 16) & 0xFF) - 126
        ex3 = ((se >> 24) & 0xFF) - 126
        if TWO:
            te = tl.load(t + soff, mask=ms, other=0).to(tl.int64) & 0xFFFFFFFF
            ex0 += (te & 0xFF) - 127
            ex1 += ((te >> 8) & 0xFF) - 127
            ex2 += ((te >> 16) & 0xFF) - 127
            ex3 += ((te >> 24) & 0xFF) - 127
        f0 = _kr4(tl.exp2(ex0.to(tl.float32) - 127.), tl.exp2(ex1.to(tl.float32) - 127.))   # row g
        f1 = _kr4(tl.exp2(ex2.to(tl.float32) - 127.), tl.exp2(ex3.to(tl.float32) - 127.))   # row g + 8
        o0 = tl.join(_nib_val(q0, 0, f0), _nib_val(q0, 1, f0))
        o1 = tl.join(_nib_val(q1, 0, f1), _nib_val(q1, 1, f1))
        o2 = tl.join(_nib_val(q2, 0, f0), _nib_val(q2, 1, f0))
        o3 = tl.join(_nib_val(q3, 0, f1), _nib_val(q3, 1, f1))
        return _frag_join(o0, o1, o2, o3, BN, BK).to(DT)
    else:
        m = tl.broadcast_to(_kr4((sw << 7) & 0x7F807F80, (sw >> 1) & 0x7F807F80), wd.shape)
        if TWO:
            tw = tl.load(t + soff, mask=ms, other=0)
            n = tl.broadcast_to(_kr4((tw << 7) & 0x7F807F80, (tw >> 1) & 0x7F807F80), wd.shape)
            o0, o1, o2, o3 = tl.inline_asm_elementwise(DEC2, "=r,=r,=r,=r,r,r,r,r,r,r",
                                                       [tl.join(wd, wd), tl.join(m, m), tl.join(n, n)],
                                                       dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
        else:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(DEC1, "=r,=r,=r,=r,r,r,r,r", [tl.join(wd, wd), tl.join(m, m)],
                                                       dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
        return _frag_join(o0, o1, o2, o3, BN, BK).to(DT)
