"""CLI and config robustness: bad output paths, non-finite flags, unknown or null config keys,
``--set`` attribution, resume output directory, foreign Session state, human-readable counts.
Every user error is one line on stderr with exit code 2 (main() run in-process)."""
from __future__ import annotations

import json
import logging
import os
from typing import ClassVar

import pytest
from k3ir.cli import main
from k3ir.cli.common import human

import k3ir
from k3ir.errors import K3ConfigError, K3RuntimeError

#: a path under /proc: nothing can be created there, even as root
UNWRITABLE = "/proc/k3ir-nope"


def run_err(capsys, *argv: str) -> str:
    """Run the CLI, expect exit 2 and exactly one stderr line; return that line."""
    rc = main(list(argv))
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert len(err) == 1, err
    assert err[0].startswith("k3ir: error: "), err[0]
    return err[0]


def test_compile_dump_ir_unwritable(capsys):
    line = run_err(capsys, "compile", "k3-tiny", "--target", "torch", "--no-build", "--dump-ir", UNWRITABLE)
    assert "--dump-ir" in line and UNWRITABLE in line


@pytest.mark.parametrize("fmt", ["onnx", "html"])
def test_export_to_directory_leaves_nothing(capsys, tmp_path, monkeypatch, fmt):
    (tmp_path / "ro").mkdir()
    monkeypatch.chdir(tmp_path)
    line = run_err(capsys, "export", "k3-tiny", "--format", fmt, "-o", "ro")
    assert "ro: is a directory" in line
    assert sorted(os.listdir(tmp_path)) == ["ro"]          # no stray ro.data


@pytest.mark.parametrize("name", ["x.onnx", "x.html"])
def test_export_unwritable(capsys, name):
    line = run_err(capsys, "export", "k3-tiny", "-o", f"{UNWRITABLE}/{name}")
    assert UNWRITABLE in line


def test_partial_output_removed(tmp_path):
    """A failing write removes the files it created and names the path; files there before stay."""
    from k3ir.cli.common import UsageError
    from k3ir.cli.export import _writing
    new, old = tmp_path / "a.onnx", tmp_path / "b.onnx.data"
    old.write_text("keep")
    with pytest.raises(UsageError, match="b.onnx.data"), _writing([str(new), str(old)]):
        new.write_text("partial")
        raise PermissionError(13, "Permission denied", str(old))
    assert not new.exists() and old.read_text() == "keep"


def test_train_out_unwritable(capsys):
    line = run_err(capsys, "train", "k3-tiny", "--steps", "2", "--out", UNWRITABLE, "--no-plot")
    assert "--out" in line and UNWRITABLE in line


@pytest.mark.parametrize("flag,value", [("--lr", "nan"), ("--clip", "inf"), ("--weight-decay", "-inf"),
                                        ("--router-lr-scale", "nan"), ("--weight-decay", "-1")])
def test_train_float_flags_finite(capsys, tmp_path, flag, value):
    line = run_err(capsys, "train", "k3-tiny", "--steps", "2", f"{flag}={value}", "--out", str(tmp_path / "rz"))
    assert flag in line
    assert not (tmp_path / "rz").exists()


@pytest.mark.parametrize("argv,flag", [(("train", "k3-tiny", "--steps", "2"), "--seed"),
                                       (("generate", "k3-tiny", "--prompt", "hi"), "--seed"),
                                       (("generate", "k3-tiny", "--prompt", "hi"), "--init-seed"),
                                       (("serve", "k3-tiny", "--port", "0"), "--init-seed"), (("run",), "--seed")])
@pytest.mark.parametrize("seed", ["-1", str(2 ** 63)])
def test_seed_range_agrees_across_commands(capsys, tmp_path, argv, flag, seed):
    # Generate, serve, train and run accept the server's seed range 0..2**63-1, else one line, rc 2
    out = ("--out", str(tmp_path / "rs")) if argv[0] == "train" else ()
    line = run_err(capsys, *argv, *out, f"{flag}={seed}")
    assert f"{flag} must be >= 0 and < 2**63, got {seed}" in line
    assert not (tmp_path / "rs").exists()


def test_oserror_last_line_of_defence(capsys, monkeypatch):
    from k3ir.cli import app as cli

    def boom(args):
        raise PermissionError(13, "Permission denied", "/some/user/path")
    monkeypatch.setattr(cli, "cmd_backends", boom)
    assert run_err(capsys, "backends") == "k3ir: error: /some/user/path: Permission denied"


