"""Fresh-user review s4, minor findings (notes/review_s4.md): tvm cross targets without TVM (F18),
non-finite config floats (F8), fused KDA chunk size (F16), tokenizer hint for bundled names (F25),
a checkpoint pointer passed as MODEL (F15) and ``train --out`` into another run (F11)."""
from __future__ import annotations

import importlib.util

from k3ir.runtime.cli import main


def _run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err.strip()


def _one_line(err: str) -> str:
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("k3ir: error: "), err
    return err


# ---- F18: tvm cross targets when apache-tvm is missing ------------------------------------------
def test_tvm_cross_targets_unavailable_without_tvm(monkeypatch):
    from k3ir.backends import get_backend
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tvm" else real(name, *a))
    for kind in ("c", "cuda", "metal", "rocm"):
        why = get_backend(f"tvm-{kind}").available()
        assert why is not None and "apache-tvm is not installed" in why and "k3ir[tvm]" in why, why
        assert "builds" not in why, why
    assert "k3ir[tvm]" in get_backend("tvm").available()
    monkeypatch.undo()
    if importlib.util.find_spec("tvm") is not None:     # with TVM the cross rows keep their own reason
        assert "builds c code here" in get_backend("tvm-c").available()
