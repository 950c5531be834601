"""Shared fixtures. GPU tests are marked ``gpu`` and skip without CUDA.

Hypothesis profiles: ``suite`` (loaded by default: a few dozen examples per fuzz test, no deadline, so each
runs in seconds) and ``fuzz-long`` (thousands of examples; ``--hypothesis-profile=fuzz-long``, as
scripts/fuzz_readers.sh runs it). A test's own ``@settings`` override the profile."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

#: fuzz inputs are large texts built from small draws; the examples are slow-ish (a parse each), not stuck
_FUZZ_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
settings.register_profile("suite", deadline=None, max_examples=25, suppress_health_check=_FUZZ_HEALTH,
                          print_blob=True)
settings.register_profile("fuzz-long", deadline=None, max_examples=3000, suppress_health_check=_FUZZ_HEALTH,
                          print_blob=True)
settings.load_profile("suite")


def rel_err(got, want) -> float:
    """SPEC.md 11: ||got - want||_2 / ||want||_2 over the whole tensor, in float64."""
    try:
        import torch
        if isinstance(got, torch.Tensor):
            got = got.detach().cpu().double().numpy()
        if isinstance(want, torch.Tensor):
            want = want.detach().cpu().double().numpy()
    except ImportError:
        pass
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


try:  # tiny models: one intra-op thread is much faster than two fighting over small kernels
    import torch as _torch
    _torch.set_num_threads(1)
except ImportError:
    pass


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``k3ir`` in process: (exit code, stdout, stripped stderr) of ``main(argv)``."""
    from k3ir.cli import main
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err.strip()


def one_line_error(err: str) -> str:
    """``err`` after checking it is one ``k3ir: error: ...`` line without a traceback."""
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("k3ir: error: "), err
    return err


def usage_error(capsys, *argv) -> str:
    """The stderr line of ``k3ir argv`` refused while its arguments are parsed, after checking: exit code 2, nothing
    on stdout, one line and no usage block or traceback."""
    from k3ir.cli import main
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "", (e.value.code, out, err)
    assert len(err.splitlines()) == 1 and "usage:" not in err and "Traceback" not in err, err
    return err.strip()


def tiny_config_file(tmp_path, section: str, key: str, value) -> str:
    """Path of a copy of the bundled k3-tiny config.json (``tmp_path/c_bad.json``) with ``[section][key] =
    value`` (``section`` "" for the top level); json.dumps writes NaN / Infinity as Python does."""
    import json

    from k3ir.frontend.config import resolve_config_path
    with open(resolve_config_path("k3-tiny")) as f:
        raw = json.load(f)
    (raw[section] if section else raw)[key] = value
    path = tmp_path / "c_bad.json"
    path.write_text(json.dumps(raw))
    return str(path)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="module")
def tvm_opt_level_0():
    """The tvm target's LLVM builds at opt level 0 (about 3x faster, same numerics: ``TvmConfig.opt_level``) for
    the tests of one module, through the ``tvm_config`` scope: nothing is written to ``os.environ``, so other
    modules and subprocesses keep the shipped defaults. Modules with real TVM builds use it (``pytestmark =
    pytest.mark.usefixtures("tvm_opt_level_0")``, or as a dependency of their module-scoped build fixtures)."""
    from k3ir.backends.tvm.config import tvm_config
    with tvm_config(opt_level=0):
        yield


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
