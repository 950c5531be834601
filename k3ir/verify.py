"""Verifier: SSA order, operand/result types against each op's type rule, attributes (declared
names and types, finite floats), parameter reads against their declarations. Errors start with
``file:line:col`` when the op was parsed from a file (``Operation.loc``)."""
from __future__ import annotations

import math
import numbers
import re
from typing import Any

from .errors import K3VerifyError
from .ir import Function, Module, Operation
from .opdef import Attr, Op, get_opdef
from .types import TensorType

#: Annotations any op may carry besides its declared attributes (name -> expected type). They
#: do not change an op's semantics; passes, accounting and backends read them.
#: ``layer``: the decoder layer an op belongs to (set by the Builder on model/fused ops and by
#: passes that rewrite them: fuse_kda_chunks, fuse_attn_res).
ANNOTATIONS: dict[str, type] = {"layer": int}

#: Attributes a parameter declaration may carry (name -> type). ``stack``: the leading axis whose
#: slices are separate checkpoint tensors (``{stack}`` in the name); the rest are set by
#: ``quantize-experts`` (``quant``: the packed format, ``source``: the float parameter it packs,
#: ``scale`` / ``role="scale"``: its scale tensor, ``source_dtype``: the float dtype it had) and by
#: ``shard`` (``shard={ep=0, tp=1}``: mesh axis -> the dim cut into equal blocks over it; the type is one rank's).
PARAM_ATTRS: dict[str, type] = {"stack": str, "quant": str, "source": str, "scale": str, "source_dtype": str,
                                "role": str, "shard": dict}


def _where(fn: Function | None, op: Operation) -> str:
    layer = op.attrs.get("layer")
    res = ", ".join("%" + r.name for r in op.results[:4]) + (f", ... ({len(op.results)} results)"
                                                             if len(op.results) > 4 else "")
    head = f"@{fn.name}: {res} = {op.name}" if fn is not None else op.name
    loc = f"{op.loc}: " if getattr(op, "loc", None) is not None else ""
    return loc + head + (f" (layer {layer})" if layer is not None else "")


def _type_ok(v: Any, t: Any) -> bool:
    if t is object:
        return True
    if t is bool:
        return isinstance(v, bool)
    if t is int:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)
    if t is float:
        return isinstance(v, numbers.Real) and not isinstance(v, bool)
    if t is list:
        return isinstance(v, (list, tuple))
    return isinstance(v, t)


def _nonfinite(v: Any) -> bool:
    if isinstance(v, float):
        return not math.isfinite(v)
    if isinstance(v, (list, tuple)):
        return any(_nonfinite(x) for x in v)
    if isinstance(v, dict):
        return any(_nonfinite(x) for x in v.values())
    return False


def _check_attrs(op: Operation, cls: type[Op], where: str) -> None:
    """Every attribute is declared by the op (or an ANNOTATION; ``name`` on k3.param), has the
    declared type, and float values are finite unless the declaration allows otherwise."""
    declared: dict[str, Attr] = cls._attrs
    for k, v in op.attrs.items():
        spec = declared.get(k)
        if spec is not None:
            want, finite = spec.type, spec.finite
            if v is None and spec.default is None:
                continue
        elif k in ANNOTATIONS:
            want, finite = ANNOTATIONS[k], True
        elif op.name == "k3.param" and k == "name":
            want, finite = str, True
        else:
            known = sorted(declared) + sorted(ANNOTATIONS)
            raise K3VerifyError(f"{where}: unknown attribute '{k}' (known: {', '.join(known)})")
        if not _type_ok(v, want):
            raise K3VerifyError(f"{where}: attribute {k}={v!r} must be {getattr(want, '__name__', want)}, "
                                f"got {type(v).__name__}")
        if finite and _nonfinite(v):
            raise K3VerifyError(f"{where}: attribute {k}={v!r} must be finite")
        if (k == "eps" or k.endswith("_eps")) and isinstance(v, numbers.Real) and not v > 0:
            raise K3VerifyError(f"{where}: {k} must be > 0, got {v!r}")


