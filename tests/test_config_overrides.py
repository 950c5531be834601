"""Overrides that scale a bundled model down keep it consistent: a ``vocab_size`` override moves the special
token ids with the end of the vocabulary."""
from __future__ import annotations

import pytest

import k3ir


def test_vocab_override_moves_special_tokens():
    """Scaling kimi-k3 down (``vocab_size`` override alone) keeps the special tokens' distance from the end of the
    vocabulary (config: vocab 163840, bos 163584, eos 163586, pad 163839, media 163605) instead of failing the
    token id range check."""
    m = k3ir.load("kimi-k3", overrides={"vocab_size": 512, "num_hidden_layers": 2,
                                        "linear_attn_config.full_attn_layers": [2]})
    c = m.config
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id, c.media_placeholder_token_id) == (256, 258, 511, 277)
    with pytest.raises(k3ir.K3ConfigError, match=r"key 'text_config.bos_token_id': must be in 0..511, got 600"):
        k3ir.load("kimi-k3", overrides={"vocab_size": 512, "bos_token_id": 600})
    small = k3ir.load("kimi-k3", overrides={"vocab_size": 100, "num_hidden_layers": 2,
                                            "linear_attn_config.full_attn_layers": [2]}).config
    assert (small.bos_token_id, small.pad_token_id) == (None, 99)
