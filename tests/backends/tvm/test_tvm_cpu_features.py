"""A TVM artifact built for its build host's CPU records the host's SIMD extensions (manifest ``simd_flags``) and
is refused, with one error naming the missing extensions and the rebuild switch, on a CPU without one of them
(its kernels would otherwise die with SIGILL)."""
from __future__ import annotations

import pytest
from k3ir.backends.tvm import check_simd_flags, host_simd_flags

from k3ir.errors import K3RuntimeError

AVX2_HOST = "processor\t: 0\nflags\t\t: fpu sse sse2 sse4_1 sse4_2 avx avx2 fma f16c\n"


def _cpuinfo(tmp_path, text):
    p = tmp_path / "cpuinfo"
    p.write_text(text)
    return str(p)


def test_host_flags_are_read_from_the_first_flags_line(tmp_path):
    assert host_simd_flags(_cpuinfo(tmp_path, AVX2_HOST + "flags\t: avx512f\n")) == [
        "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c"]
    assert host_simd_flags(_cpuinfo(tmp_path, "processor : 0\n")) is None
    assert host_simd_flags(str(tmp_path / "absent")) is None


def test_an_avx512_artifact_is_refused_on_an_avx2_cpu(tmp_path):
    man = {"mcpu": "sapphirerapids", "simd_flags": ["sse4_2", "avx2", "avx512f", "avx512bw"]}
    with pytest.raises(K3RuntimeError) as e:
        check_simd_flags(man, "art", _cpuinfo(tmp_path, AVX2_HOST))
    msg = str(e.value)
    assert msg.startswith("art: ") and "sapphirerapids" in msg and "avx512f, avx512bw" in msg
    assert "K3IR_TVM_MCPU" in msg and "avx2," not in msg


@pytest.mark.parametrize("man", [{"mcpu": "haswell", "simd_flags": ["avx2", "fma"]},
                                 {"mcpu": "x86-64-v2"},                      # built for a named CPU: nothing recorded
                                 {"mcpu": "znver4", "simd_flags": []}])
def test_a_compatible_or_named_cpu_artifact_loads(tmp_path, man):
    check_simd_flags(man, "art", _cpuinfo(tmp_path, AVX2_HOST))


@pytest.mark.parametrize("bad", ["avx2", [1, 2], {"avx2": True}])
def test_a_malformed_flags_entry_is_named(tmp_path, bad):
    with pytest.raises(K3RuntimeError, match=r"art/manifest.json: 'simd_flags' must be a list"):
        check_simd_flags({"simd_flags": bad}, "art", _cpuinfo(tmp_path, AVX2_HOST))



@pytest.mark.parametrize("mcpu, hint", [("haswel", "did you mean haswell?"), ("notacpu", "e.g. x86-64-v2")])
def test_an_unknown_mcpu_is_a_config_error_before_building(mcpu, hint):
    """LLVM would warn and build for ``generic`` while the manifest said ``mcpu``: refused up front instead."""
    pytest.importorskip("tvm")
    from k3ir.backends.tvm import llvm_target
    from k3ir.backends.tvm.config import tvm_config

    from k3ir.errors import K3ConfigError
    with tvm_config(mcpu=mcpu), pytest.raises(K3ConfigError, match=rf"K3IR_TVM_MCPU='{mcpu}': not a CPU LLVM knows"
                                                                     rf".*{hint}"):
        llvm_target()
    with tvm_config(mcpu="x86-64-v2"):
        assert str(llvm_target().attrs["mcpu"]) == "x86-64-v2"
