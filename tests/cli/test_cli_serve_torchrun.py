"""``k3ir serve --tp 2`` / ``--ep 2`` / ``--cp 2`` under torchrun (2 gloo processes, 1 thread each;
runtime/serve_mesh.py): rank 0 serves HTTP and broadcasts each engine step's admissions and cancellations,
rank 1 replays them. Two concurrent greedy requests get the one-process text; a stream the client drops is
cancelled on both ranks (a later request still gets the one-process text, so the ranks' engines stayed in
step); a --cp that does not match the process count and a target without collectives are refused with one
line each."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from k3ir.cli import main
from test_cli_torchrun import _free_port, _run


def _post(port: int, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _one_process_text(prompt: str, n: int) -> str:
    r = _run([sys.executable, "-m", "k3ir.cli", "generate", "k3-tiny", "--prompt", prompt, "--max-tokens", str(n),
              "--temperature", "0", "--raw", "--threads", "1"])
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout[len(prompt):].rstrip("\n")


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--tp", "--ep", "--cp"])
def test_torchrun_serve_answers_as_one_process(flag, tmp_path):
    """One torchrun launch serving several requests (~30 s on 2 shared cores)."""
    want = {p: _one_process_text(p, 8) for p in ("Kimi ", "The K3 ")}
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    log = open(tmp_path / "serve.log", "w")            # noqa: SIM115 (closed in the finally below)
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(_free_port()), "-m", "k3ir.cli", "serve", "k3-tiny", "--port", str(port),
                          "--log-level", "warning", flag, "2"], env=env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
                time.sleep(0.5)
        got: dict[str, str] = {}

        def ask(prompt):
            got[prompt] = _post(port, {"model": "k3-tiny", "prompt": prompt, "max_tokens": 8,
                                       "temperature": 0})["choices"][0]["text"]
        threads = [threading.Thread(target=ask, args=(q,)) for q in want]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        assert got == want
        body = json.dumps({"model": "k3-tiny", "prompt": "Kimi ", "max_tokens": 200, "stream": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            r.readline()                       # the first event, then the client goes away
        assert _post(port, {"model": "k3-tiny", "prompt": "The K3 ", "max_tokens": 8,
                            "temperature": 0})["choices"][0]["text"] == want["The K3 "]
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        log.close()


@pytest.mark.parametrize("argv, message", [
    (["--cp", "3"], "ep*cp*tp*dp = 3 (--cp 3) but torchrun started 2 processes (WORLD_SIZE=2); they must be equal"),
    (["--cp", "2", "--target", "reference"],
     "--target reference has no collectives; --ep/--cp/--tp/--dp run on torch or triton"),
])
def test_serve_on_a_mesh_refuses_bad_cp(monkeypatch, capsys, argv, message):
    monkeypatch.setenv("WORLD_SIZE", "2")            # as torchrun sets it; refused before the process group starts
    assert main(["serve", "k3-tiny", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err
