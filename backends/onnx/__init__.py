"""The onnx target (not built yet)."""
