"""What ``k3ir serve`` checks before it starts: the port is free (a busy one is one line at exit 2) and the pool,
batch and request sizes are valid (CLI usage errors; K3Errors from ``Engine``, ``build_engine`` and
``ServerLimits``)."""
from __future__ import annotations

import socket

import pytest
from conftest import one_line_error, run_cli

import k3ir
from k3ir.errors import K3Error, K3RuntimeError


def test_serve_on_a_busy_port_is_one_line_exit_2(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, _, err = run_cli(capsys, "serve", "k3-tiny", "--port", str(port))
    assert rc == 2
    err = one_line_error(err)
    assert err.startswith(f"k3ir: error: port {port} is in use (127.0.0.1:{port}: "), err


def test_check_port_accepts_a_free_port():
    from k3ir.cli.serve import check_port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_port("127.0.0.1", port)                # closed again: free (SO_REUSEADDR as uvicorn)


# ---- sizes: CLI usage errors, K3Errors from the engine and the server limits -------------------------------
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


@pytest.mark.parametrize("kw, needle", [
    ({"block_size": 0}, "block_size must be a positive multiple of the KDA chunk 64"),
    ({"num_blocks": 0}, "num_blocks must be an integer >= 1, got 0"),
    ({"max_batch": -2}, "max_batch must be an integer >= 1, got -2"),
    ({"max_prefill_tokens": 0}, "max_prefill_tokens must be an integer >= 1, got 0"),
])
def test_engine_sizes_raise_k3error(kw, needle):
    from k3ir.runtime.engine import Engine, build_engine
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
