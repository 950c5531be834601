"""KDA (SPEC.md 3) on Triton: one file per stage of the chunked algorithm, the reference beside the kernels.

* ``chunk``: ``kda_forward`` (the entry point, with autograd) and the launch sequence of the chunked forward;
* ``fwd_intra``: the split intra-chunk forward launches (gate cumsum, A/P and the inverse, then w/u);
* ``fwd``: the one-launch intra kernel and the inter-chunk recurrence;
* ``bwd``, ``bwd_kernels``, ``bwd_intra``: the chunked backward;
* ``common``: the ``@triton.jit`` helpers the kernels share;
* ``naive``: the differentiable PyTorch chunked form (the backward's ``torch`` mode and the tests' peer);
* ``layer``, ``layer_kernels``: the layer around the recurrence (short conv prelude, gated RMSNorm epilogue,
  the one-launch decode step, and the decode router).
"""