def verify_op(op: Operation, fn: Function | None = None, module: Module | None = None) -> None:
    """Check one op's attributes and types (``fn``/``module`` add context and parameter checks).
    Raises K3VerifyError naming the location, function, results, op and layer."""
    where = _where(fn, op)
    if op.name == "k3.param":
        _check_attrs(op, get_opdef(op.name), where)
        name = op.attrs.get("name")
        if module is not None:
            decl = module.params.get(name)
            if decl is None:
                raise K3VerifyError(f"{where}: reads undeclared parameter {name!r}")
            if len(op.results) != 1:
                raise K3VerifyError(f"{where}: k3.param has {len(op.results)} results, the op defines 1")
            if op.results[0].type != decl.type:
                raise K3VerifyError(f"{where}: parameter {name!r} is {decl.type}, "
                                    f"result typed {op.results[0].type}")
        return
    cls = get_opdef(op.name)
    _check_attrs(op, cls, where)
    for k, spec in cls._attrs.items():
        if k in op.attrs and spec.choices is not None and op.attrs[k] not in spec.choices:
            raise K3VerifyError(f"{where}: attribute {k}={op.attrs[k]!r} not in {list(spec.choices)}")
    try:
        inst = cls(op.attrs, [v.type for v in op.operands])
        grouped = cls.group_operands([v.type for v in op.operands])
        types = inst.infer(*cls.ordered(grouped))
        inst.verify()
    except K3VerifyError as e:
        raise K3VerifyError(f"{where}: {e}") from None
    except (TypeError, ValueError, IndexError, KeyError, ZeroDivisionError, AttributeError,
            OverflowError) as e:   # odd values past the type check
        raise K3VerifyError(f"{where}: invalid attributes or operands: {e}") from None
    if len(types) != len(op.results):
        raise K3VerifyError(f"{where}: {len(op.results)} results, the op defines {len(types)}")
    for r, t in zip(op.results, types):
        if not _same_type(r.type, t):
            raise K3VerifyError(f"{where}: result %{r.name} typed {r.type}, the op's rule gives {t}")


def _same_type(a, b) -> bool:
    if isinstance(a, TensorType) and isinstance(b, TensorType):
        return a.dtype == b.dtype and len(a.shape) == len(b.shape) and all(
            str(x) == str(y) for x, y in zip(a.shape, b.shape))
    return a == b


def verify_function(fn: Function, module: Module | None = None) -> None:
    defined = {id(a) for a in fn.args}
    for op in fn.ops:
        for v in op.operands:
            if id(v) not in defined:
                raise K3VerifyError(f"{_where(fn, op)}: operand %{v.name} is used before it is defined")
        verify_op(op, fn, module)
        defined.update(id(r) for r in op.results)
    for v in fn.returns:
        if id(v) not in defined:
            raise K3VerifyError(f"@{fn.name}: returns undefined value %{v.name}")


def verify_params(m: Module) -> None:
    """Each parameter declaration's attributes are PARAM_ATTRS of their types; a ``stack`` axis is named in
    the parameter's name (``{e}``) and is its first dimension, a fixed integer. Raises K3VerifyError
    starting with ``file:line:col`` of the declaration when it was parsed from text."""
    for name, decl in m.params.items():
        loc = getattr(decl, "loc", None)
        where = f"{loc}: " if loc is not None else ""
        where += f"parameter {name!r}"
        for k, v in decl.attrs.items():
            want = PARAM_ATTRS.get(k)
            if want is None:
                raise K3VerifyError(f"{where}: unknown attribute '{k}' (known: {', '.join(sorted(PARAM_ATTRS))})")
            if not isinstance(v, want):
                raise K3VerifyError(f"{where}: attribute {k}={_short(v)} must be {want.__name__}, "
                                    f"got {type(v).__name__}")
        for axis, dim in decl.attrs.get("shard", {}).items():
            if axis not in ("ep", "cp", "tp", "dp") or not isinstance(dim, int) or not 0 <= dim < decl.type.rank:
                raise K3VerifyError(f"{where}: shard={_short(decl.attrs['shard'])} must map mesh axes (ep, cp, tp, "
                                    f"dp) to dims 0..{decl.type.rank - 1}")
        stack = decl.attrs.get("stack")
        if stack is not None:
            if "{" + stack + "}" not in name:
                raise K3VerifyError(f"{where}: stack={stack!r} needs '{{{stack}}}' in the name")
            first = decl.type.shape[0] if decl.type.rank else None
            if not isinstance(first, int):
                raise K3VerifyError(f"{where}: a stacked parameter needs a fixed first dimension, got "
                                    f"{'no dimension' if first is None else first}")


