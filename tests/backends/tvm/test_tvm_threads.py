"""TVM's CPU thread pool size for the tvm (llvm) target: ``configure_threads`` (``TvmConfig.num_threads``) sets
``TVM_NUM_THREADS`` before the first run, since TVM's own default on x86 is half the hardware threads (one thread on
a 2-core machine)."""
from __future__ import annotations

import os
import threading

import pytest

tvm = pytest.importorskip("tvm")

from k3ir.backends.tvm import configure_threads
from k3ir.backends.tvm.config import tvm_config


def _pool_threads() -> int:
    """Threads of the pool TVM makes for a new Python thread (pools are per calling thread, sized when made)."""
    out = []
    t = threading.Thread(target=lambda: out.append(tvm.get_global_func("runtime.NumThreads")()))
    t.start()
    t.join()
    return out[0]


def test_pool_takes_every_cpu_of_the_process_by_default(monkeypatch):
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    cpus = len(os.sched_getaffinity(0))
    assert configure_threads() == cpus
    assert os.environ["TVM_NUM_THREADS"] == str(cpus)
    assert _pool_threads() == cpus


def test_configured_count_and_the_users_variable(monkeypatch):
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    with tvm_config(num_threads=1):
        assert configure_threads() == 1
    assert _pool_threads() == 1
    monkeypatch.setenv("TVM_NUM_THREADS", "3")            # the user's setting stays
    assert configure_threads() == 3 and os.environ["TVM_NUM_THREADS"] == "3"


def test_a_negative_count_in_a_scope_is_a_config_error(monkeypatch):
    """TVM reads a negative ``TVM_NUM_THREADS`` as one thread without a word: the scope ``num_threads=-1`` is refused
    (by the config, as ``K3IR_TVM_NUM_THREADS=-1`` is) and nothing is set."""
    from k3ir.errors import K3ConfigError
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    with pytest.raises(K3ConfigError, match=r"TvmConfig\.num_threads=-1: a thread count is >= 0"), \
            tvm_config(num_threads=-1):
        configure_threads()
    assert "TVM_NUM_THREADS" not in os.environ
