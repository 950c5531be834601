"""Op families; importing this package registers every op."""
from . import core, state, nn, kda, mla, moe, residual  # noqa: F401
