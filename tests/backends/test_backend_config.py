"""The backends' typed configs (backends/config.py; TritonConfig, TvmConfig, MlirConfig): every ``K3IR_*`` variable
the package names is documented, environment defaults are read once at first use and never at import, and the
scoped overrides nest, restore on exit (also on an exception) and stay in their thread."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import threading
from dataclasses import dataclass

import pytest
from k3ir.backends.config import ScopedConfig, describe, from_env, parse_ints, setting
from k3ir.backends.mlir.config import MlirConfig, get_mlir_config, mlir_config
from k3ir.backends.triton.config import TritonConfig, get_triton_config, triton_config
from k3ir.backends.tvm.config import TvmConfig, get_tvm_config, tvm_config

from k3ir.errors import K3ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("k3ir", "frontend", "passes", "backends", "runtime", "cli")
DOCS = ("docs/config.md", "docs/gpu.md")


def _package_variables() -> dict[str, str]:
    """``K3IR_*`` names in the package's Python sources -> the first file naming one."""
    found: dict[str, str] = {}
    for d in PACKAGE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            for name in re.findall(r"\bK3IR_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8")):
                found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_k3ir_variable_in_the_package_is_documented():
    docs = "\n".join((ROOT / p).read_text(encoding="utf-8") for p in DOCS)
    found = _package_variables()
    assert {"K3IR_PDL", "K3IR_TVM_OPT_LEVEL", "K3IR_CACHE", "K3IR_API_KEY"} <= set(found)   # the scan sees them
    missing = {n: f for n, f in found.items() if not re.search(rf"\b{n}\b", docs)}
    assert not missing, f"K3IR_* variables missing from {' / '.join(DOCS)}: {missing}"


@pytest.mark.parametrize("cls", [TritonConfig, TvmConfig, MlirConfig])
def test_every_config_field_is_documented(cls):
    """Each field (section.field) of each backend config has a description and a row in docs/config.md."""
    doc = (ROOT / "docs/config.md").read_text(encoding="utf-8")
    rows = describe(cls)
    assert rows and all(d for _, _, _, d in rows)
    assert [p for p, _, _, _ in rows if f"`{p}`" not in doc] == []


def test_triton_defaults_and_environment_values():
    """Defaults as shipped; each variable parsed into its field (booleans, integer tuples, lower-cased mode)."""
    base = from_env(TritonConfig, {})
    assert base.kda.bwd_reuse is True and base.decode.pdl is True and base.decode.gemv is None
    assert base.moe.decode_bf16 == ("t", 64, 16, 0, 128, 4, 4) and base.kda_bwd.mma_v2 == "bwd_wy"
    env = {"K3IR_PDL": "0", "K3IR_GEMV": "8,256,4", "K3IR_KDA_BWD": " Torch ", "K3IR_MOE_DECODE_BF16": "32,16,0,64,4,2",
           "K3IR_MOE_ROUTED_GLU": "0", "K3IR_CUDA_GRAPHS": "", "K3IR_MLA_PREFILL": "128,64,8,2"}
    cfg = from_env(TritonConfig, env)
    assert cfg.decode.pdl is False and cfg.decode.gemv == (8, 256, 4) and cfg.kda_bwd.mode == "torch"
    assert cfg.moe.decode_bf16 == ("t", 32, 16, 0, 64, 4, 2) and cfg.decode.routed_glu is False
    assert cfg.decode.cuda_graphs is True                    # an empty variable keeps the default
    assert cfg.mla.prefill == (128, 64, 8, 2)
    assert from_env(TvmConfig, {"K3IR_TVM_OPT_LEVEL": "2", "K3IR_TVM_NUM_THREADS": "3"}).opt_level == 2
    assert from_env(MlirConfig, {"K3IR_CACHE": "/x"}).cache_dir() == "/x"


@pytest.mark.parametrize(("cls", "env", "match"), [
    (TritonConfig, {"K3IR_PDL": "maybe"}, "K3IR_PDL='maybe'.*pdl"),
    (TritonConfig, {"K3IR_GEMV": "8,x,4"}, "K3IR_GEMV"),
    (TvmConfig, {"K3IR_TVM_OPT_LEVEL": "fast"}, "K3IR_TVM_OPT_LEVEL='fast'.*opt_level"),
    (TvmConfig, {"K3IR_TVM_OPT_LEVEL": "7"}, "K3IR_TVM_OPT_LEVEL='7'.*0..3"),
    (TvmConfig, {"K3IR_TVM_NUM_THREADS": "-1"}, "K3IR_TVM_NUM_THREADS='-1'.*>= 0"),
])
def test_bad_environment_value_is_a_config_error(cls, env, match):
    with pytest.raises(K3ConfigError, match=match):
        from_env(cls, env)


