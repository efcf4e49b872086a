"""Text -> AST. The Lark transformer only builds dataclasses; every semantic check is in check.py."""
from __future__ import annotations

import re

from lark import Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from . import ast
from ..errors import Diagnostic, Span, SpecError, did_you_mean
from .expr import LIMIT, MAX_DEPTH
from .grammar import parser
from .limits import MAX_SPEC_CHARS, MAX_SPEC_TOKENS, TOKENS_PER_PARAM, check_size, count_tokens, token_budget  # noqa: F401

KEYWORDS = ("dims", "from", "let", "mesh", "ignore", "state", "for", "split", "over", "uneven", "shared",
            "replicate", "view", "as", "concat", "pad", "to", "multiple_of", "on", "first", "last",
            "index", "of", "virtual", "sizes", "keep", "optional", "if", "dtype", "scalar", "follow", "flat",
            "per_param", "reverse", "align", "bucket")

_READABLE = {
    "PATTERN": "a parameter pattern", "NAME": "a name", "INT": "an integer",
    "DIMREF": "a dimension (0, 0.1, 0.q)", "_NL": "end of line", "$END": "end of file",
    "SPLIT_MODE": "uneven or shared",
}


def _span_of(meta_or_tok) -> Span:
    if isinstance(meta_or_tok, Token):
        return Span(meta_or_tok.line, meta_or_tok.column, meta_or_tok.end_line, meta_or_tok.end_column)
    m = meta_or_tok
    if getattr(m, "empty", False):
        return Span(1, 1, 1, 1)
    return Span(m.line, m.column, m.end_line, m.end_column)


def _ident(tok: Token) -> ast.Ident:
    return ast.Ident(str(tok), _span_of(tok))


_MAX_DIGITS = 30  # an integer literal longer than this is beyond the 2**62 limit anyway


def _dimref(tok: Token) -> ast.DimRef:
    # a huge index stays a (huge) number that names no dim, without converting thousands of digits
    path = tuple((int(p) if len(p) <= _MAX_DIGITS else 10 ** _MAX_DIGITS) if p.isdigit() else p
                 for p in str(tok).split("."))
    return ast.DimRef(path, _span_of(tok))


