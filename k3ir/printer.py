"""Text form of the IR: one op per line, results typed inline, attributes as sorted literals.

    module @"k3-tiny" {vocab_size=260} {
      param @"model.embed_tokens.weight": bf16[260,64]
      func @forward(%input_ids: i64[B,T]) -> (f32[B,T,260]) {
        %0: bf16[260,64] = k3.param() {name="model.embed_tokens.weight", type="bf16[260,64]"}
        ...
        return %logits
      }
    }
"""
from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:                       # annotations only: ir imports this module for Module.__str__
    from .ir import Function, Module, Operation

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


def fmt_symbol(name: str) -> str:
    return "@" + (name if _IDENT.match(name) else json.dumps(name))


def fmt_literal(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        r = repr(v)
        return r if any(c in r for c in ".en") else r + ".0"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(fmt_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return fmt_attrs(v)
    raise TypeError(f"attribute value {v!r} of type {type(v).__name__} cannot be printed")


def fmt_attrs(attrs: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}={fmt_literal(attrs[k])}" for k in sorted(attrs)) + "}"


def print_op(op: Operation) -> str:
    res = ", ".join(f"%{r.name}: {r.type}" for r in op.results)
    args = ", ".join(f"%{v.name}" for v in op.operands)
    s = f"{res} = {op.name}({args})" if op.results else f"{op.name}({args})"
    if op.attrs:
        s += " " + fmt_attrs(op.attrs)
    return s


def print_function(fn: Function, indent: str = "  ") -> str:
    args = ", ".join(f"%{a.name}: {a.type}" for a in fn.args)
    rets = ", ".join(str(v.type) for v in fn.returns)
    head = f"{indent}func {fmt_symbol(fn.name)}({args}) -> ({rets})"
    if fn.attrs:
        head += " " + fmt_attrs(fn.attrs)
    lines = [head + " {"]
    for op in fn.ops:
        lines.append(f"{indent}  {print_op(op)}")
    lines.append(f"{indent}  return " + ", ".join(f"%{v.name}" for v in fn.returns))
    lines.append(indent + "}")
    return "\n".join(lines)


def print_module(m: Module) -> str:
    head = f"module {fmt_symbol(m.name)}"
    if m.attrs:
        head += " " + fmt_attrs(m.attrs)
    lines = [head + " {"]
    for p in m.params.values():
        s = f"  param {fmt_symbol(p.name)}: {p.type}"
        if p.attrs:
            s += " " + fmt_attrs(p.attrs)
        lines.append(s)
    for fn in m.functions.values():
        lines.append(print_function(fn))
    lines.append("}")
    return "\n".join(lines) + "\n"
