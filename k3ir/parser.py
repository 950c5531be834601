"""Parser for the text IR (see printer.py). Errors carry 1-based line and column.

The text may come from anywhere (a file a user was sent), so the parser bounds what it builds
before building it: literal lists/dicts nest at most ``MAX_NESTING`` deep, an integer literal is
a signed 64-bit value (its digits are counted before ``int()`` runs), a dimension expression has
at most ``MAX_DIM_CHARS`` characters and ``MAX_DIM_PARENS`` levels of parentheses, and a string
must be valid JSON without lone surrogates (it is printed back as UTF-8). Every violation is a
K3ParseError at the offending token."""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from .errors import K3Error, K3ParseError, K3VerifyError
from .ir import Function, Loc, Module, Operation, Value
from .opdef import get_opdef
from .types import DTYPE_BYTES, StateType, TensorType, Type

_TOKEN = re.compile(r"""
    (?P<ws>[ \t\r]+|//[^\n]*)
  | (?P<nl>\n)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<value>%[A-Za-z0-9_.]+)
  | (?P<symbol>@(?:[A-Za-z_][A-Za-z0-9_.]*|"(?:[^"\\]|\\.)*"))
  | (?P<state>![a-z_]+)
  | (?P<arrow>->)
  | (?P<number>-?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d+|inf|nan)(?![A-Za-z0-9_]))
  | (?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<punct>[{}()\[\],:=<>+*-])
""", re.VERBOSE)


_DIM_PUNCT = frozenset("()+-*")

#: deepest nesting of list / dict literals in an attribute value (the printed IR uses 2)
MAX_NESTING = 64
#: longest dimension expression (characters) and deepest parentheses in one
MAX_DIM_CHARS = 255
MAX_DIM_PARENS = 16
#: integer literals are signed 64-bit (what every backend stores)
INT_MIN, INT_MAX = -(2 ** 63), 2 ** 63 - 1
_INT_DIGITS = len(str(INT_MAX))
_INT_TEXT = re.compile(r"-?\d+")


def _dim_expr_ok(s: str) -> bool:
    """``s`` is an integer, a name, or a ``+ - *`` expression of them (``types.eval_dim`` evaluates it)."""
    try:
        tree = ast.parse(s, mode="eval")
    except SyntaxError:
        return False
    ok = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Add, ast.Sub, ast.Mult, ast.USub, ast.UAdd, ast.Name,
          ast.Load, ast.Constant)
    return all(isinstance(n, ok) and (not isinstance(n, ast.Constant) or type(n.value) is int)
               for n in ast.walk(tree))


class _Tok:
    __slots__ = ("col", "kind", "line", "text")

    def __init__(self, kind, text, line, col):
        self.kind, self.text, self.line, self.col = kind, text, line, col


def _tokenize(src: str, source: str | None) -> list[_Tok]:
    toks: list[_Tok] = []
    pos, line, line_start = 0, 1, 0
    n = len(src)
    while pos < n:
        m = _TOKEN.match(src, pos)
        if not m:
            raise K3ParseError(f"unexpected character {src[pos]!r}", line, pos - line_start + 1, source)
        kind = m.lastgroup
        if kind == "nl":
            line += 1
            line_start = m.end()
        elif kind != "ws":
            toks.append(_Tok(kind, m.group(), line, pos - line_start + 1))
        pos = m.end()
    toks.append(_Tok("eof", "", line, pos - line_start + 1))
    return toks


