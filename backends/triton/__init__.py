"""The triton target (not built yet)."""