class _ToAst:
    """One method per grammar rule: (meta, converted children) -> AST node. Called by
    :func:`_convert`, which walks the parse tree without recursion."""

    def __init__(self):
        self.diagnostics: list[Diagnostic] = []

    # expressions
    def int(self, meta, c):
        text = str(c[0])
        value = int(text) if len(text) <= _MAX_DIGITS else LIMIT + 1
        if value > LIMIT:
            shown = text if len(text) <= 40 else f"{text[:20]}...{text[-10:]} ({len(text)} digits)"
            self.diagnostics.append(Diagnostic("UCL113", f"integer {shown} is too large (the limit is 2**62)",
                                               _span_of(c[0])))
            value = 0
        return ast.Int(value, _span_of(c[0]))

    def var(self, meta, c):
        return ast.Var(str(c[0]), _span_of(c[0]))

    def call(self, meta, c):
        return ast.Call(str(c[0]), tuple(c[1:]), _span_of(meta))


    # statements
    def start(self, meta, c):
        return list(c)

    def dims_decl(self, meta, c):
        return ast.DimsDecl(tuple(c), _span_of(meta))

    def dim_item(self, meta, c):
        return ast.DimItem(_ident(c[0]), tuple(str(t) for t in c[1:] if t is not None))

    def let_decl(self, meta, c):
        return ast.LetDecl(_ident(c[0]), c[1], _span_of(meta))

    def mesh_decl(self, meta, c):
        return ast.MeshDecl(tuple(_ident(t) for t in c), _span_of(meta))

    def ignore_decl(self, meta, c):
        return ast.IgnoreDecl(tuple(ast.Pattern(str(t), _span_of(t)) for t in c), _span_of(meta))

    def state_decl(self, meta, c):
        kinds = tuple(_ident(t) for t in c if isinstance(t, Token) and t.type == "NAME")
        rest = [x for x in c if not (isinstance(x, Token) and x.type == "NAME")]
        patterns = []
        while rest and (rest[0] is None or isinstance(rest[0], Token)):
            tok = rest.pop(0)
            if tok is not None:
                patterns.append(ast.Pattern(str(tok), _span_of(tok)))
        return ast.StateDecl(kinds, tuple(patterns), tuple(rest), _span_of(meta))

    def rule(self, meta, c):
        pattern = ast.Pattern(str(c[0]), _span_of(c[0]))
        return ast.Rule(pattern, c[1], tuple(c[2:]), _span_of(meta))

    def shape(self, meta, c):
        return tuple(x for x in c if x is not None)

    # transforms
    def axes(self, meta, c):
        return tuple(_ident(t) for t in c)

    def split(self, meta, c):
        return ast.Split(_dimref(c[0]), c[1], str(c[2]) if c[2] is not None else "even", _span_of(meta))

    def replicate(self, meta, c):
        return ast.Replicate(c[0] or (), _span_of(meta))

    def view(self, meta, c):
        return ast.View(_dimref(c[0]), tuple(c[1:]), _span_of(meta))

    def part(self, meta, c):
        return ast.Part(_ident(c[0]), c[1])

    def concat(self, meta, c):
        return ast.Concat(_dimref(c[0]), tuple(c[1:]), _span_of(meta))

    def pad(self, meta, c):
        multiple, target = c[1]
        return ast.Pad(_dimref(c[0]), target, multiple, _span_of(meta))

    def pad_exact(self, meta, c):
        return (False, c[0])

    def pad_multiple(self, meta, c):
        return (True, c[0])

    def coord_first(self, meta, c):
        return "first"

    def coord_last(self, meta, c):
        return "last"

    def coord_expr(self, meta, c):
        return c[0]

    def place(self, meta, c):
        return ast.Place(_ident(c[0]), tuple(c[1:]), _span_of(meta))

    def index(self, meta, c):
        capture, count, axis, *options = c
        opts = {"virtual": None, "sizes": None, "first": None, "last": None, "keep": False}
        for key, value in options:
            opts[key] = value
        return ast.Index(_ident(capture), count, _ident(axis), span=_span_of(meta), **opts)

    def index_virtual(self, meta, c):
        return ("virtual", c[0])

    def index_sizes(self, meta, c):
        return ("sizes", tuple(c))

    def index_first(self, meta, c):
        return ("first", c[0])

    def index_last(self, meta, c):
        return ("last", c[0])

    def index_keep(self, meta, c):
        return ("keep", True)

    def optional(self, meta, c):
        return ast.OptionalMark(c[0], _span_of(meta))

    # state transforms
    def dtype(self, meta, c):
        return ast.Dtype(_ident(c[0]), _span_of(meta))

    def scalar(self, meta, c):
        return ast.Scalar(_span_of(meta))

    def follow(self, meta, c):
        return ast.Follow(_span_of(meta))

    def flat(self, meta, c):
        opts = dict(per_param=False, reverse=False, align=None, pad_multiple=None, bucket=None)
        for key, value in c[1:]:
            opts[key] = value
        return ast.Flat(c[0], span=_span_of(meta), **opts)

    def flat_per_param(self, meta, c):
        return ("per_param", True)

    def flat_reverse(self, meta, c):
        return ("reverse", True)

    def flat_align(self, meta, c):
        return ("align", c[0])

    def flat_pad(self, meta, c):
        return ("pad_multiple", c[0])

    def flat_bucket(self, meta, c):
        return ("bucket", c[0])


# Left-associative operators, by precedence level: a chain of one level becomes one ast.Chain.
_CHAINS = ({"add": "+", "sub": "-"}, {"mul": "*", "div": "/", "floordiv": "//", "mod": "%"})
_EXPRESSIONS = (ast.Int, ast.Var, ast.Chain, ast.Neg, ast.Call)


class _Build:
    """A pending node of :func:`_convert`: made from the last ``n`` converted values."""

    __slots__ = ("n", "make")

    def __init__(self, n, make):
        self.n, self.make = n, make


