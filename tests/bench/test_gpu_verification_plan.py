"""bench/gpu_verification.py's wheel list: which carried wheels a GPU call still lacks, and the plan naming them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import gpu_verification as gv


def test_missing_wheels_matches_name_and_version():
    have = ["fla_core-0.6.0-py3-none-any.whl", "transformers-5.23.0-py3-none-any.whl",   # wrong version
            "pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "notes.txt"]
    missing = gv.missing_wheels(have)
    assert "fla_core==0.6.0" not in missing and "pydantic_core==2.46.4" not in missing
    assert "transformers==5.24.0" in missing and "fastapi==0.165.0" in missing
    assert len(missing) == len(gv.WHEELS) - 2


def test_wheels_cover_the_serve_extra_the_gpu_image_lacks():
    """fastapi, uvicorn, sse-starlette are in pyproject's ``serve`` extra and not on the GPU image (KINDS.md)."""
    names = {w.split("==")[0] for w in gv.WHEELS}
    assert {"fastapi", "uvicorn", "sse_starlette", "starlette", "pydantic", "pydantic_core"} <= names


def test_plan_prints_the_download_command_for_missing_wheels():
    out = subprocess.run([sys.executable, str(BENCH / "gpu_verification.py"), "plan"], capture_output=True,
                         text=True, check=True).stdout
    assert "call 6: serve_load" in out
    if gv.missing_wheels(sorted(p.name for p in (BENCH.parent / ".whl").glob("*.whl"))):
        assert "MISSING wheels" in out and "pip download" in out
    else:
        assert "MISSING wheels" not in out
