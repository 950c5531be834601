"""Training-checkpoint integrity: per-file SHA-256 in ``train_state/manifest.json`` verified on resume, a damaged
latest checkpoint skipped for the newest intact one (bit-exact continuation), malformed ``trainer.json`` named by
file and key, leftover temporary folders of interrupted saves removed at the next save."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import one_line_error, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from k3ir.runtime.train_checkpoint import (
    MANIFEST_FILE,
    read_meta,
    save_checkpoint,
    verify_checkpoint,
)
from k3ir.runtime.trainer import TrainConfig, Trainer

import k3ir
from k3ir.errors import K3CheckpointError, K3Error

ARGS = ["--steps", "4", "--ckpt-every", "2", "--batch", "2", "--seq", "16", "--warmup", "1", "--threads", "1",
        "--log-every", "1", "--no-plot"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 4-step k3-tiny run (checkpoints at steps 2 and 4) in a directory whose name holds glob characters,
    and the loss history of its uninterrupted step 4."""
    from k3ir.cli import main
    run = tmp_path_factory.mktemp("runs") / "run [1]"
    assert main(["train", *ARGS, "--out", str(run)]) == 0
    meta = json.loads((run / "checkpoints" / "step-000004" / "trainer.json").read_text())
    return run, [h["loss"] for h in meta["history"]]


def _copy(run, tmp_path):
    dst = tmp_path / "run [1]"
    shutil.copytree(run, dst)
    return dst


def test_manifest_holds_each_files_sha256(finished_run):
    run, _ = finished_run
    d = run / "checkpoints" / "step-000004"
    man = json.loads((d / MANIFEST_FILE).read_text())
    assert set(man["files"]) == {"config.json", "model.safetensors", "train_state/optimizer.safetensors",
                                 "trainer.json"}
    for rel, entry in man["files"].items():
        data = (d / rel).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_checkpoint(d) is None


def _truncate(d):
    f = d / "model.safetensors"
    os.truncate(f, f.stat().st_size - 100)
    return f"{f}: {f.stat().st_size} bytes, the manifest records {f.stat().st_size + 100} (truncated or replaced)"


def _flip(d):
    f = d / "train_state" / "optimizer.safetensors"
    b = bytearray(f.read_bytes())
    b[-10] ^= 0x40                          # one bit of the last tensor's data: same size, another value
    f.write_bytes(bytes(b))
    return f"{f}: SHA-256 differs from the manifest's (the data changed)"


def _missing(d):
    (d / "trainer.json").unlink()
    return f"{d / 'trainer.json'}: missing"


def _bad_json(d):
    (d / "trainer.json").write_text('{"step": 4,')
    return f"{d / 'trainer.json'}: invalid JSON at line 1, column 12 (Expecting property name enclosed in double quotes)"


@pytest.mark.parametrize("damage", [_truncate, _flip, _missing, _bad_json])
def test_resume_skips_a_damaged_latest_checkpoint(finished_run, tmp_path, capsys, damage):
    """The latest checkpoint (step 4) damaged: --resume RUN warns naming it, resumes from step 2 and reproduces
    the uninterrupted run's losses bit for bit."""
    run, want = finished_run
    run = _copy(run, tmp_path)
    bad = run / "checkpoints" / "step-000004"
    why = damage(bad)
    rc, out, err = run_cli(capsys, "train", "--resume", str(run), "--no-plot")
    assert rc == 0, err
    assert f"warning: {bad}: damaged checkpoint, skipped: {why}" in err.splitlines(), err
    assert (f"warning: resuming from {run / 'checkpoints' / 'step-000002'}, the newest intact checkpoint, instead of "
            "the latest step-000004") in err.splitlines(), err
    assert "steps 2->4" in out
    meta = read_meta(run)
    assert meta["step"] == 4 and [h["loss"] for h in meta["history"]] == want       # exact float equality
    assert verify_checkpoint(bad) is None                                           # rewritten intact


def test_explicit_damaged_checkpoint_is_an_error(finished_run, tmp_path, capsys):
    run = _copy(finished_run[0], tmp_path)
    ck = run / "checkpoints" / "step-000002"
    why = _flip(ck)
    rc, _, err = run_cli(capsys, "train", "--resume", str(ck), "--no-plot")
    assert rc == 2
    assert one_line_error(err) == f"k3ir: error: {ck}: damaged checkpoint: {why}"


