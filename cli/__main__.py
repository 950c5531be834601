"""``python -m k3ir.cli`` (and ``torchrun -m k3ir.cli``): the ``k3ir`` command."""
import sys

from .app import main

sys.exit(main())
