"""Wrong argument types in the Python API (``k3ir.compile``, ``k3ir.load``, ``Session``, ``init_params``,
``Session.forward`` / ``generate``): a K3Error naming the argument and what it takes, instead of a TypeError deep
inside; numpy integers are accepted where ints are."""
from __future__ import annotations

import numpy as np
import pytest
from k3ir.runtime import Session, init_params

import k3ir
from k3ir.errors import K3Error, K3RuntimeError


@pytest.fixture(scope="module")
def tiny_session():
    return Session(k3ir.compile(k3ir.load("k3-tiny"), target="torch"), seed=0)


@pytest.mark.parametrize("call,msg", [
    (lambda: k3ir.compile("k3-tiny", target="torch"), "compile takes a Module: use k3ir.load('k3-tiny') first"),
    (lambda: k3ir.compile(None, target="torch"), "compile takes a Module (from k3ir.load or k3ir.parse_file), got NoneType"),
    (lambda: k3ir.load("k3-tiny", overrides=[("hidden_size", 96)]),
     "load: overrides must be a dict of config keys (e.g. {'hidden_size': 96}), got list"),
    (lambda: k3ir.load(None), "load: name_or_path must be a model name or a path (str), got NoneType None"),
])
def test_api_argument_types(call, msg):
    with pytest.raises(K3Error) as ei:
        call()
    assert str(ei.value) == msg


def test_session_argument_types(tiny_session):
    with pytest.raises(K3RuntimeError, match=r"^Session takes an Executable \(from k3ir.compile\), got str: use"):
        Session("exe")
    with pytest.raises(K3RuntimeError, match=r"^Session.load: directory must be a path \(str\), got NoneType$"):
        Session.load(None)
    with pytest.raises(K3RuntimeError, match=r"^init_params takes a Module \(from k3ir.load\), got str$"):
        init_params("x")
    with pytest.raises(K3RuntimeError, match=r"^input_ids must be a rectangular \[B, T\] array of token ids; "
                                             r"the rows have different lengths \[1, 2\]$"):
        tiny_session.forward([[1, 2], [3]])
    for bad in (None, "hello"):
        with pytest.raises(K3RuntimeError, match=r"^input_ids must be token ids \[B, T\]"):
            tiny_session.forward(bad)
    ids = np.array([[1, 2, 3]])
    with pytest.raises(K3RuntimeError, match=r"^max_new_tokens must be an integer, got float 2.5$"):
        tiny_session.generate(ids, max_new_tokens=2.5)
    with pytest.raises(K3RuntimeError, match=r"^max_new_tokens must be an integer, got str '3'$"):
        tiny_session.generate(ids, max_new_tokens="3")
    with pytest.raises(K3RuntimeError, match=r"^temperature must be a number >= 0, got str 'hot'$"):
        tiny_session.generate(ids, max_new_tokens=1, temperature="hot")
    # the checks do not refuse numpy integers
    assert tiny_session.generate(ids, max_new_tokens=np.int64(2)).shape == (1, 5)