def test_resume_writes_into_run_dir(capsys, tmp_path, monkeypatch):
    run, cwd = tmp_path / "run", tmp_path / "elsewhere"
    cwd.mkdir()
    common = ["--batch", "2", "--seq", "8", "--no-plot"]
    assert main(["train", "k3-tiny", "--steps", "3", "--ckpt-every", "1", "--out", str(run), *common]) == 0
    first = json.loads((run / "training.json").read_text())
    (run / "training.json").unlink()
    monkeypatch.chdir(cwd)
    assert main(["train", "--resume", str(run / "checkpoints" / "step-000002"), "--no-plot"]) == 0
    capsys.readouterr()
    assert os.listdir(cwd) == []                             # nothing in the current directory
    again = json.loads((run / "training.json").read_text())
    assert again["steps"] == 3 and again["config"] == first["config"]
    assert again["loss"][2] == pytest.approx(first["loss"][2], rel=1e-5)   # same step 3 from step 2's state
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000003"
    # resuming the finished run: says it is complete, runs nothing, leaves its summary as it was
    assert main(["train", "--resume", str(run), "--no-plot"]) == 0
    assert "already complete (3/3 steps)" in capsys.readouterr().out
    assert json.loads((run / "training.json").read_text()) == again


# ---- config keys ---------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["hidden_sizee", "linear_attn_config.nope", "vision_config.vt_hidden_sizee",
                                 "text_config.linear_attn_config.num_headz"])
def test_unknown_override_key(key):
    with pytest.raises(K3ConfigError, match="not a known key") as ei:
        k3ir.load("k3-tiny", overrides={key: 3})
    assert key in str(ei.value)


def test_unknown_override_key_suggests():
    with pytest.raises(K3ConfigError, match="did you mean 'hidden_size'"):
        k3ir.frontend.load_config("k3-tiny", {"hidden_sizee": 3})


def test_set_errors_name_the_flag(capsys):
    line = run_err(capsys, "inspect", "k3-tiny", "--set", "hidden_sizee=3")
    assert line.startswith("k3ir: error: --set hidden_sizee=3: ") and "not a known key" in line
    line = run_err(capsys, "inspect", "k3-tiny", "--set", "hidden_size=1e3")
    assert line.startswith("k3ir: error: --set hidden_size=1e3: ")
    assert "'text_config.hidden_size'" in line and "must be int" in line and "text_hidden_size" not in line
    assert "k3-tiny.json" not in line
    line = run_err(capsys, "inspect", "k3-tiny", "--set", "vision_config.vt_hidden_size=33")
    assert line.startswith("k3ir: error: --set vision_config.vt_hidden_size=33: ")


@pytest.mark.parametrize("item,words", [
    ("num_hidden_layers=2147483648", "2147483648 exceeds the largest supported num_hidden_layers (1024"),
    ("kv_lora_rank=1000000000000000000000000000000", "integer 1000000000000000000000000000000 is out of the 64-bit"),
    ("kv_lora_rank=" + "9" * 5000, "integer 999999999999...(5000 digits) is out of the 64-bit range"),
    ("num_hidden_layers=2**31", "'text_config.num_hidden_layers': must be int, got str '2**31'"),
    ("kv_lora_rank=10**30", "'text_config.kv_lora_rank': must be int, got str '10**30'"),
    ("hidden_size=" + "[" * 5000 + "]" * 5000, "'text_config.hidden_size': must be int, got str '[[[["),
    ("vision_config.vt_num_hidden_layers=2147483648", "exceeds the largest supported vt_num_hidden_layers (1024"),
], ids=["layers-2**31", "kv_lora_rank-10**30", "5000-digits", "expr-layers", "expr-rank", "deep", "vision-layers"])
def test_set_out_of_range_fails_fast(capsys, item, words):
    import time
    t0 = time.perf_counter()
    line = run_err(capsys, "inspect", "k3-tiny", "--set", item)
    assert time.perf_counter() - t0 < 10
    assert line.startswith(f"k3ir: error: --set {item[:40]}") and words in line, line[:300]


def test_config_file_too_large(capsys, tmp_path):
    from k3ir.frontend.config_bounds import MAX_CONFIG_BYTES
    p = tmp_path / "config.json"
    p.write_bytes(b" " * (MAX_CONFIG_BYTES + 1))
    line = run_err(capsys, "inspect", str(p))
    assert line == f"k3ir: error: {p}: larger than {MAX_CONFIG_BYTES} bytes: not a model config"


def test_null_hidden_act_rejected(capsys):
    line = run_err(capsys, "inspect", "k3-tiny", "--set", "hidden_act=null")
    assert "--set hidden_act=null" in line and "'text_config.hidden_act'" in line and "null" in line
    for key in ("num_experts", "linear_attn_config.short_conv_kernel_size", "rms_norm_eps"):
        with pytest.raises(K3ConfigError, match="must not be null"):
            k3ir.frontend.load_config("k3-tiny", {key: None})


