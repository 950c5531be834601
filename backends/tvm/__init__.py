"""The tvm target (not built yet)."""
