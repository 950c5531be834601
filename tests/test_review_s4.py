"""Fresh-user review s4 (notes/review_s4.md): ``generate | head`` (F13), engine and server sizes
checked up front (F20, F21), ``num_hidden_layers`` on kimi-linear (F14), save/load errors (F9,
F24), the serve content-type hint (F26) and small CLI messages (F4, F12, F22)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import one_line_error, run_cli
from k3ir.runtime.cli import main

from k3ir.errors import K3Error, K3RuntimeError


# ---- F13: generate | head --------------------------------------------------------------------
class _ClosedAfter:
    """A stdout whose reader goes away after ``n`` writes (each later write raises EPIPE)."""

    def __init__(self, n: int):
        self.n, self.writes, self.failed = n, 0, 0

    def write(self, s: str) -> int:
        self.writes += 1
        if self.writes > self.n:
            self.failed += 1
            raise BrokenPipeError(32, "Broken pipe")
        return len(s)

    def flush(self) -> None:
        pass


def test_generate_stops_at_the_first_broken_pipe(capsys, caplog, monkeypatch):
    fake = _ClosedAfter(3)                       # the prompt and two tokens, then the pipe breaks
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", fake)
    rc = main(["generate", "k3-tiny", "--prompt", "x", "--max-tokens", "40", "--threads", "1"])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert rc == 0 and [ln for ln in err.splitlines() if "no trained weights" not in ln] == []
    assert fake.failed == 1, fake.failed        # no write after the first EPIPE: generation stopped there
    assert not [r for r in caplog.records if "callback failed" in r.getMessage()]


def test_generate_into_head_is_quiet():
    env = dict(os.environ, PYTHONUNBUFFERED="0")
    p = subprocess.Popen([sys.executable, "-m", "k3ir.runtime.cli", "generate", "k3-tiny", "--prompt", "x",
                          "--max-tokens", "200", "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.read(1)                             # like `head -c 1`: read, then go away
    p.stdout.close()
    err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert rc == 0, (rc, err)
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


# ---- F20 / F21: sizes checked up front -----------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["--block-size", "0"], "--block-size must be a positive multiple of the KDA chunk 64 (pool block in tokens), got 0"),
    (["--block-size", "96"], "--block-size must be a positive multiple of the KDA chunk 64"),
    (["--num-blocks", "0"], "--num-blocks must be an integer >= 1, got 0"),
    (["--max-batch", "0"], "--max-batch must be an integer >= 1, got 0"),
    (["--max-concurrent", "0"], "--max-concurrent must be >= 1, got 0"),
    (["--max-output-tokens", "-1"], "--max-output-tokens must be >= 1, got -1"),
])
def test_serve_sizes_are_usage_errors(capsys, argv, needle):
    rc, _, err = run_cli(capsys, "serve", "k3-tiny", "--port", "0", *argv)
    assert rc == 2
    assert needle in one_line_error(err), err


def test_generate_block_size_zero(capsys):
    rc, _, err = run_cli(capsys, "generate", "k3-tiny", "--prompt", "x", "--block-size", "0")
    assert rc == 2 and "--block-size must be a positive multiple" in one_line_error(err)


@pytest.mark.parametrize("kw, needle", [
    ({"block_size": 0}, "block_size must be a positive multiple of the KDA chunk 64"),
    ({"num_blocks": 0}, "num_blocks must be an integer >= 1, got 0"),
    ({"max_batch": -2}, "max_batch must be an integer >= 1, got -2"),
    ({"max_prefill_tokens": 0}, "max_prefill_tokens must be an integer >= 1, got 0"),
])
def test_engine_sizes_raise_k3error(kw, needle):
    from k3ir.runtime.engine import Engine, build_engine

    import k3ir
    with pytest.raises(K3RuntimeError, match="must be"):
        Engine(object(), **kw)                   # checked before the session is touched
    with pytest.raises(K3RuntimeError) as ei:
        build_engine(k3ir.load("k3-tiny"), **kw)
    assert needle in str(ei.value)


def test_server_limits_raise_k3error():
    pytest.importorskip("pydantic")
    from k3ir.runtime.server import ServerLimits
    with pytest.raises(K3Error, match="max_concurrent must be an integer >= 1, got 0"):
        ServerLimits(max_concurrent=0)
    assert ServerLimits(max_concurrent=1).max_concurrent == 1


# ---- F14: num_hidden_layers on kimi-linear re-derives layer_types / mlp_layer_types ------------------------
@pytest.mark.parametrize("n, kda, mla, dense", [(2, 2, 0, 1), (4, 3, 1, 1), (5, 4, 1, 1), (1, 1, 0, 1)])
def test_kimi_linear_depth_override(capsys, n, kda, mla, dense):
    import json
    rc, out, err = run_cli(capsys, "inspect", "kimi-linear-6p6b", "--set", f"num_hidden_layers={n}", "--json")
    assert rc == 0, err
    counts = json.loads(out)["counts"]
    # the bundled file: full attention at 1-based layers 4, 8, 12, 16; layer 1 dense, the rest MoE
    assert counts == {"kda": kda, "mla": mla, "moe": n - dense, "dense": dense}


def test_kimi_linear_depth_override_lists():
    from k3ir.frontend.config import apply_overrides, read_config
    raw, _ = read_config("kimi-linear-6p6b")
    cfg = apply_overrides(raw, {"num_hidden_layers": 5})
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention", "linear_attention"]
    assert cfg["mlp_layer_types"] == ["dense"] + ["sparse"] * 4
    assert cfg["linear_attn_config"]["full_attn_layers"] == [4]
    kept = apply_overrides(raw, {"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]})
    assert kept["layer_types"] == ["full_attention", "linear_attention"]       # an explicit list stays as given


def test_kimi_linear_readme_depth_command(capsys):
    rc, out, err = run_cli(capsys, "inspect", "kimi-linear-6p6b", "--set", "num_hidden_layers=2")
    assert rc == 0 and err == ""
    assert "layers: 2 KDA + 0 MLA" in out


# ---- F9 / F24: save to a bad place, load a damaged artifact ----------------------------------------------
def test_save_to_uncreatable_directory_is_a_checkpoint_error(tmp_path):
    from k3ir.runtime.params import init_params

    import k3ir
    from k3ir.errors import K3CheckpointError
    m = k3ir.load("k3-tiny")
    params = init_params(m, seed=0)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for where in ("/proc/nope", str(blocker / "sub")):
        with pytest.raises(K3CheckpointError) as ei:
            k3ir.save(m, params, where)
        msg = str(ei.value)
        assert msg.startswith(f"{where}: cannot create the directory (") and msg.endswith(")"), msg


@pytest.fixture(scope="module")
def torch_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tiny"
    assert main(["compile", "k3-tiny", "--target", "torch", "-o", str(out)]) == 0
    return out


def _damaged(src, dst, damage):
    import shutil
    shutil.copytree(src, dst)
    damage(dst)
    return str(dst)


def test_damaged_artifact_raises_k3error(torch_artifact, tmp_path):
    from k3ir.runtime import Session
    assert Session.load(str(torch_artifact)).vocab > 0          # the intact one opens
    bad1 = _damaged(torch_artifact, tmp_path / "bad1", lambda d: (d / "manifest.json").write_text("{\n"))
    with pytest.raises(K3RuntimeError) as ei:
        Session.load(bad1)
    assert str(ei.value).startswith(os.path.join(bad1, "manifest.json") + ": invalid JSON at line 2, column 1")
    assert "damaged" in str(ei.value)

    bad2 = _damaged(torch_artifact, tmp_path / "bad2", lambda d: (d / "weights.safetensors").unlink())
    with pytest.raises(K3RuntimeError) as ei:
        Session.load(bad2)
    assert str(ei.value).startswith(os.path.join(bad2, "weights.safetensors") + ": missing from the artifact")

    bad3 = _damaged(torch_artifact, tmp_path / "bad3", lambda d: (d / "weights.safetensors").write_bytes(b"\x08"))
    with pytest.raises(K3RuntimeError) as ei:
        Session.load(bad3)
    assert str(ei.value).startswith(os.path.join(bad3, "weights.safetensors") + ": 1 bytes, the manifest records ")
    assert "damaged" in str(ei.value)                           # the recorded size (review s5 S5-9) catches it first


# ---- F26: the README's curl examples; a non-JSON content type says what to send -----------------------------
@pytest.fixture(scope="module")
def api():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from k3ir.runtime.engine import build_engine
    from k3ir.runtime.server import ServerLimits, create_app
    from k3ir.runtime.tokenizer import load_tokenizer

    import k3ir
    tiny = k3ir.load("k3-tiny")
    eng = build_engine(tiny, block_size=64, num_blocks=16, max_batch=4)
    with TestClient(create_app(eng, load_tokenizer("k3-tiny", tiny), "k3-tiny", ServerLimits())) as c:
        yield c


def _readme_curls() -> list[tuple[str, str, dict]]:
    """(route, header, JSON body) of every ``curl`` line of README.md (continuation lines joined)."""
    import json
    import re
    import shlex
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md")) as f:
        text = f.read().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if line.strip().startswith("curl "):
            argv = shlex.split(line)
            route = re.sub(r"^(https?://)?[^/]+", "", next(a for a in argv[1:] if "/v1/" in a))
            out.append((route, argv[argv.index("-H") + 1], json.loads(argv[argv.index("-d") + 1])))
    return out


def test_readme_curl_examples_work(api):
    curls = _readme_curls()
    assert {r for r, _, _ in curls} == {"/v1/completions", "/v1/chat/completions"}
    for route, header, body in curls:
        assert header == "Content-Type: application/json"
        r = api.post(route, json=body)
        assert r.status_code == 200, (route, r.text)
        if body.get("stream"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
        else:
            assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]


@pytest.mark.parametrize("ctype", [None, "text/plain"])
def test_non_json_content_type_names_the_header(api, ctype):
    body = '{"prompt": "x", "max_tokens": 2}'
    headers = {"Content-Type": ctype} if ctype else {"Content-Type": "application/x-www-form-urlencoded"}
    r = api.post("/v1/completions", content=body, headers=headers)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_content_type"
    assert "'Content-Type: application/json'" in err["message"] and (ctype or "x-www-form-urlencoded") in err["message"]


def test_json_that_is_not_an_object(api):
    r = api.post("/v1/completions", json=[1])
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]


# ---- F12 / F22 / F4: small CLI messages ------------------------------------------------------------------
def test_generate_interrupt_ends_the_text_line(capsys, monkeypatch):
    from k3ir.runtime.engine import Engine

    def interrupted(self, requests=None):
        raise KeyboardInterrupt
    monkeypatch.setattr(Engine, "run", interrupted)
    rc, out, err = run_cli(capsys, "generate", "k3-tiny", "--prompt", "Kimi ", "--max-tokens", "4")
    assert rc == 130 and err.splitlines()[-1] == "k3ir: interrupted" and len(err.splitlines()) == 2   # + the note
    assert out == "Kimi \n"                      # the message starts a line of its own on a terminal


def test_run_max_new_tokens_zero_is_an_error_like_generate(capsys):
    rc, _, err = run_cli(capsys, "run", "--max-new-tokens", "0")
    assert rc == 2 and one_line_error(err) == "k3ir: error: --max-new-tokens must be >= 1, got 0"
    rc, _, err = run_cli(capsys, "generate", "k3-tiny", "--prompt", "x", "--max-tokens", "0")
    assert rc == 2 and "must be an integer >= 1, got 0" in one_line_error(err)


def test_ir_only_without_output_says_nothing_was_written(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(capsys, "compile", "k3-tiny", "--target", "torch", "--ir-only")
    out = " ".join(out.split())                  # rich wraps long lines
    assert rc == 0 and err == ""
    assert "no -o given, so nothing was written (-o DIR writes the IR: module.k3 and passes.json)" in out
    assert os.listdir(tmp_path) == []