def _convert(tree, to_ast: _ToAst):
    """The parse tree as an AST, walked with an explicit stack: a 200,000-term sum or 100,000
    minuses in a row are one level each (ast.Chain, ast.Neg), and no Python recursion follows the
    parse tree's depth. An expression nested deeper than MAX_DEPTH (parentheses, calls, mixed
    operators) is a diagnostic at the level where it crosses the limit, reported once."""
    values: list = []
    depths: list = []  # per value: its expression depth, or None once reported as too deep
    stack: list = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, _Build):
            args = values[len(values) - item.n:]
            inner = depths[len(depths) - item.n:]
            del values[len(values) - item.n:], depths[len(depths) - item.n:]
            node = item.make(args)
            depth = 0
            if isinstance(node, _EXPRESSIONS):
                depth = None if None in inner else 1 + max(inner, default=0)
                if depth is not None and depth > MAX_DEPTH:
                    to_ast.diagnostics.append(Diagnostic(
                        "UCL115", f"expression nested too deeply (more than {MAX_DEPTH} levels of parentheses, "
                        "calls and operators)", node.span, "name parts of it with `let`"))
                    depth = None
            values.append(node)
            depths.append(depth)
        elif isinstance(item, Tree):
            children, make = _plan(item, to_ast)
            stack.append(_Build(len(children), make))
            stack.extend(reversed(children))
        else:  # a token, or None for an absent optional part
            values.append(item)
            depths.append(0)
    return values[0]


def _plan(tree: Tree, to_ast: _ToAst):
    """(children to convert first, how to make the node from them) for one parse-tree node."""
    data = str(tree.data)
    meta = tree.meta
    for level in _CHAINS:
        if data in level:  # walk down the left spine: `a + b - c` is sub(add(a, b), c)
            steps, node = [], tree
            while isinstance(node, Tree) and str(node.data) in level:
                steps.append((level[str(node.data)], node.children[1], node.meta))
                node = node.children[0]
            steps.reverse()

            def make_chain(c, steps=steps, meta=meta):
                return ast.Chain(c[0], tuple(ast.Step(op, x, _span_of(m)) for (op, _, m), x in zip(steps, c[1:])),
                                 _span_of(meta))

            return [node] + [right for _, right, _ in steps], make_chain
    if data == "neg":
        count, node = 0, tree
        while isinstance(node, Tree) and str(node.data) == "neg":
            count, node = count + 1, node.children[0]
        return [node], lambda c: ast.Neg(c[0], _span_of(meta), count)
    method = getattr(to_ast, data)
    return list(tree.children), lambda c: method(meta, c)


def _describe_expected(expected) -> str:
    lalr = parser()
    words = []
    for name in sorted(expected):
        if name in _READABLE:
            words.append(_READABLE[name])
            continue
        try:
            term = lalr.get_terminal(name)
            pattern = term.pattern
            words.append(f"'{pattern.value}'" if pattern.type == "str" else name.lower())
        except KeyError:
            words.append(name.lower())
    words = sorted(set(words))
    if len(words) > 8:
        words = words[:8] + ["..."]
    return ", ".join(words)


def _expected(err: UnexpectedInput) -> set:
    """The tokens that could have come instead: exactly those the parser accepts in its state (the
    LALR table's error set can list tokens only a merged state allows), else what lark reports."""
    expected = set(getattr(err, "expected", None) or getattr(err, "allowed", None) or ())
    interactive = getattr(err, "interactive_parser", None)
    if interactive is not None:
        try:
            accepted = interactive.accepts()
        except Exception:  # pragma: no cover - a lark internals change: keep lark's own set
            return expected
        if accepted:
            return accepted
    return expected