def test_legal_nulls_kept():
    cfg = k3ir.frontend.load_config("k3-tiny", {"q_lora_rank": None, "attn_res_block_size": None, "dtype": None})
    assert cfg.q_lora_rank is None and cfg.attn_res_block_size is None
    assert cfg.dtype == "bf16"                               # dtype null (transformers writes it): default
    assert cfg.hidden_act == "situ"


def test_known_keys_cover_what_the_reader_reads():
    """Every key the reader looks at (recorded) is in the explicit sets the override check uses,
    for the bundled configs and the transformers-style kimi_linear config."""
    from k3ir.frontend.config import LAC_KEYS, TEXT_KEYS, WRAPPER_KEYS, build_config, read_config
    for name in ("k3-tiny", "kimi-k3", "kimi-linear-6p6b"):
        raw, path = read_config(name)
        reads: set[str] = set()
        build_config(raw, path, name, reads=reads)
        for k in reads:
            parts = k.split(".")
            if parts[0] == "text_config":
                parts = parts[1:]
            if parts[0] == "linear_attn_config" and len(parts) == 2:
                assert parts[1] in LAC_KEYS, k
            else:
                assert parts[0] in TEXT_KEYS | WRAPPER_KEYS, k


def test_vision_keys_cover_vision_spec():
    """The vision keys vision_spec reads are all in VISION_KEYS (a recording dict)."""
    from k3ir.frontend.config import VISION_KEYS, read_config
    from k3ir.frontend.vision import vision_spec

    class Rec(dict):
        seen: ClassVar[set] = set()

        def get(self, k, *a):
            Rec.seen.add(k)
            return super().get(k, *a)

        def __getitem__(self, k):
            Rec.seen.add(k)
            return super().__getitem__(k)
    raw, _ = read_config("k3-tiny")
    vision_spec(Rec(raw["vision_config"]), raw["text_config"]["hidden_size"])
    assert Rec.seen and Rec.seen <= VISION_KEYS, Rec.seen - VISION_KEYS


def test_config_file_unknown_keys_warn(tmp_path, caplog):
    from k3ir.frontend.config import read_config
    raw, _ = read_config("k3-tiny")
    raw["text_config"]["hidden_sizee"] = 3
    raw["text_config"]["linear_attn_config"]["nope"] = 1
    raw["transformers_version"] = "5.24.0"                  # an HF extra: no warning
    p = tmp_path / "config.json"
    p.write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="k3ir.config"):
        cfg = k3ir.frontend.load_config(str(p))
    assert cfg.hidden_size == raw["text_config"]["hidden_size"]
    msgs = [r.getMessage() for r in caplog.records if r.name == "k3ir.config"]
    assert len(msgs) == 1, msgs
    assert "text_config.hidden_sizee" in msgs[0] and "linear_attn_config.nope" in msgs[0]
    assert "transformers_version" not in msgs[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="k3ir.config"):
        for name in ("k3-tiny", "kimi-k3", "kimi-linear-6p6b"):
            k3ir.frontend.load_config(name)
    assert not [r for r in caplog.records if r.name == "k3ir.config"]


# ---- session state, inspect formatting ----------------------------------------------------------
@pytest.fixture(scope="module")
def session():
    from k3ir.runtime import Session
    return Session(k3ir.compile(k3ir.load("k3-tiny"), target="reference"))


@pytest.mark.parametrize("bad", [{"x": 1}, [1, 2], "state"])
def test_decode_foreign_state(session, bad):
    with pytest.raises(K3RuntimeError, match="State"):
        session.decode([[1]], bad)
    with pytest.raises(K3RuntimeError, match="State"):
        session.prefill([[1, 2]], bad)


def test_decode_state_wrong_names(session):
    from k3ir.runtime.session import State
    st = session.empty_state(1)
    with pytest.raises(K3RuntimeError, match="missing 'l0_conv_q'"):
        session.decode([[1]], State({"x": 1}, 0, 1, ["x"]))
    short = State(dict(st.values), 0, 1, st.names[:-1])
    with pytest.raises(K3RuntimeError, match=f"missing '{st.names[-1]}'"):
        session.decode([[1]], short)


def test_human_counts_in_inspect(capsys):
    from k3ir.cli.common import count

    from k3ir.accounting import report
    assert main(["inspect", "k3-tiny"]) == 0
    out = capsys.readouterr().out
    r = report(k3ir.load("k3-tiny"))
    assert f"parameters: {human(r.params_total)} total ({r.params_total:,})" in out
    assert f"vision tower: {human(r.params_vision)} parameters" in out
    assert "0.0 B" not in out and "0.00 B" not in out
    assert human(r.params_total) == f"{r.params_total / 1e3:,.2f} K"
    assert count(r.params_total) == human(r.params_total)
    assert count(471_143_920) == "471.14 M" and count(2_779_484_461_664) == "2,779.5 B"
