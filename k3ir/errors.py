"""Error types users can catch. Every message says what, where and what was expected."""
from __future__ import annotations


class K3Error(Exception):
    """Base class of every k3ir user-facing error (the CLI turns these into exit code 2)."""


class K3ConfigError(K3Error):
    """A model config is invalid; the message names the file and the key."""

    def __init__(self, message: str, *, key: str | None = None, path: str | None = None):
        where = []
        if path:
            where.append(str(path))
        if key:
            where.append(f"key '{key}'")
        super().__init__(f"{': '.join(where)}: {message}" if where else message)
        self.key = key
        self.path = path


class K3ParseError(K3Error):
    """The text IR could not be parsed; carries 1-based line and column."""

    def __init__(self, message: str, line: int, col: int, source: str | None = None):
        prefix = f"{source}:" if source else ""
        super().__init__(f"{prefix}{line}:{col}: {message}")
        self.line = line
        self.col = col


class K3VerifyError(K3Error):
    """An op or function broke an IR invariant (types, shapes, attributes)."""


class K3CheckpointError(K3Error):
    """A checkpoint is missing, corrupt or does not match the model."""


class K3BackendError(K3Error):
    """A target is unknown or cannot run here."""


class K3RuntimeError(K3Error):
    """Bad input to a Session (shapes, token ids, state)."""


class K3KernelInputError(K3RuntimeError):
    """A kernel entry point or op implementation got an input that would corrupt memory or results (shape,
    dtype, device, index range, duplicate slot, gate sign); the message names the argument, what it got and
    what was expected."""
