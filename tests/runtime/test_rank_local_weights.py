"""Rank-local checkpoint loading (runtime/distributed.py: shard_params over a checkpoint's lazy weights,
frontend/checkpoint.py: CheckpointWeights.block): each rank of an ep=2 x tp=2 mesh gets the same blocks
as slicing the whole arrays, while reading from the safetensors files only its own experts and, for
tensors stored in one piece, only its tp block."""
from __future__ import annotations

import numpy as np
from _tiny_models import load_tiny


def test_each_rank_reads_only_its_blocks(tmp_path, monkeypatch):
    from k3ir.backends.reference.ranks import coords
    from k3ir.frontend.checkpoint import Checkpoint
    from k3ir.passes import run_pipeline
    from k3ir.runtime.distributed import shard_params
    from k3ir.runtime.params import init_params

    import k3ir
    from k3ir.plan import Layout

    m = load_tiny("k3-tiny")
    params = {k: v.astype(np.float32) for k, v in init_params(m, seed=3).items()}
    k3ir.save(m, params, str(tmp_path / "ckpt"), layout="published", dtype="f32")
    loaded = k3ir.load(str(tmp_path / "ckpt"))
    m2 = run_pipeline(loaded.clone(), ["shard{ep=2,tp=2}"])
    reads: list[tuple[str, object]] = []
    original = Checkpoint.read

    def spy(self, key, index=None, rows=None, box=None):
        reads.append((key, box))
        return original(self, key, index=index, rows=rows, box=box)

    monkeypatch.setattr(Checkpoint, "read", spy)
    w1 = "language_model.model.layers.1.block_sparse_moe.experts.{e}.w1.weight"
    q = "language_model.model.layers.0.self_attn.q_proj.weight"
    for r in range(4):
        c = coords(Layout(ep=2, tp=2), r)
        reads.clear()
        got = shard_params(m2, loaded.weights, c)
        want = shard_params(m2, params, c)
        assert set(got) == set(want)
        for name in want:
            assert np.array_equal(np.asarray(got[name]), np.asarray(want[name])), (r, name)
        experts = {int(k.split(".experts.")[1].split(".")[0]) for k, _ in reads
                   if k.startswith(w1.split("{e}")[0]) and ".w1." in k}
        assert experts == set(range(4 * c["ep"], 4 * c["ep"] + 4)), (r, experts)
        rows = int(m2.params[q].type.shape[0])                    # half of q_proj's rows
        assert rows * 2 == int(m.params[q].type.shape[0])
        boxes = [b for k, b in reads if k == q]
        assert boxes == [(slice(rows * c["tp"], rows * (c["tp"] + 1)), slice(None))], boxes
