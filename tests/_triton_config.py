"""Test helper: overrides of one ``TritonConfig`` section for the length of a test (``tuning.update({...})``,
``tuning[key] = value``), each an entered ``triton_config`` scope, all exited at teardown."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any


class SectionOverrides:
    """Dict-like writes into ``TritonConfig.<section>`` (``update``, ``[key] = value``) and reads of the value in
    effect (``[key]``); each write enters one more scope on ``stack``."""

    def __init__(self, stack: contextlib.ExitStack, section: str) -> None:
        self._stack, self._section = stack, section

    def update(self, changes: Mapping[str, Any]) -> None:
        from k3ir.backends.triton.config import triton_config
        self._stack.enter_context(triton_config(**{self._section: dict(changes)}))

    def __setitem__(self, key: str, value: Any) -> None:
        self.update({key: value})

    def __getitem__(self, key: str) -> Any:
        from k3ir.backends.triton.config import get_triton_config
        return getattr(getattr(get_triton_config(), self._section), key)


@contextlib.contextmanager
def section_overrides(section: str) -> Iterator[SectionOverrides]:
    """``SectionOverrides`` of ``section``; every scope it entered is exited when the block ends."""
    with contextlib.ExitStack() as stack:
        yield SectionOverrides(stack, section)