@dataclass(frozen=True)
class _Inner:
    n: int = setting(1, "a number", env="K3IR_TEST_N")
    t: tuple | None = setting(None, "a tuple", env="K3IR_TEST_T", parse=parse_ints)


@dataclass(frozen=True)
class _Outer:
    flag: bool = setting(False, "a flag", env="K3IR_TEST_FLAG")
    inner: _Inner = setting(doc="a section", factory=_Inner)      # noqa: RUF009 (setting makes a dataclass field)


def test_environment_default_is_read_once_at_first_use(monkeypatch):
    monkeypatch.setenv("K3IR_TEST_N", "5")
    cfg = ScopedConfig(_Outer, "test_outer")
    monkeypatch.setenv("K3IR_TEST_N", "6")              # before the first use: this value counts
    assert cfg.get().inner.n == 6
    monkeypatch.setenv("K3IR_TEST_N", "7")              # after it: ignored until reload()
    assert cfg.get().inner.n == 6 and cfg.get() is cfg.get()
    cfg.reload()
    assert cfg.get().inner.n == 7


def test_scopes_nest_and_restore():
    cfg = ScopedConfig(_Outer, "test_nest")
    with cfg.override(flag=True) as a:
        assert cfg.get() is a and a.flag and a.inner.n == 1
        with cfg.override(inner={"n": 3}):
            assert cfg.get().flag and cfg.get().inner.n == 3            # the outer scope's flag is kept
            with cfg.override(inner={"t": (1, 2)}, flag=False):
                assert (cfg.get().flag, cfg.get().inner.n, cfg.get().inner.t) == (False, 3, (1, 2))
            assert cfg.get().flag and cfg.get().inner.t is None
        assert cfg.get().inner.n == 1
    assert cfg.get() == _Outer()


def test_scope_restores_on_exception():
    cfg = ScopedConfig(_Outer, "test_exc")
    with pytest.raises(RuntimeError, match="inside"), cfg.override(flag=True), cfg.override(inner={"n": 9}):
        raise RuntimeError("inside")
    assert cfg.get() == _Outer()


def test_unknown_field_is_a_config_error():
    with pytest.raises(K3ConfigError, match=r"TritonConfig\.kda: no field 'bk_fast'"), \
            triton_config(kda={"bk_fast": 16}):
        pass
    with pytest.raises(K3ConfigError, match="TritonConfig: no field 'kda_fwd'"), triton_config(kda_fwd={}):
        pass
    with pytest.raises(K3ConfigError, match="opt"), tvm_config(opt=1):
        pass


@pytest.mark.parametrize(("scope", "changes", "cls", "env", "reason"), [
    (tvm_config, {"opt_level": 7}, TvmConfig, {"K3IR_TVM_OPT_LEVEL": "7"}, "the LLVM optimisation level is 0..3, not 7"),
    (tvm_config, {"num_threads": -1}, TvmConfig, {"K3IR_TVM_NUM_THREADS": "-1"},
     "a thread count is >= 0 (0: every CPU of this process), not -1"),
    (triton_config, {"kda_bwd": {"mode": "jax"}}, TritonConfig, {"K3IR_KDA_BWD": "jax"}, "want one of 'triton', 'torch'"),
])
def test_scope_checks_a_value_as_the_environment_does(scope, changes, cls, env, reason):
    """A scoped override goes through the same check as the ``K3IR_*`` variable of its field: the same reason, with
    the field and the value named (the variable too, from the environment)."""
    with pytest.raises(K3ConfigError) as from_scope, scope(**changes):
        pass
    with pytest.raises(K3ConfigError) as from_environment:
        from_env(cls, env)
    field, value = next(iter(changes.items()))
    while isinstance(value, dict):
        sub, value = next(iter(value.items()))
        field = f"{field}.{sub}"
    assert str(from_scope.value) == f"{cls.__name__}.{field}={value!r}: {reason}"
    var, text = next(iter(env.items()))
    assert str(from_environment.value).startswith(f"{var}={text!r} (") and str(from_environment.value).endswith(reason)


