"""MLA attention (SPEC.md 4) on Triton: ``attn`` (flash prefill, absorbed decode), ``tiled`` (prefill with the
keys in tiles, memory linear in the prompt)."""
