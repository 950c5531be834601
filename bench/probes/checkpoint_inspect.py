"""Inspect a full-size Kimi K3 checkpoint without its weights: writes the real key set (published
layout, MXFP4 routed experts, bf16 trunk, ~2.8 T parameters) as safetensors shards whose headers
are real and whose data regions are sparse holes (no disk blocks), then times ``k3ir.load`` (headers
+ key map) and ``k3ir inspect DIR``. Any read of tensor data would be visible as time and I/O.

    python bench/probes/checkpoint_inspect.py [--shards 64] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import tempfile
import time

from k3ir.frontend.keymap import is_routed_expert

import k3ir

_BYTES = {"bf16": ("BF16", 2), "f32": ("F32", 4)}


def skeleton(module):
    """(key, dtype, shape) for every tensor the published K3 checkpoint holds."""
    out = []
    for decl in module.params.values():
        kt = decl.key_type()
        for key in decl.keys():  # noqa: SIM118 (ParamDecl.keys(), not a dict)
            shape = [int(d) for d in kt.shape]
            if is_routed_expert(key):
                base = key[: -len("weight")]
                out.append((base + "weight_packed", "U8", shape[:-1] + [shape[-1] // 2]))
                out.append((base + "weight_scale", "U8", shape[:-1] + [shape[-1] // 32]))
            else:
                out.append((key, _BYTES[kt.dtype][0], shape))
    return out


def write_sparse(directory, tensors, shards):
    size = {"U8": 1, "BF16": 2, "F32": 4}
    per = -(-len(tensors) // shards)
    weight_map, total = {}, 0
    for s in range(shards):
        part = tensors[s * per:(s + 1) * per]
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        hdr, off = {}, 0
        for key, dt, shape in part:
            n = size[dt]
            for d in shape:
                n *= d
            hdr[key] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
            off += n
            weight_map[key] = name
        raw = json.dumps(hdr, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        path = os.path.join(directory, name)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + off)          # a hole: the data region holds no blocks
        total += off
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--keep", help="write here and keep it (default: a temporary directory)")
    a = ap.parse_args()
    d = a.keep or tempfile.mkdtemp(prefix="k3-sparse-")
    os.makedirs(d, exist_ok=True)
    m = k3ir.load("kimi-k3")
    raw = dict(m.config.raw)
    raw["text_config"] = dict(raw["text_config"])
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(raw, f)
    t0 = time.perf_counter()
    tensors = skeleton(m)
    total = write_sparse(d, tensors, a.shards)
    t1 = time.perf_counter()
    io0 = resource.getrusage(resource.RUSAGE_SELF).ru_inblock
    loaded = k3ir.load(d)
    t2 = time.perf_counter()
    s = loaded.weights.summary()
    t3 = time.perf_counter()
    io1 = resource.getrusage(resource.RUSAGE_SELF).ru_inblock
    used = sum(os.stat(os.path.join(d, f)).st_blocks * 512 for f in os.listdir(d))
    print(f"tensors {len(tensors):,} in {a.shards} shards, {total / 1e12:.3f} TB of tensor data "
          f"({used / 1e6:.1f} MB of disk blocks actually used); written in {t1 - t0:.1f} s")
    print(f"k3ir.load (headers + key map of {len(loaded.params):,} parameters): {t2 - t1:.2f} s; "
          f"summary {t3 - t2:.2f} s; block reads during load {io1 - io0}")
    q = s["quantized"]
    print(f"on disk {s['bytes_on_disk'] / 1e12:.3f} TB, {s['weights'] / 1e12:.4f} T weights, "
          f"{q['fraction_of_weights']:.1%} of them MXFP4 ({q['fraction_of_bytes']:.1%} of the bytes)")
    t4 = time.perf_counter()
    rc = os.system(f"k3ir inspect {d} > /dev/null")
    print(f"k3ir inspect DIR: exit {rc >> 8} in {time.perf_counter() - t4:.2f} s (a fresh process)")
    if not a.keep:
        shutil.rmtree(d)


if __name__ == "__main__":
    main()
