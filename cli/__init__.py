"""The ``k3ir`` command line (``k3ir.cli.app``): one module per command group, each with a
``register(subparsers)``; ``common`` holds what they share. docs/cli.md is the reference."""
from .app import main

__all__ = ["main"]
