"""The tvm targets' availability without apache-tvm installed: every cross target (tvm-c, -cuda, -metal, -rocm)
says TVM is missing and how to install it, not why it cannot build here."""
from __future__ import annotations

import importlib.util

from k3ir.backends import get_backend


def test_tvm_cross_targets_unavailable_without_tvm(monkeypatch):
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
