"""Runtime-object (state) ops. At run time a state is a tensor:
``!kda_state<H,K,V>`` -> f32[B,H,K,V]; ``!conv_state<C,W>`` -> [B,C,W] (the last W pre-conv
inputs, oldest first); ``!mla_cache<R,P>`` -> [B,L,R+P] (``[c_kv | k_rope]`` per cached token)."""
from __future__ import annotations

import numpy as np

from ..opdef import Attr, Op, Operand, Result, op, require
from ..types import StateType, TensorType


def state_tensor_type(s: StateType, batch) -> TensorType:
    if s.kind == "kda_state":
        return TensorType("f32", (batch,) + s.params)
    if s.kind == "conv_state":
        return TensorType("f32", (batch,) + s.params)
    return TensorType("f32", (batch, "L", s.params[0] + s.params[1]))


def zero_state(s: StateType, batch: int) -> np.ndarray:
    shape = state_tensor_type(s, batch).shape
    return np.zeros([0 if d == "L" else d for d in shape], dtype=np.float64)


@op("k3.state_zero")
class StateZero(Op):
    """An empty state (zeros; an MLA cache of length 0) with the batch size of ``like``."""
    like = Operand()
    out = Result()
    kind = Attr(str)
    params = Attr(list)

    def infer(self, like):
        return [StateType(self.kind, tuple(self.params))]

    def reference(self, like):
        return zero_state(StateType(self.kind, tuple(self.params)), like.shape[0])


@op("k3.state_load")
class StateLoad(Op):
    """View a state as its tensor (see module docstring); ``batch`` names the batch dim."""
    s = Operand()
    out = Result()
    batch = Attr(object, "B")

    def infer(self, s):
        require(isinstance(s, StateType), "state_load needs a state")
        return [state_tensor_type(s, self.batch)]

    def reference(self, s):
        return s


@op("k3.state_store")
class StateStore(Op):
    """Wrap a tensor as a state of ``kind``/``params``."""
    x = Operand()
    out = Result()
    kind = Attr(str)
    params = Attr(list)

    def infer(self, x):
        st = StateType(self.kind, tuple(self.params))
        want = state_tensor_type(st, x.shape[0])
        require(x.rank == len(want.shape), f"{x} cannot hold {st}")
        return [st]

    def reference(self, x):
        return x
