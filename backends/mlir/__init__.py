"""The mlir target (not built yet)."""
