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


def test_serve_load_checkpoint_tokenizer_covers_the_vocabulary(tmp_path):
    """The serving step's checkpoint for a bundled config: its tokenizer.json round-trips text through byte ids
    (0..255) and decodes every other id of the 32000-id vocabulary to its own non-empty text, so each generated
    token of the random model streams as one event (the inter-token latency counts every token)."""
    import json
    pytest = __import__("pytest")
    pytest.importorskip("tokenizers")
    from k3ir.runtime.tokenizer import load_tokenizer

    cfg = gv.byte_tokenizer_checkpoint("kimi-linear-6p6b", str(tmp_path / "ck"))
    vocab = json.loads((tmp_path / "ck" / "config.json").read_text())["vocab_size"]
    tok = load_tokenizer(cfg, type("M", (), {"attrs": {"vocab_size": vocab}}))
    ids = tok.encode("héllo, wörld")
    assert tok.decode(ids) == "héllo, wörld" and max(ids) < 256 and len(ids) == len("héllo, wörld".encode())
    words = [tok.decode([i]) for i in range(256, vocab)]
    assert vocab == 32000 and all(words) and len(set(words)) == len(words)
