"""Precision helpers of the eager PyTorch kernels: the accumulation dtype and the IR's ``f32``."""
from __future__ import annotations

import torch

T = torch.Tensor


def _acc(x: T) -> T:
    """Accumulation dtype: fp32 unless x is already wider."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def _f32(x: T) -> T:
    """An IR ``f32`` value (gates, router, state, logits): fp32, or fp64 under a float64 compile."""
    return x if x.dtype == torch.float64 else x.float()
