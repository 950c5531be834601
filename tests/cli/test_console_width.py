"""The width of what ``k3ir`` prints: piped or redirected, a line is not hard-wrapped (rich wrapped at the 110
columns it assumed); ``COLUMNS`` sets the width; on a terminal, the terminal's width, at least 110. End to end:
tests/cli/test_cli_backends.py reads ``k3ir backends`` piped, a table row per line."""
from __future__ import annotations

import pytest
from k3ir.cli.common import console

LONG = " ".join(f"word{i:03d}" for i in range(60))        # 479 characters


@pytest.fixture
def no_columns(monkeypatch):
    for var in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(var, raising=False)


def test_piped_text_is_not_wrapped(capsys, no_columns):
    console().print(LONG)
    assert capsys.readouterr().out == LONG + "\n"


def test_piped_table_row_stays_on_one_line(capsys, no_columns):
    from rich.table import Table
    t = Table(title="t")
    t.add_column("name")
    t.add_column("long")
    t.add_row("a", LONG)
    console().print(t)
    rows = [ln for ln in capsys.readouterr().out.splitlines() if "│" in ln]
    assert len(rows) == 1 and LONG in rows[0], rows


def test_columns_sets_the_width(capsys, monkeypatch, no_columns):
    monkeypatch.setenv("COLUMNS", "200")
    console().print(LONG)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and max(len(ln.rstrip()) for ln in lines) <= 200, lines
    assert " ".join(ln.strip() for ln in lines) == LONG


@pytest.mark.parametrize("columns, width", [(90, 110), (150, 150)])
def test_terminal_is_as_wide_as_the_terminal_at_least_110(monkeypatch, no_columns, columns, width):
    """On a terminal (rich's test; ``FORCE_COLOR`` makes one of any stream) the console is as wide as the terminal,
    at least 110 columns."""
    import os
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setattr("shutil.get_terminal_size", lambda fallback=(80, 24): os.terminal_size((columns, 24)))
    con = console()
    assert con.is_terminal and con.width == width