def test_no_intact_checkpoint_left(finished_run, tmp_path, capsys):
    run = _copy(finished_run[0], tmp_path)
    why4 = _truncate(run / "checkpoints" / "step-000004")
    _missing(run / "checkpoints" / "step-000002")
    rc, _, err = run_cli(capsys, "train", "--resume", str(run), "--no-plot")
    assert rc == 2
    assert err.splitlines()[-1] == (f"k3ir: error: {run / 'checkpoints'}: no intact training checkpoint; newest: "
                                    f"{why4}")


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.update(step="4"), "key 'step': must be an integer >= 0 below 2**63, got '4'"),
    (lambda m: m["config"].pop("steps"), "key 'config.steps' is missing"),
    (lambda m: m["config"].update(lr="fast"), "key 'config.lr': must be a finite number, got 'fast'"),
    (lambda m: m["config"].update(qb=3), "key 'config.qb': must be a string, got 3"),
    (lambda m: m["config"].update(checkpointing="no"), "key 'config.checkpointing': must be a boolean, got 'no'"),
    (lambda m: m.update(config=[1]), "key 'config': must be an object, got [1]"),
    (lambda m: m["history"][1].update(loss=None), "key 'history[1].loss': must be a number, got None"),
    (lambda m: m["history"][0].pop("grad_norm"), "key 'history[0].grad_norm' is missing"),
    (lambda m: m["history"][0].update(balance={"x": 1}), "key 'history[0].balance': must map layer indices"),
    (lambda m: m.update(qb={"history": 5}), "key 'qb.history': must be a list, got 5"),
    (lambda m: m["run"].update(threads=1.5), "key 'run.threads': must be an integer >= 0 below 2**63, got 1.5"),
    (lambda m: m.update(data=7), "key 'data': must be a string or null, got 7"),
])
def test_malformed_trainer_json_names_file_and_key(finished_run, tmp_path, edit, words):
    src = finished_run[0] / "checkpoints" / "step-000002"
    d = tmp_path / "ck"
    shutil.copytree(src, d)
    meta = json.loads((d / "trainer.json").read_text())
    edit(meta)
    (d / "trainer.json").write_text(json.dumps(meta))
    with pytest.raises(K3CheckpointError) as ei:
        read_meta(d)
    assert str(ei.value).startswith(f"{d / 'trainer.json'}: {words}"), str(ei.value)


def test_trainer_json_not_an_object(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    (d / "trainer.json").write_text("[]")
    with pytest.raises(K3CheckpointError, match=r"trainer.json: must be a JSON object, got list$"):
        read_meta(d)


def test_leftover_temporary_folders_removed_at_next_save(tmp_path):
    """Folders of saves interrupted in this process or in one that no longer runs go; another live process's
    folder stays."""
    exe = k3ir.compile(k3ir.load("k3-tiny"), target="torch", dtype="float32")
    tr = Trainer(exe, TrainConfig(steps=1, batch=1, seq=8, warmup=0))
    root = tmp_path / "checkpoints"
    gone = [root / f".step-000001.tmp-{os.getpid()}", root / ".step-000003.tmp-999999999",
            root / ".step-000003.old-999999999"]
    kept = root / f".step-000005.tmp-{os.getppid()}"
    for p in [*gone, kept]:
        (p / "train_state").mkdir(parents=True)
        (p / "model.safetensors").write_bytes(b"partial")
    save_checkpoint(tmp_path, tr)
    assert not [p for p in gone if p.exists()] and kept.is_dir()
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["latest", "step-000000"]


# ---- fuzzed trainer.json --------------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)


def _consume(meta: dict) -> None:
    """What a resume does with a trainer.json that read_meta accepted (load_checkpoint and the train CLI)."""
    from k3ir.cli.train import RUN_DEFAULTS
    from k3ir.runtime.qb import QuantileBalancer
    from k3ir.runtime.trainer import StepStats
    cfg = TrainConfig.from_dict(meta["config"])
    QuantileBalancer(layers=[], rule=cfg.qb).load_state_dict(meta.get("qb", {}))
    int(meta["step"])
    [StepStats(h["step"], h["loss"], h["grad_norm"], h["lr"], {int(k): v for k, v in h.get("balance", {}).items()},
               h.get("tokens", 0), h.get("seconds", 0.0)) for h in meta.get("history", [])]
    dict(RUN_DEFAULTS, **(meta.get("run") or {}))


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_trainer_json_fails_only_with_k3errors(finished_run, data):
    """A value anywhere in a real trainer.json replaced (or deleted): read_meta accepts it and the resume code
    uses it without error, or the failure is a K3Error naming the file."""
    base = json.loads((finished_run[0] / "checkpoints" / "step-000002" / "trainer.json").read_text())
    node, key = base, None
    for _ in range(data.draw(st.integers(1, 3))):
        if isinstance(node, dict) and node:
            key = data.draw(st.sampled_from(sorted(node)))
        elif isinstance(node, list) and node:
            key = data.draw(st.integers(0, len(node) - 1))
        else:
            break
        child = node[key]
        if not isinstance(child, (dict, list)) or not child or data.draw(st.booleans()):
            break
        node, key = child, None
    if key is not None and isinstance(node, dict) and data.draw(st.booleans()):
        del node[key]
    elif key is not None:
        node[key] = data.draw(json_values)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "trainer.json").write_text(json.dumps(base))
        try:
            meta = read_meta(d)
        except K3CheckpointError as e:
            assert str(e).startswith(f"{d / 'trainer.json'}: ") and "\n" not in str(e), str(e)
            return
    try:
        _consume(meta)
    except K3Error as e:                    # a QB rule that differs from the config's: the resume refuses it
        assert "QB rule" in str(e), str(e)