@pytest.mark.parametrize(("scope", "changes", "message"), [
    (tvm_config, {"fast_math": "no"}, "TvmConfig.fast_math='no': want True or False, not str"),
    (tvm_config, {"fast_math": 0}, "TvmConfig.fast_math=0: want True or False, not int"),
    (tvm_config, {"opt_level": True}, "TvmConfig.opt_level=True: want an integer, not bool"),
    (tvm_config, {"opt_level": 2.0}, "TvmConfig.opt_level=2.0: want an integer, not float"),
    (tvm_config, {"mcpu": None}, "TvmConfig.mcpu=None: want text (a str), not NoneType"),
    (tvm_config, {"kda_chunk_size": 7}, "TvmConfig.kda_chunk_size=7: the KDA chunk is a positive multiple"),
    (tvm_config, {"kda_chunk_size": 0}, "TvmConfig.kda_chunk_size=0: the KDA chunk is a positive multiple"),
    (tvm_config, {"kda_chunk_min_tokens": -1}, "TvmConfig.kda_chunk_min_tokens=-1: a token count is >= 0"),
    (triton_config, {"decode": {"pdl": "no"}}, "TritonConfig.decode.pdl='no': want True or False, not str"),
    (triton_config, {"decode": {"gemv": "8,256,4"}}, "TritonConfig.decode.gemv='8,256,4': want a tuple or None"),
    (triton_config, {"kda": {"maxnreg": "128"}}, "TritonConfig.kda.maxnreg='128': want an integer or None, not str"),
    (triton_config, {"kda": 5}, "TritonConfig.kda=5: want a KdaConfig or a mapping of its fields"),
    (mlir_config, {"kda_chunk": "16"}, "MlirConfig.kda_chunk='16': want an integer, not str"),
    (mlir_config, {"cache": 5}, "MlirConfig.cache=5: want text (a str) or None, not int"),
])
def test_scope_refuses_a_value_its_field_cannot_take(scope, changes, message):
    """``fast_math='no'`` would be truthy and ``kda_chunk_size=7`` fails only deep in a GPU build: each is a
    K3ConfigError when the scope is entered, and the config in effect stays as it was."""
    before = (get_tvm_config(), get_triton_config(), get_mlir_config())
    with pytest.raises(K3ConfigError) as e, scope(**changes):
        pass
    assert str(e.value).startswith(message), str(e.value)
    assert (get_tvm_config(), get_triton_config(), get_mlir_config()) == before


def test_scope_takes_values_of_the_fields_type(tmp_path):
    """What a field's type takes: an int for a float field (as a float), a list for a tuple field (as a tuple), a
    path for a text field (as its str), None where the field may be None, a whole section object."""
    from k3ir.backends.triton.config import KdaConfig
    with triton_config(kda={"clamp_thr": 100, "maxnreg": None}, decode={"gemv": [8, 256, 4]}) as cfg:
        assert cfg.kda.clamp_thr == 100.0 and isinstance(cfg.kda.clamp_thr, float) and cfg.kda.maxnreg is None
        assert cfg.decode.gemv == (8, 256, 4)
    with mlir_config(cache=tmp_path) as cfg:
        assert cfg.cache == str(tmp_path) and cfg.cache_dir() == str(tmp_path)
    with tvm_config(kda_chunk_size=8, kda_chunk_min_tokens=0, fast_math=False) as cfg:
        assert (cfg.kda_chunk_size, cfg.kda_chunk_min_tokens, cfg.fast_math) == (8, 0, False)
    with triton_config(kda=KdaConfig(bk=16)) as cfg:
        assert cfg.kda.bk == 16
    with pytest.raises(K3ConfigError, match=r"TritonConfig\.kda\.bk='16': want an integer"), \
            triton_config(kda=KdaConfig(bk="16")):
        pass