def _short(v: Any, n: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def verify_module(m: Module) -> None:
    """Raise K3VerifyError naming the function, op and layer of the first broken invariant."""
    verify_params(m)
    for fn in m.functions.values():
        verify_function(fn, m)
    for fn in m.functions.values():
        for op in fn.ops:
            body = op.attrs.get("body")
            if body is not None and body not in m.functions:
                raise K3VerifyError(f"{_where(fn, op)}: body function @{body} is not defined")
    _check_module_attr_types(m)
    _check_layer_attrs(m)
    _check_model_attrs(m)


def _module_where(m: Module) -> str:
    loc = getattr(m, "loc", None)
    return f"{loc}: " if loc is not None else ""


#: most layers a module may declare (``num_hidden_layers``; accounting and passes loop over them). The config
#: reader allows up to 1,024 (frontend/config_bounds.py); text IR gets more room.
MAX_MODULE_LAYERS = 65536
_STR_ATTRS = ("model_type", "dtype", "key_prefix", "expert_quant", "kda_gate")


def _check_module_attr_types(m: Module) -> None:
    """Module attributes the runtime reads have their types (others are free-form): ``num_hidden_layers`` an
    int in 1..MAX_MODULE_LAYERS, ``hidden_size`` a positive int, ``bos_token_id`` / ``pad_token_id`` an int
    >= 0 or null, ``eos_token_id`` one or a non-empty list of them (all below ``vocab_size``),
    ``attn_res_block_size`` an int >= 0 or null, _STR_ATTRS strings, ``quant_ignore`` a list of strings
    (``re:`` patterns must compile), ``vision`` an object, ``mesh`` an object of positive ints. Raises
    K3VerifyError naming the attribute (after the module's ``file:line:col`` when parsed from text)."""
    where, a = _module_where(m), m.attrs

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def fail(key: str, want: str) -> None:
        raise K3VerifyError(f"{where}module attribute {key}={_short(a[key])} must be {want}")
    if "num_hidden_layers" in a and not (is_int(n := a["num_hidden_layers"]) and 1 <= n <= MAX_MODULE_LAYERS):
        fail("num_hidden_layers", f"an int in 1..{MAX_MODULE_LAYERS}")
    if "hidden_size" in a and not (is_int(a["hidden_size"]) and a["hidden_size"] > 0):
        fail("hidden_size", "a positive int")
    if "attn_res_block_size" in a and not (a["attn_res_block_size"] is None or is_int(a["attn_res_block_size"])
                                           and a["attn_res_block_size"] >= 0):
        fail("attn_res_block_size", "an int >= 0 or null")
    vocab = a.get("vocab_size") if is_int(a.get("vocab_size")) else None
    for key in ("bos_token_id", "pad_token_id", "eos_token_id"):
        v = a.get(key)
        ids = v if key == "eos_token_id" and isinstance(v, list) and v else [v]
        if v is not None and not all(is_int(i) and 0 <= i < (vocab or 2 ** 63) for i in ids):
            fail(key, f"a token id in 0..{vocab - 1 if vocab else 'vocab_size-1'}"
                      + (" (or a non-empty list of them)" if key == "eos_token_id" else "") + " or null")
    for key in _STR_ATTRS:
        if key in a and not isinstance(a[key], str):
            fail(key, "a string")
    qi = a.get("quant_ignore")
    if qi is not None:
        if not isinstance(qi, list) or not all(isinstance(p, str) for p in qi):
            fail("quant_ignore", "a list of strings")
        for p in qi:
            try:
                re.compile(p[3:]) if p.startswith("re:") else None
            except re.error as e:
                raise K3VerifyError(f"{where}module attribute quant_ignore: pattern {_short(p)} does not compile: "
                                    f"{e}") from None
    if "vision" in a and not isinstance(a["vision"], dict):
        fail("vision", "an object")
    mesh = a.get("mesh")
    if mesh is not None and not (isinstance(mesh, dict) and all(is_int(v) and v > 0 for v in mesh.values())):
        fail("mesh", "an object of positive ints (mesh axis -> size)")


def _check_model_attrs(m: Module) -> None:
    """The module attributes ``vocab_size`` (the rows of every ``k3.embedding`` / ``k3.lm_head`` weight),
    ``num_experts`` (the rows of every ``k3.router`` weight) and ``top_k`` (every router's ``top_k``)
    are positive ints that agree with the body where the body has such ops. Raises K3VerifyError
    naming the attribute (and the op that disagrees)."""
    where = _module_where(m)
    for key in ("vocab_size", "num_experts", "top_k"):
        v = m.attrs.get(key)
        if v is None:
            continue
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v <= 0:
            raise K3VerifyError(f"{where}module attribute {key}={v!r} must be a positive int")
    vocab, n_exp, top_k = (m.attrs.get(k) for k in ("vocab_size", "num_experts", "top_k"))
    if top_k is not None and n_exp is not None and top_k > n_exp:
        raise K3VerifyError(f"{where}module attribute top_k={top_k} exceeds num_experts={n_exp}")
    mesh = m.attrs.get("mesh")
    tp = mesh.get("tp", 1) if isinstance(mesh, dict) else 1     # a sharded module's lm_head holds vocab/tp rows
    for fn in m.functions.values():
        for op in fn.ops:
            if op.name in ("k3.embedding", "k3.lm_head") and vocab is not None and len(op.operands) > 1:
                rows = _rows(op.operands[1].type)
                if rows is not None and rows * (tp if op.name == "k3.lm_head" else 1) != vocab:
                    raise K3VerifyError(f"{_where(fn, op)}: weight has {rows} rows but module attribute "
                                        f"vocab_size={vocab}")
            elif op.name == "k3.router" and len(op.operands) > 1:
                rows = _rows(op.operands[1].type)
                if n_exp is not None and rows is not None and rows != n_exp:
                    raise K3VerifyError(f"{_where(fn, op)}: router weight has {rows} experts but module "
                                        f"attribute num_experts={n_exp}")
                k = op.attrs.get("top_k")
                if top_k is not None and k is not None and k != top_k:
                    raise K3VerifyError(f"{_where(fn, op)}: top_k={k} but module attribute top_k={top_k}")


def _rows(t) -> int | None:
    if isinstance(t, TensorType) and t.rank >= 1:
        try:
            return int(str(t.shape[0]))
        except ValueError:
            return None
    return None


#: module attribute -> the ops that make a decoder layer one of that kind
LAYER_KINDS: dict[str, tuple[str, ...]] = {"kda_layers": ("k3.kda", "k3.fused_kda", "k3.fused_kda_ungated"),
                                          "mla_layers": ("k3.mla", "k3.mla_kv_norm")}
_KIND_WORDS = {"kda_layers": "a KDA", "mla_layers": "an MLA"}


def _check_layer_attrs(m: Module) -> None:
    """The module attributes ``kda_layers`` / ``mla_layers`` (0-based layer lists, when present) agree
    with the body (every op of LAYER_KINDS that carries a ``layer`` annotation is listed under its
    kind), are lists of distinct layers in ``0..num_hidden_layers-1``, do not overlap and together
    cover every layer. Raises K3VerifyError naming the attribute and the layer (after
    ``file:line:col`` of the module's attributes when the module was parsed from a file)."""
    lists = {key: list(v) for key in LAYER_KINDS if isinstance(v := m.attrs.get(key), (list, tuple))}
    listed = {key: {i for i in v if isinstance(i, int)} for key, v in lists.items()}     # membership in O(1)
    n_layers = m.attrs.get("num_hidden_layers")
    n_layers = n_layers if isinstance(n_layers, int) and not isinstance(n_layers, bool) and n_layers > 0 else None
    for fn in m.functions.values():
        for op in fn.ops:
            layer = op.attrs.get("layer")
            if layer is not None and n_layers is not None and not 0 <= layer < n_layers \
                    and fn.attrs.get("kind") != "vision":       # the vision tower numbers its own layers
                raise K3VerifyError(f"{_where(fn, op)}: layer={layer} is out of range 0..{n_layers - 1} "
                                    f"(module attribute num_hidden_layers={n_layers})")
            for key, names in LAYER_KINDS.items():
                if layer is not None and key in lists and op.name in names and layer not in listed[key]:
                    raise K3VerifyError(f"{_where(fn, op)}: layer {layer} is {_KIND_WORDS[key]} layer "
                                        f"in the body but module attribute {key}={lists[key]} does not list it")
    loc = getattr(m, "loc", None)
    where = f"{loc}: " if loc is not None else ""
    n = m.attrs.get("num_hidden_layers")
    n = n if isinstance(n, int) and not isinstance(n, bool) else None
    for key in LAYER_KINDS:
        v = m.attrs.get(key)
        if v is None:
            continue
        if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
            raise K3VerifyError(f"{where}module attribute {key}={v!r} must be a list of layer indices (0-based)")
        seen: set[int] = set()
        for i in v:
            if n is not None and not 0 <= i < n:
                raise K3VerifyError(f"{where}module attribute {key}={_short(list(v))}: layer {i} is out of range "
                                    f"0..{n - 1} (num_hidden_layers={n})")
            if i in seen:
                raise K3VerifyError(f"{where}module attribute {key}={_short(list(v))}: layer {i} is listed twice")
            seen.add(i)
    if len(lists) == 2:
        kda, mla = lists["kda_layers"], lists["mla_layers"]
        both = sorted(set(kda) & set(mla))
        if both:
            raise K3VerifyError(f"{where}module attributes kda_layers={_short(kda)} and mla_layers={_short(mla)} "
                                f"both list layer {both[0]}")
        covered = set(kda) | set(mla)          # distinct, in 0..n-1: the first gap is found within len+1 steps
        missing = next((i for i in range(n or 0) if i not in covered), None)
        if missing is not None:
            raise K3VerifyError(f"{where}module attributes kda_layers={_short(kda)} and mla_layers={_short(mla)} "
                                f"leave out layer {missing} (num_hidden_layers={n})")
