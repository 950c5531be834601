"""``k3ir train --dp/--ep/--tp 2`` under torchrun (2 gloo processes, 1 thread each; cli/train.py,
runtime/train_shards.py): the first step's loss is the one-process loss (the same global batch; later
steps differ within QB's histogram bin), every rank writes its shard of each checkpoint, a resume from
a sharded checkpoint continues bit-exactly, and one resumed by one process or under another layout starts
from the same state (runtime/train_shards.py: assemble, then cut again)."""
from __future__ import annotations

import re
import sys

import pytest
from k3ir.cli import main
from test_cli_torchrun import _free_port, _run

TRAIN = ["train", "k3-tiny", "--batch", "4", "--seq", "16", "--log-every", "1", "--no-plot"]


def _torchrun(*args: str) -> object:
    return _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                 str(_free_port()), "-m", "k3ir.cli", *args], timeout=240.0)


def _losses(text: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step (\d+)/\d+ loss=([0-9.]+)", text,
                                                                re.MULTILINE)}


_ONE: dict = {}


def _one_process_first_loss(tmp_path_factory) -> float:
    if not _ONE:
        out = tmp_path_factory.mktemp("one")
        r = _run([sys.executable, "-m", "k3ir.cli", *TRAIN, "--steps", "1", "--threads", "1", "--out", str(out / "run")])
        assert r.returncode == 0, r.stderr[-3000:]
        _ONE[1] = _losses(r.stdout)[1]
    return _ONE[1]


@pytest.mark.parametrize("flag", ["--ep", "--tp"])
def test_torchrun_train_first_step_loss_is_the_one_process_loss(tmp_path, tmp_path_factory, flag):
    r = _torchrun(*TRAIN, "--steps", "1", flag, "2", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("step 1/1 loss=") == 1                  # rank 0 alone prints
    assert _losses(r.stdout)[1] == pytest.approx(_one_process_first_loss(tmp_path_factory), rel=1e-5, abs=2e-6)
    shards = sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "step-000001" / "shards").iterdir())
    assert shards == ["rank-00000.safetensors", "rank-00001.safetensors"]


@pytest.mark.slow
def test_torchrun_train_dp_resumes_bit_exactly_and_under_another_layout(tmp_path, tmp_path_factory, capsys):
    """DP=2: 4 steps with checkpoints at 2 and 4; a resume from step 2 into another directory prints the same
    losses for steps 3-4 and writes the same tensors; the same checkpoint resumed with --tp 2 or in one process
    is put together and cut again, and ``k3ir generate RUN`` reads it (three torchrun launches: ~1.5 min on 2
    shared cores)."""
    from safetensors.numpy import load_file
    a, b = tmp_path / "a", tmp_path / "b"
    r = _torchrun(*TRAIN, "--steps", "4", "--ckpt-every", "2", "--dp", "2", "--out", str(a))
    assert r.returncode == 0, r.stderr[-3000:]
    first = _losses(r.stdout)
    assert sorted(first) == [1, 2, 3, 4]
    assert first[1] == pytest.approx(_one_process_first_loss(tmp_path_factory), rel=1e-5, abs=2e-6)
    r2 = _torchrun("train", "--resume", str(a / "checkpoints" / "step-000002"), "--dp", "2", "--out", str(b),
                   "--no-plot")
    assert r2.returncode == 0, r2.stderr[-3000:]
    again = _losses(r2.stdout)
    assert again == {3: first[3], 4: first[4]}
    for rank in (0, 1):
        name = f"rank-{rank:05d}.safetensors"
        ta, tb = (load_file(str(d / "checkpoints" / "step-000004" / "shards" / name)) for d in (a, b))
        assert sorted(ta) == sorted(tb)
        for k in ta:
            assert ta[k].tobytes() == tb[k].tobytes(), (rank, k)
    # another layout, and one process: the shards are put together and cut again; step 3 starts from the same
    # weights, AdamW state and QB biases, so its loss is the DP run's (step 4 differs within QB's histogram bin)
    step2 = str(a / "checkpoints" / "step-000002")
    r3 = _torchrun("train", "--resume", step2, "--tp", "2", "--out", str(tmp_path / "c"), "--no-plot")
    assert r3.returncode == 0, r3.stderr[-3000:]
    assert _losses(r3.stdout)[3] == pytest.approx(first[3], rel=1e-5, abs=2e-6)
    assert main(["train", "--resume", step2, "--out", str(tmp_path / "d"), "--no-plot", "--threads", "1"]) == 0
    assert _losses(capsys.readouterr().out)[3] == pytest.approx(first[3], rel=1e-5, abs=2e-6)
    assert main(["generate", str(a), "--prompt", "Kimi ", "--max-tokens", "4", "--threads", "1"]) == 0
    assert "no trained weights" not in capsys.readouterr().err                # the run's weights, put together


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_on_a_mesh(tmp_path):
    """A one-process run's checkpoint (step 2 of 3) resumed under torchrun --ep 2: read whole and cut for each
    rank, step 3 has the one-process resume's loss."""
    one = tmp_path / "one"
    r = _run([sys.executable, "-m", "k3ir.cli", *TRAIN, "--steps", "3", "--ckpt-every", "2", "--threads", "1",
              "--out", str(one)])
    assert r.returncode == 0, r.stderr[-3000:]
    want = _losses(r.stdout)[3]
    r2 = _torchrun("train", "--resume", str(one / "checkpoints" / "step-000002"), "--ep", "2", "--out",
                   str(tmp_path / "ep2"), "--no-plot")
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert _losses(r2.stdout) == pytest.approx({3: want}, rel=1e-5, abs=2e-6)