def test_scopes_stay_in_their_thread():
    """Two threads in different scopes at the same time each see their own; a thread started inside a scope sees
    the process default (a new thread starts with an empty context)."""
    cfg = ScopedConfig(_Outer, "test_threads")
    barrier = threading.Barrier(2)
    seen: dict[int, int] = {}

    def work(n: int) -> None:
        with cfg.override(inner={"n": n}):
            barrier.wait()                         # both scopes entered before either reads
            seen[n] = cfg.get().inner.n
            barrier.wait()

    threads = [threading.Thread(target=work, args=(n,)) for n in (10, 20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {10: 10, 20: 20}
    with cfg.override(flag=True):
        box = []
        t = threading.Thread(target=lambda: box.append(cfg.get().flag))
        t.start()
        t.join()
        assert box == [False] and cfg.get().flag


def test_backend_config_overrides():
    with triton_config(kda={"bwd_reuse": False}, decode={"pdl": False}):
        assert not get_triton_config().kda.bwd_reuse and not get_triton_config().decode.pdl
        assert get_triton_config().kda.bk == 32
    assert get_triton_config().kda.bwd_reuse is TritonConfig().kda.bwd_reuse
    with tvm_config(opt_level=0):
        assert get_tvm_config().opt_level == 0
    with mlir_config(cache="/tmp/k3ir-cache"):
        assert get_mlir_config().cache_dir() == "/tmp/k3ir-cache"


_IMPORT_PROBE = r"""
import json, os, sys
class Recording(dict):
    seen = set()
    def _note(self, k):
        if isinstance(k, str) and k.startswith("K3IR_"):
            Recording.seen.add(k)
    def __getitem__(self, k):
        self._note(k); return super().__getitem__(k)
    def get(self, k, d=None):
        self._note(k); return super().get(k, d)
    def __contains__(self, k):
        self._note(k); return super().__contains__(k)
env = Recording(os.environ)
env.update(K3IR_PDL="0", K3IR_TVM_OPT_LEVEL="0", K3IR_CACHE="/nonexistent")
os.environ = env
import importlib
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError as e:            # an optional dependency missing here: skip that module
        print("skip", name, e, file=sys.stderr)
print(json.dumps(sorted(Recording.seen)))
"""

_BACKEND_MODULES = ["k3ir.backends", "k3ir.backends.config", "k3ir.backends.triton", "k3ir.backends.triton.config",
                    "k3ir.backends.triton.gemv", "k3ir.backends.triton.moe.grouped", "k3ir.backends.triton.moe.dispatch",
                    "k3ir.backends.triton.mla.attn", "k3ir.backends.triton.kda.chunk", "k3ir.backends.triton.kda.bwd",
                    "k3ir.backends.triton.executable", "k3ir.backends.triton.lowering", "k3ir.backends.tvm",
                    "k3ir.backends.tvm.config", "k3ir.backends.mlir", "k3ir.backends.mlir.config"]


def test_importing_the_backends_reads_no_k3ir_variable():
    """Importing every backend module (in a fresh interpreter whose os.environ records reads) reads no K3IR_*
    variable: the configs read theirs at first use."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, *_BACKEND_MODULES], capture_output=True, text=True,
                         env=env, timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_first_use_reads_the_environment():
    """The same probe, then a first ``get_triton_config()``: the variables are read then (the probe sees reads)."""
    probe = _IMPORT_PROBE.replace('print(json.dumps', 'from k3ir.backends.triton.config import get_triton_config\n'
                                  'assert get_triton_config().decode.pdl is False\nprint(json.dumps')
    out = subprocess.run([sys.executable, "-c", probe, "k3ir.backends.triton.config"], capture_output=True,
                         text=True, env=dict(os.environ), timeout=120, check=True)
    assert "K3IR_PDL" in json.loads(out.stdout.strip().splitlines()[-1])


def test_no_wgmma_sets_disable_mma_v3_only_inside_and_restores(monkeypatch):
    """kda_bwd._no_wgmma (``kda_bwd.mma_v2``): DISABLE_MMA_V3=1 inside the block only; the previous value (or its
    absence) back afterwards, also when the block raises."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from k3ir.backends.triton.kda.bwd import _no_wgmma
    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    with _no_wgmma(True):
        assert os.environ["DISABLE_MMA_V3"] == "1"
    assert "DISABLE_MMA_V3" not in os.environ
    monkeypatch.setenv("DISABLE_MMA_V3", "0")
    with pytest.raises(ValueError), _no_wgmma(True):
        raise ValueError("launch failed")
    assert os.environ["DISABLE_MMA_V3"] == "0"
    with _no_wgmma(False):
        assert os.environ["DISABLE_MMA_V3"] == "0"
