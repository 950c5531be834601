"""CLI input errors that argparse or the file readers catch: a binary file where text is expected, an unusable
``--device``; each is exit 2 with one line and no traceback."""
from __future__ import annotations

import pytest
from k3ir.cli import main


def test_binary_file_is_one_line_error(tmp_path, capsys):
    """A binary file where a config / IR file is expected: exit 2 and one line naming the file and where its
    first byte that is not UTF-8 sits, no UnicodeDecodeError traceback."""
    f = tmp_path / "rnd.bin"
    f.write_bytes(bytes(range(200, 256)) * 4)
    assert main(["print", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(f) in err[0] and "not valid UTF-8 at line 1, column 1 (byte 0xc8" in err[0], err


@pytest.mark.parametrize("device, words", [("tpu", "unknown device 'tpu'"), ("mps", "device 'mps' is not supported"),
                                           ("CPU", "unknown device 'CPU'"), ("meta", "device 'meta' is not supported")])
def test_unusable_device_is_a_usage_error_before_any_work(capsys, device, words):
    """``--device`` tpu/mps/meta/CPU: exit 2 with one line from argparse, before any pass runs (no torch
    traceback)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as ex:                 # argparse: usage line + one error line, exit 2
        main(["compile", "k3-tiny", "--target", "torch", "--device", device])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and f"argument --device: {words}" in err and "Traceback" not in err
