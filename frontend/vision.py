"""The vision pathway (SPEC.md 8): MoonViT tower + patch-merger projector as the IR function
``encode_images``, the published checkpoint key names, and the peer's image preprocessing.

Parameters are named like the published Kimi K2.5/K3 checkpoint (the keys transformers'
``kimi_k25`` loader reads): ``vision_tower.patch_embed.proj.{weight,bias}``,
``vision_tower.patch_embed.pos_emb.weight`` ``[H0, W0, D]``,
``vision_tower.encoder.blocks.{i}.{norm0,norm1,wqkv,wo,mlp.fc0,mlp.fc1}.{weight,bias}``
(``wqkv`` fused q|k|v with the interleaved RoPE order), ``vision_tower.encoder.final_layernorm``,
``mm_projector.pre_norm``, ``mm_projector.proj.0`` and ``mm_projector.proj.2``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from k3ir.builder import Builder
from k3ir.errors import K3ConfigError, K3RuntimeError
from k3ir.ir import Function, Module, Value
from k3ir.types import TensorType

from .config_reader import _Reader

#: the peer's image processor defaults (transformers ``Kimi_K25ImageProcessor``)
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
MAX_PATCHES_PER_SIDE = 512
MAX_PATCHES = 16384
RESCALE = 1.0 / 255.0

ENCODER = "vision_tower.encoder."


@dataclass(frozen=True)
class VisionSpec:
    """MoonViT hyper-parameters read from ``vision_config`` (MoonViT key names)."""
    hidden: int
    layers: int
    heads: int
    intermediate: int
    patch: int
    pos_h: int
    pos_w: int
    pos_t: int
    merge: tuple[int, int]
    mm_hidden: int
    text_hidden: int
    projector_eps: float = 1e-5
    projector_act: str = "gelu"
    vit_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    ln_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def merged(self) -> int:
        return self.merge[0] * self.merge[1] * self.hidden

    def peer_config(self) -> dict[str, Any]:
        """Keyword arguments of transformers' ``Kimi_K25VisionConfig`` for this spec."""
        return {"patch_size": self.patch, "pos_emb_height": self.pos_h, "pos_emb_width": self.pos_w,
                "pos_emb_time": self.pos_t, "num_attention_heads": self.heads, "num_hidden_layers": self.layers,
                "hidden_size": self.hidden, "intermediate_size": self.intermediate, "hidden_act": self.vit_act,
                "merge_kernel_size": list(self.merge),
                "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta}}


def vision_spec(vc: dict, text_hidden: int, path: str | None = None) -> VisionSpec:
    """Validate ``vision_config`` (MoonViT names) -> VisionSpec; K3ConfigError names the key
    (``vision_config.<key>``) and ``path``. Values are read as the text config's are (config_reader.py
    ``_Reader``: types, ranges, finite floats, epsilons > 0)."""
    r = _Reader(vc, "vision_config.", path)
    hidden = r.get("vt_hidden_size", int, lo=1)
    heads = r.get("vt_num_attention_heads", int, lo=1)
    if hidden % heads or (hidden // heads) % 4:
        raise K3ConfigError(f"vt_hidden_size {hidden} / heads {heads} must give a head dim divisible by 4",
                            key="vision_config.vt_num_attention_heads", path=path)
    merge = vc.get("merge_kernel_size", [2, 2])
    if not (isinstance(merge, (list, tuple)) and len(merge) == 2 and all(isinstance(k, int) and k >= 1
                                                                          for k in merge)):
        raise K3ConfigError(f"must be two positive ints, got {merge!r}", key="vision_config.merge_kernel_size",
                            path=path)
    mm_hidden = r.get("mm_hidden_size", int, hidden, lo=1)
    if mm_hidden != hidden:
        raise K3ConfigError(f"the patch-merger normalises vision tokens of width vt_hidden_size={hidden}, "
                            f"got {mm_hidden}", key="vision_config.mm_hidden_size", path=path)
    th = r.get("text_hidden_size", int, text_hidden, lo=1)
    if th != text_hidden:
        raise K3ConfigError(f"{th} differs from the text hidden_size {text_hidden}",
                            key="vision_config.text_hidden_size", path=path)
    for key, want in (("mm_projector_type", "patchmerger"), ("projector_hidden_act", "gelu"),
                      ("pos_emb_type", "divided_fixed"), ("merge_type", "sd2_tpool")):
        if vc.get(key, want) != want:
            raise K3ConfigError(f"only {want!r} is supported, got {vc[key]!r}", key=f"vision_config.{key}",
                                path=path)
    return VisionSpec(hidden=hidden, layers=r.get("vt_num_hidden_layers", int, lo=1), heads=heads,
                      intermediate=r.get("vt_intermediate_size", int, lo=1), patch=r.get("patch_size", int, 14, lo=1),
                      pos_h=r.get("init_pos_emb_height", int, 64, lo=1), pos_w=r.get("init_pos_emb_width", int, 64, lo=1),
                      pos_t=r.get("init_pos_emb_time", int, 4, lo=1), merge=(int(merge[0]), int(merge[1])),
                      mm_hidden=mm_hidden, text_hidden=th, projector_eps=r.eps("projector_ln_eps", 1e-5))


# ---- the IR function ------------------------------------------------------------------------------
def build_encode_images(module: Module, spec: VisionSpec, dtype: str = "bf16") -> Function:
    """``encode_images(pixel_values [N, kh*MH, kw*MW, 3, p, p]) -> image_features [N, MH, MW, text_hidden]``:
    patch embedding, position table, ``layers`` pre-norm blocks (LayerNorm, 2-D RoPE attention,
    GELU-tanh MLP), final LayerNorm, then the projector (LayerNorm per patch, ``kh x kw`` merge,
    Linear, exact GELU, Linear). Declares the vision parameters on ``module``."""
    s = spec
    fn = Function("encode_images", attrs={"kind": "vision"})
    b = Builder(module, fn)
    kh, kw = s.merge
    gh = "MH" if kh == 1 else f"{kh}*MH"
    gw = "MW" if kw == 1 else f"{kw}*MW"
    px = b.arg("pixel_values", TensorType(dtype, ("N", gh, gw, 3, s.patch, s.patch)))
    D, H, Dh, I = s.hidden, s.heads, s.head_dim, s.intermediate

    def p(name: str, *shape: int) -> Value:
        return b.param(name, TensorType(dtype, tuple(shape)))

    def ln(x: Value, key: str, eps: float) -> Value:
        return b.layernorm(x, p(key + ".weight", x.type.shape[-1]), p(key + ".bias", x.type.shape[-1]), eps=eps)

    def dense(x: Value, key: str, out: int, inp: int) -> Value:
        return b.add(b.linear(x, p(key + ".weight", out, inp)), p(key + ".bias", out))

    h = b.patch_embed(px, p("vision_tower.patch_embed.proj.weight", D, 3, s.patch, s.patch),
                      p("vision_tower.patch_embed.proj.bias", D), _name="patches")
    h = b.vit_pos_emb(h, p("vision_tower.patch_embed.pos_emb.weight", s.pos_h, s.pos_w, D), mode="bicubic")
    for i in range(s.layers):
        b.prefix, b.layer = f"v{i}.", i
        pre = f"{ENCODER}blocks.{i}."
        x = ln(h, pre + "norm0", s.ln_eps)
        qkv = dense(x, pre + "wqkv", 3 * D, D)
        q, k, v = (b.reshape(b.slice(qkv, axis=3, start=j * D, end=(j + 1) * D), shape=[0, 0, 0, H, Dh])
                   for j in range(3))
        q, k = b.rope_2d(q, theta=s.rope_theta), b.rope_2d(k, theta=s.rope_theta)
        o = b.reshape(b.vit_attention(q, k, v, scale=Dh ** -0.5), shape=[0, 0, 0, D])
        h = b.add(h, dense(o, pre + "wo", D, D))
        x = ln(h, pre + "norm1", s.ln_eps)
        y = b.gelu(dense(x, pre + "mlp.fc0", I, D), approximate="tanh" if "tanh" in s.vit_act else "none")
        h = b.add(h, dense(y, pre + "mlp.fc1", D, I))
    b.prefix, b.layer = "", None
    h = ln(h, ENCODER + "final_layernorm", s.ln_eps)
    h = b.patch_merge(ln(h, "mm_projector.pre_norm", s.projector_eps), kh=kh, kw=kw)
    h = b.gelu(dense(h, "mm_projector.proj.0", s.merged, s.merged), approximate="none")
    out = dense(h, "mm_projector.proj.2", s.text_hidden, s.merged)
    b.ret(out)
    out.name = "image_features"
    return fn


def is_vision_param(name: str) -> bool:
    """True for vision tower and projector parameters (counted apart from the text model)."""
    return name.startswith(("vision_tower.", "mm_projector."))


# ---- preprocessing (the peer's Kimi_K25ImageProcessor) ---------------------------------------------
def navit_size(height: int, width: int, patch: int, merge: int, max_patches: int = MAX_PATCHES,
               max_side: int = MAX_PATCHES_PER_SIDE) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized h, w), (padded h, w)) as the peer's ``navit_resize``: shrink (never enlarge) to
    at most ``max_patches`` patches and ``max_side`` patches per side, then pad up to multiples
    of ``merge * patch``."""
    nh, nw = max(1.0, height // patch), max(1.0, width // patch)
    scale = min(1.0, math.sqrt(max_patches / (nh * nw)), max_side * patch / height, max_side * patch / width)
    rh, rw = max(1, int(height * scale)), max(1, int(width * scale))
    rh, rw = min(rh, max_side * patch), min(rw, max_side * patch)
    f = merge * patch
    return (rh, rw), ((f - rh % f) % f + rh, (f - rw % f) % f + rw)


def preprocess_image(image, spec: VisionSpec, max_patches: int = MAX_PATCHES,
                     max_side: int = MAX_PATCHES_PER_SIDE) -> np.ndarray:
    """One image ``[3, H, W]`` with values in 0..255 (uint8 or float) -> patches
    ``float32[GH, GW, 3, p, p]`` like the peer's processor: bicubic antialiased resize
    (``torch.nn.functional.interpolate``, as torchvision does for float images), zero padding at
    the bottom/right, rescale by 1/255, normalise with mean = std = 0.5, patchify.
    Raises K3RuntimeError for a bad shape."""
    import torch
    import torch.nn.functional as F
    a = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if a.ndim != 3 or a.shape[0] != 3 or a.shape[1] < 1 or a.shape[2] < 1:
        raise K3RuntimeError(f"an image must be [3, H, W], got shape {list(a.shape)}")
    p = spec.patch
    H, W = a.shape[1:]
    (rh, rw), (ph, pw) = navit_size(H, W, p, spec.merge[0], max_patches, max_side)
    if spec.merge[0] != spec.merge[1]:
        f = spec.merge[1] * p
        pw = (f - rw % f) % f + rw
    t = torch.from_numpy(a.astype(np.float32))[None]
    if (rh, rw) != (H, W):
        t = F.interpolate(t, size=[rh, rw], mode="bicubic", align_corners=False, antialias=True)
    t = F.pad(t, (0, pw - rw, 0, ph - rh))[0].double()
    mean = torch.tensor(IMAGE_MEAN, dtype=torch.float64)[:, None, None]
    std = torch.tensor(IMAGE_STD, dtype=torch.float64)[:, None, None]
    t = ((t * RESCALE - mean) / std).float()
    gh, gw = ph // p, pw // p
    return t.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).contiguous().numpy()


def preprocess_images(images, spec: VisionSpec, **kw) -> list[np.ndarray]:
    """``images`` ``[N, 3, H, W]`` (array/tensor) or a list of ``[3, H, W]`` -> a list of patch
    grids ``float32[GH, GW, 3, p, p]`` (see ``preprocess_image``)."""
    if hasattr(images, "ndim") and images.ndim == 4:
        images = [images[i] for i in range(images.shape[0])]
    elif hasattr(images, "ndim"):
        raise K3RuntimeError(f"images must be [N, 3, H, W], got shape {list(images.shape)}")
    return [preprocess_image(im, spec, **kw) for im in images]
