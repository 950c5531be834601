"""Run an exported K3-family model with bare onnxruntime: prefill from zero state, then greedy decode.

    k3ir export k3-tiny --format onnx -o tiny.onnx                          # one graph for prefill and decode
    python docs/onnx_decode.py tiny.onnx --prompt 5 17 42

    k3ir export k3-tiny --format onnx --function prefill -o prefill.onnx     # or one graph per function
    k3ir export k3-tiny --format onnx --function decode -o decode.onnx
    python docs/onnx_decode.py prefill.onnx --decode decode.onnx --prompt 5 17 42

Inputs are ``input_ids`` (int64 ``[B,T]``) then one tensor per state, then the optional ``logits_to_keep``
(int64 scalar, left out here); outputs are ``logits`` (``[B,1,V]``: the last position's, the file's default
``logits_to_keep`` = 1; feed ``logits_to_keep`` = 0 for ``[B,T,V]``) then ``present.<state>`` in the same order
(``k3ir export --describe`` lists them).
A fresh sequence feeds zero states, with 0 for a dynamic length such as the MLA cache's ``L``.
Only numpy and onnxruntime are needed here.
"""
from __future__ import annotations

import argparse

import numpy as np
import onnxruntime as ort


def state_inputs(sess: ort.InferenceSession) -> list:
    """The state inputs: every input after ``input_ids`` but the optional ``logits_to_keep``."""
    return [spec for spec in sess.get_inputs()[1:] if not spec.type.startswith("optional")]


def zero_states(sess: ort.InferenceSession, batch: int) -> dict[str, np.ndarray]:
    """Zero-filled states (batch dim ``B``, other dynamic dims 0)."""
    out = {}
    for spec in state_inputs(sess):
        shape = [batch if d == "B" else (d if isinstance(d, int) else 0) for d in spec.shape]
        out[spec.name] = np.zeros(shape, np.float16 if "float16" in spec.type else np.float32)
    return out


def generate(prefill_path: str, decode_path: str, prompt: list[int], steps: int = 8) -> list[int]:
    """Greedy tokens after ``prompt`` (batch of one)."""
    prefill = ort.InferenceSession(prefill_path, providers=["CPUExecutionProvider"])
    decode = ort.InferenceSession(decode_path, providers=["CPUExecutionProvider"])
    names = [s.name for s in state_inputs(prefill)]
    feeds = {"input_ids": np.asarray([prompt], np.int64), **zero_states(prefill, 1)}
    logits, *states = prefill.run(None, feeds)
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits[0, -1].argmax()))
        feeds = {"input_ids": np.asarray([[tokens[-1]]], np.int64), **dict(zip(names, states))}
        logits, *states = decode.run(None, feeds)
    return tokens


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="greedy decode of an exported K3-family ONNX model with onnxruntime")
    ap.add_argument("model", help="the exported graph (prefill, or prefill and decode in one)")
    ap.add_argument("--decode", help="a separate decode graph (default: MODEL)")
    ap.add_argument("--prompt", type=int, nargs="+", default=[1, 2, 3], help="prompt token ids (default: 1 2 3)")
    ap.add_argument("--steps", type=int, default=8, help="tokens to generate (default: 8)")
    a = ap.parse_args()
    print(generate(a.model, a.decode or a.model, a.prompt, a.steps))