def _syntax_diagnostic(err: UnexpectedInput, text: str) -> Diagnostic:
    line, col = max(err.line, 1), max(err.column, 1)
    if isinstance(err, UnexpectedCharacters):
        ch = text[err.pos_in_stream] if err.pos_in_stream < len(text) else "?"
        return Diagnostic("UCL001", f"unexpected character {ch!r}", Span(line, col, line, col + 1),
                          "names may use letters, digits, '_', '-', '.', '*' and {captures}")
    if isinstance(err, UnexpectedEOF) or (isinstance(err, UnexpectedToken) and err.token.type == "$END"):
        lines = text.splitlines() or [""]
        last = len(lines)
        return Diagnostic("UCL003", "the spec ends in the middle of a statement",
                          Span(last, len(lines[-1]) + 1, last, len(lines[-1]) + 2),
                          f"expected {_describe_expected(_expected(err))}")
    tok = err.token
    shown = "end of line" if tok.type == "_NL" else repr(str(tok))
    end_col = col + 1 if tok.type == "_NL" else (tok.end_column or col + 1)
    hint = did_you_mean(str(tok), KEYWORDS) if tok.type in ("NAME", "PATTERN") else None
    expected = _describe_expected(_expected(err))
    return Diagnostic("UCL002", f"unexpected {shown}; expected {expected}", Span(line, col, line, end_col), hint)


# A newline that does not end a statement: blank or comment lines, then an indented line.
_CONTINUATION = re.compile(r"(?:\r?\n[ \t]*(?:#[^\n]*)?)*\r?\n[ \t]+(?=[^ \t\r\n#])")
_MAX_SYNTAX_ERRORS = 50


def _statement_end(text: str, pos: int) -> int:
    """Offset of the newline that ends the statement holding offset ``pos`` (the grammar's rule:
    a line that starts with spaces or tabs continues the previous statement)."""
    while True:
        k = text.find("\n", pos)
        if k < 0:
            return len(text)
        if text[k - 1:k] == "\r":
            k -= 1
        m = _CONTINUATION.match(text, k)
        if m is None:
            return k
        pos = m.end()


def _error_offset(err: UnexpectedInput) -> int | None:
    if isinstance(err, UnexpectedCharacters):
        return err.pos_in_stream
    tok = getattr(err, "token", None)
    if tok is None or tok.type == "$END" or tok.start_pos is None:
        return None
    return tok.start_pos


def _parse_recovering(source: str):
    """Parse; after a syntax error, skip to the end of the statement it is in and parse on from
    there, so every statement with a syntax error is reported once. -> (tree or None, diagnostics)."""
    diagnostics: list[Diagnostic] = []
    pos, resumed = 0, {0}
    while True:
        cursor = parser().parse_interactive(source)
        if pos:
            cursor.lexer_thread.state.line_ctr.feed(source[:pos])  # resume at a statement boundary
        try:
            tree = cursor.resume_parse()
        except UnexpectedInput as err:
            diagnostics.append(_syntax_diagnostic(err, source))
            at = _error_offset(err)
            if at is None or len(diagnostics) >= _MAX_SYNTAX_ERRORS:
                return None, diagnostics
            # An error at the newline ending a statement resumes at that newline; any other error
            # skips the rest of its statement (its continuation lines included).
            end = at if source[at] in "\r\n" else _statement_end(source, at)
            if end >= len(source) or end in resumed:
                return None, diagnostics
            pos = end
            resumed.add(pos)
            continue
        return (None if diagnostics else tree), diagnostics


def parse(text: str, filename: str = "<spec>", max_tokens: int = MAX_SPEC_TOKENS) -> ast.Module:
    """Parse spec text into an AST. Raises SpecError with every syntax error found: each statement
    with an error is reported once (at its first bad token), and parsing goes on with the next one.
    Text beyond the size caps is refused first (:func:`check_size`)."""
    if not isinstance(text, str):
        raise SpecError([Diagnostic("UCL001", "a spec must be text")], None, filename)
    check_size(text, filename, max_tokens)
    source = text if text.endswith("\n") else text + "\n"
    tree, diagnostics = _parse_recovering(source)
    if diagnostics:
        raise SpecError(diagnostics, source, filename)
    to_ast = _ToAst()
    statements = _convert(tree, to_ast)
    if to_ast.diagnostics:
        raise SpecError(to_ast.diagnostics, source, filename)
    return ast.Module(tuple(statements), source, filename)