class _Parser:
    def __init__(self, src: str, source: str | None):
        self.toks = _tokenize(src, source)
        self.i = 0
        self.source = source
        self.depth = 0                       # list / dict literals open around the current token

    # ---- token helpers --------------------------------------------------------------
    @property
    def tok(self) -> _Tok:
        return self.toks[self.i]

    def error(self, msg: str, tok: _Tok | None = None) -> K3ParseError:
        t = tok or self.tok
        return K3ParseError(msg, t.line, t.col, self.source)

    def next(self) -> _Tok:
        t = self.toks[self.i]
        self.i += 1
        return t

    def expect(self, text: str) -> _Tok:
        if self.tok.text != text:
            got = self.tok.text or "end of input"
            raise self.error(f"expected '{text}', got '{got}'")
        return self.next()

    def accept(self, text: str) -> bool:
        if self.tok.text == text:
            self.i += 1
            return True
        return False

    def expect_kind(self, kind: str, what: str) -> _Tok:
        if self.tok.kind != kind:
            raise self.error(f"expected {what}, got '{self.tok.text or 'end of input'}'")
        return self.next()

    def symbol(self) -> str:
        t = self.expect_kind("symbol", "a symbol (@name)")
        s = t.text[1:]
        return self.string(t, 1) if s.startswith('"') else s

    def string(self, t: _Tok, offset: int = 0) -> str:
        """The JSON string at ``t.text[offset:]``; K3ParseError at the offending character for an invalid
        escape or a raw control character, at the token for a lone surrogate (not printable as UTF-8)."""
        s = t.text[offset:]
        try:
            v = json.loads(s)
        except json.JSONDecodeError as e:
            nl = s.rfind("\n", 0, e.pos)
            line = t.line + s.count("\n", 0, e.pos)
            col = t.col + offset + e.pos if nl < 0 else e.pos - nl
            raise K3ParseError(f"invalid string literal: {e.msg}", line, col, self.source) from None
        bad = next((c for c in v if "\ud800" <= c <= "\udfff"), None)
        if bad is not None:
            raise self.error(f"invalid string literal: lone surrogate \\u{ord(bad):04x} (strings are UTF-8)", t)
        return v

    def integer(self, t: _Tok) -> int:
        """The value of an integer token, a signed 64-bit int (digits counted before converting)."""
        digits = len(t.text.lstrip("-"))
        v = int(t.text) if digits <= _INT_DIGITS else None
        if v is None or not INT_MIN <= v <= INT_MAX:
            what = t.text if digits <= 30 else f"of {digits} digits"
            raise self.error(f"integer literal {what} is out of the 64-bit range", t)
        return v

    # ---- literals ----------------------------------------------------------------------
    def literal(self) -> Any:
        t = self.tok
        if t.kind == "string":
            self.next()
            return self.string(t)
        if t.kind == "number":
            self.next()
            txt = t.text
            if txt in ("inf", "-inf", "nan") or any(c in txt for c in ".eE"):
                return float(txt)
            return self.integer(t)
        if t.text == "-" and self.toks[self.i + 1].text == "inf":
            self.i += 2
            return float("-inf")
        if t.kind == "ident" and t.text in ("true", "false", "null"):
            self.next()
            return {"true": True, "false": False, "null": None}[t.text]
        if t.text == "[":
            self.enter()
            self.next()
            items = []
            if not self.accept("]"):
                items.append(self.literal())
                while self.accept(","):
                    items.append(self.literal())
                self.expect("]")
            self.depth -= 1
            return items
        if t.text == "{":
            self.enter()
            out = self.attrs()
            self.depth -= 1
            return out
        raise self.error(f"expected a literal, got '{t.text or 'end of input'}'")

    def enter(self) -> None:
        """One more list / dict literal opens at the current token (K3ParseError past MAX_NESTING)."""
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise self.error(f"list / dict literals nested more than {MAX_NESTING} deep")

    def attrs(self, where: dict[str, _Tok] | None = None) -> dict[str, Any]:
        """``{name=literal, ...}``; ``where``, when given, receives each value's first token."""
        self.expect("{")
        out: dict[str, Any] = {}
        if self.accept("}"):
            return out
        while True:
            key = self.expect_kind("ident", "an attribute name")
            if key.text in out:
                raise self.error(f"attribute '{key.text}' given twice", key)
            self.expect("=")
            if where is not None:
                where[key.text] = self.tok
            out[key.text] = self.literal()
            if self.accept("}"):
                return out
            self.expect(",")

    # ---- types ---------------------------------------------------------------------------
    def dim(self) -> int | str:
        """One dimension: an integer, a name or a ``+ - *`` expression of them with parentheses
        (``B``, ``L+T``, ``(L+T)*2``). Anything else is a K3ParseError at the offending token."""
        parts = []
        depth = 0
        first = self.tok
        chars = 0
        while True:
            t = self.tok
            if t.text in (",", "]") and depth == 0:
                break
            if t.text == "]" and depth > 0:
                raise self.error("unclosed '(' in a dimension")
            if t.kind not in ("number", "ident") and t.text not in _DIM_PUNCT:
                raise self.error(f"bad dimension token '{t.text or 'end of input'}'")
            if t.kind == "number" and not _INT_TEXT.fullmatch(t.text):
                raise self.error(f"bad dimension '{t.text}' (a dimension is a non-negative integer, a name or "
                                 "a + - * expression of them)")
            if t.kind == "number":
                self.integer(t)
            chars += len(t.text)
            if chars > MAX_DIM_CHARS:
                raise self.error(f"dimension expression of more than {MAX_DIM_CHARS} characters", first)
            if t.text == "(":
                depth += 1
                if depth > MAX_DIM_PARENS:
                    raise self.error(f"parentheses in a dimension nested more than {MAX_DIM_PARENS} deep")
            elif t.text == ")":
                depth -= 1
                if depth < 0:
                    raise self.error("unbalanced ')' in a dimension")
            parts.append(t.text)
            self.next()
        if not parts:
            raise self.error("empty dimension")
        s = "".join(parts)
        if re.fullmatch(r"-\d+", s):
            raise self.error(f"negative dimension {s}", first)
        if not _dim_expr_ok(s):
            raise self.error(f"bad dimension '{s}' (a dimension is a non-negative integer, a name or "
                             "a + - * expression of them)", first)
        return int(s) if re.fullmatch(r"\d+", s) else s

    def state_param(self) -> int:
        t = self.expect_kind("number", "an integer")
        if not _INT_TEXT.fullmatch(t.text):
            raise self.error(f"expected an integer, got '{t.text}'", t)
        return self.integer(t)

    def type(self) -> Type:
        t = self.tok
        if t.kind == "state":
            self.next()
            self.expect("<")
            params = [self.state_param()]
            while self.accept(","):
                params.append(self.state_param())
            self.expect(">")
            try:
                return StateType(t.text[1:], tuple(params))
            except ValueError as e:
                raise self.error(str(e), t) from None
        dt = self.expect_kind("ident", "a type")
        if dt.text not in DTYPE_BYTES:
            raise self.error(f"unknown dtype '{dt.text}'", dt)
        self.expect("[")
        shape: list[int | str] = []
        if not self.accept("]"):
            shape.append(self.dim())
            while self.accept(","):
                shape.append(self.dim())
            self.expect("]")
        return TensorType(dt.text, tuple(shape))

    # ---- structure --------------------------------------------------------------------------
    def module(self) -> Module:
        self.expect("module")
        m = Module(self.symbol())
        if self.tok.text == "{" and self._looks_like_attrs():
            m.loc = Loc(self.tok.line, self.tok.col, self.source)
            m.attrs = self.attrs()
        self.expect("{")
        while not self.accept("}"):
            if self.tok.text == "param":
                kw = self.next()
                name_tok = self.tok
                name = self.symbol()
                self.expect(":")
                ty = self.type()
                attrs = self.attrs() if self.tok.text == "{" else {}
                if name in m.params:
                    raise self.error(f"parameter '{name}' declared twice", name_tok)
                if not isinstance(ty, TensorType):
                    raise self.error("a parameter must have a tensor type", name_tok)
                m.add_param(name, ty, **attrs).loc = Loc(kw.line, kw.col, self.source)
            elif self.tok.text == "func":
                fn = self.function(m)
                m.add_function(fn)
            else:
                raise self.error(f"expected 'param', 'func' or '}}', got '{self.tok.text or 'end of input'}'")
        if self.tok.kind != "eof":
            raise self.error(f"unexpected '{self.tok.text}' after the module")
        return m

    def _looks_like_attrs(self) -> bool:
        """At a '{': an attribute dict (``{}`` followed by the body's '{', or ``{name=``), not the body
        (an empty module body ``{ }`` is a body)."""
        nxt = self.toks[self.i + 1]
        if nxt.text == "}":
            return self.toks[self.i + 2].text == "{"
        return nxt.kind == "ident" and self.toks[self.i + 2].text == "="

    def function(self, m: Module) -> Function:
        self.expect("func")
        name_tok = self.tok
        name = self.symbol()
        if name in m.functions:
            raise self.error(f"function '{name}' defined twice", name_tok)
        fn = Function(name)
        env: dict[str, Value] = {}
        self.expect("(")
        if not self.accept(")"):
            while True:
                vt = self.expect_kind("value", "an argument (%name)")
                self.expect(":")
                v = Value(vt.text[1:], self.type())
                if v.name in env:
                    raise self.error(f"value '%{v.name}' defined twice", vt)
                env[v.name] = v
                fn.args.append(v)
                if self.accept(")"):
                    break
                self.expect(",")
        self.expect("->")
        self.expect("(")
        ret_types: list[Type] = []
        if not self.accept(")"):
            ret_types.append(self.type())
            while self.accept(","):
                ret_types.append(self.type())
            self.expect(")")
        if self.tok.text == "{" and self._looks_like_attrs():
            fn.attrs = self.attrs()
        self.expect("{")
        while True:
            if self.tok.text == "return":
                rt = self.next()
                rets = []
                if self.tok.kind == "value":
                    rets.append(self.use(env))
                    while self.accept(","):
                        rets.append(self.use(env))
                if [str(v.type) for v in rets] != [str(t) for t in ret_types]:
                    raise self.error("returned types " + ", ".join(str(v.type) for v in rets) +
                                     " do not match the signature " +
                                     ", ".join(str(t) for t in ret_types), rt)
                fn.returns = rets
                self.expect("}")
                return fn
            fn.ops.append(self.operation(env, m))

    def use(self, env: dict[str, Value]) -> Value:
        t = self.expect_kind("value", "a value (%name)")
        try:
            return env[t.text[1:]]
        except KeyError:
            raise self.error(f"use of undefined value '{t.text}'", t) from None

    def operation(self, env: dict[str, Value], m: Module) -> Operation:
        start = self.tok
        results: list[Value] = []
        names: set[str] = set()
        if self.tok.kind == "value":
            while True:
                vt = self.expect_kind("value", "a result (%name)")
                self.expect(":")
                v = Value(vt.text[1:], self.type())
                if v.name in env or v.name in names:
                    raise self.error(f"value '%{v.name}' defined twice", vt)
                results.append(v)
                names.add(v.name)
                if not self.accept(","):
                    break
            self.expect("=")
        name_tok = self.expect_kind("ident", "an op name")
        try:
            get_opdef(name_tok.text)
        except K3VerifyError:
            raise self.error(f"unknown op '{name_tok.text}'", name_tok) from None
        self.expect("(")
        operands: list[Value] = []
        if not self.accept(")"):
            operands.append(self.use(env))
            while self.accept(","):
                operands.append(self.use(env))
            self.expect(")")
        where: dict[str, _Tok] = {}
        attrs = self.attrs(where) if self.tok.text == "{" and self.tok.line == name_tok.line else {}
        if name_tok.text == "k3.param":
            pname = attrs.get("name")
            if pname is None:
                raise self.error("k3.param has no name attribute (the parameter it reads)", start)
            if not isinstance(pname, str):
                raise self.error(f"k3.param's name must be a string, got {type(pname).__name__} "
                                 f"{_short(pname)}", where["name"])
            if pname not in m.params:
                raise self.error(f"k3.param reads undeclared parameter {pname!r}", start)
        for r in results:
            env[r.name] = r
        return Operation(name_tok.text, operands, results, attrs, loc=Loc(start.line, start.col, self.source))


def _short(v: Any, n: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def parse_module(text: str, source: str | None = None) -> Module:
    """Parse the text IR into a Module. Raises K3ParseError with line and column."""
    return _Parser(text, source).module()


def parse_file(path: str) -> Module:
    """Parse a text-IR file. Each op records its ``Loc`` (file, line, column) for verifier errors.
    Raises K3Error when the file cannot be read (missing, a directory, no permission) and
    K3ParseError (with line and column) when it is not valid UTF-8 or not valid text IR."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise K3Error(f"{path}: cannot read the IR file: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = len(data[data.rfind(b"\n", 0, e.start) + 1:e.start].decode("utf-8")) + 1   # valid before e.start
        raise K3ParseError(f"invalid UTF-8 (byte 0x{data[e.start]:02x}): {e.reason}", line, col, str(path)) from None
    return parse_module(text, source=str(path))
