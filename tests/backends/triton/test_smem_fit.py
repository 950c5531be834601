"""``smem_fit.fit_stages``: fewer pipeline stages when a config does not fit in shared memory (fp32 inputs with
the 3-stage KDA recurrences needed 262,144 B on the H200, whose limit is 232,448 B per block)."""
import pytest

pytest.importorskip("triton")

from k3ir.backends.triton import smem_fit
from triton.runtime.errors import OutOfResources


def _launcher(limit, calls):
    """A launch that needs 87,381 B of shared memory per stage (3 stages: 262,143 B) against ``limit``."""
    def launch(ns):
        calls.append(ns)
        need = 87381 * ns
        if need > limit:
            raise OutOfResources(need, limit, "shared memory")
        return ns
    return launch


def test_fits_with_fewer_stages_and_remembers():
    calls = []
    assert smem_fit.fit_stages(("t1", "fp32"), 3, _launcher(232448, calls)) == 2
    assert calls == [3, 2]
    calls.clear()
    assert smem_fit.fit_stages(("t1", "fp32"), 3, _launcher(232448, calls)) == 2
    assert calls == [2]          # straight to the stage count that fitted


def test_fitting_config_is_untouched_and_nothing_fits_raises():
    calls = []
    assert smem_fit.fit_stages(("t2", "bf16"), 3, _launcher(300000, calls)) == 3
    assert calls == [3]
    with pytest.raises(OutOfResources):
        smem_fit.fit_stages(("t3", "huge"), 2, _launcher(1000, []))
