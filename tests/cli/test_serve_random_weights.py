"""``k3ir serve`` says at startup, on stderr, that a bundled model runs its random init (as ``generate`` does),
and says nothing of the kind for a checkpoint with trained weights."""
from __future__ import annotations

from conftest import run_cli


def _served(monkeypatch):
    """Replace uvicorn's loop by a recorder: the CLI builds the app, then returns at once."""
    from k3ir.runtime import server
    calls = []
    monkeypatch.setattr(server, "serve", lambda app, **kw: calls.append(kw))
    return calls


def test_serve_bundled_model_warns_random_weights(capsys, monkeypatch):
    calls = _served(monkeypatch)
    rc, _, err = run_cli(capsys, "serve", "k3-tiny", "--port", "0", "--init-seed", "3", "--num-blocks", "4",
                         "--max-batch", "1", "--block-size", "64")
    assert rc == 0 and len(calls) == 1, err
    assert "k3ir: warning: k3-tiny has no trained weights: this is the random init (seed 3)" in err, err


def test_serve_checkpoint_does_not_warn(capsys, monkeypatch):
    import k3ir.cli.serve as cli_serve
    from k3ir.runtime.params import init_params
    real = cli_serve.load_model

    def with_weights(args):
        m = real(args)
        m.weights = init_params(m, seed=5)               # bound weights, as a checkpoint loader binds them
        return m
    monkeypatch.setattr(cli_serve, "load_model", with_weights)
    calls = _served(monkeypatch)
    rc, _, err = run_cli(capsys, "serve", "k3-tiny", "--port", "0", "--num-blocks", "4", "--max-batch", "1",
                         "--block-size", "64")
    assert rc == 0 and len(calls) == 1, err
    assert "no trained weights" not in err, err
