"""Parameters from a transformers ``KimiLinearForCausalLM`` held in memory (its runtime
``state_dict`` layout, ``hf-runtime`` in ``frontend/keymap.py``), without writing a checkpoint:
used to compare whole models with the peer at sizes where a save/load round trip is too slow
(the 6.6B Kimi Linear benchmark)."""
from __future__ import annotations

from k3ir.frontend.keymap import write_key

from k3ir.errors import K3CheckpointError


def params_from_transformers(module, model) -> dict:
    """IR name -> tensor (on the model's device, its dtype) for every parameter of ``module``.
    Stacked experts come from the fused ``gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]``, conv
    taps from the fused ``conv1d [3HD, 1, K]``. Raises K3CheckpointError naming a missing key."""
    sd = dict(model.state_dict())
    out = {}
    for name, decl in module.params.items():
        shape = tuple(int(d) for d in decl.type.shape)
        key = write_key(name, "hf-runtime")
        if decl.stack:
            pre = key.split(".{e}.")[0]
            which = key.split(".")[-2]
            if which in ("w1", "w3"):
                gu = sd[pre + ".gate_up_proj"]
                half = gu.shape[1] // 2
                t = gu[:, :half] if which == "w1" else gu[:, half:]
            else:
                t = sd[pre + ".down_proj"]
        elif key in sd:
            t = sd[key]
        elif key.endswith(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")):
            fused = sd[key.rsplit(".", 2)[0] + ".conv1d.weight"]
            j = "qkv".index(key.rsplit(".", 2)[-2][0])
            n = fused.shape[0] // 3
            t = fused[j * n:(j + 1) * n]
        else:
            raise K3CheckpointError(f"transformers model has no tensor for '{name}' (looked for '{key}')")
        if tuple(t.shape) != shape:
            if t.numel() >= _numel(shape) and name.endswith("A_log"):
                t = t.reshape(-1)[:_numel(shape)]
            t = t.reshape(shape)
        out[name] = t
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
