"""MoE (SPEC.md 5-7) on Triton.

* ``dispatch``: ``k3.moe_dispatch`` (counting sort) and the decode router front;
* ``grouped``: the grouped GEMM over all routed experts (``k3.grouped_matmul``) and the combine;
* ``plan``: tile and stage choice of the grouped GEMM; ``layout``: expert weight layouts (MXFP4 packing);
* ``asm``: inline-PTX helpers of the grouped GEMM; ``gluon``: the Gluon (Hopper wgmma) variant;
* ``decode``: the one-launch decode path (dispatch, GLU and down projection for a few rows).
"""
