"""What ``k3ir serve`` checks before it starts: the port is free (a busy one is one line at exit 2)."""
from __future__ import annotations

import socket

from conftest import one_line_error, run_cli


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
    from k3ir.runtime.cli_serve import check_port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_port("127.0.0.1", port)                # closed again: free (SO_REUSEADDR as uvicorn)
