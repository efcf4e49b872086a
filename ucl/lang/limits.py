"""Size caps on spec text, checked before the parser sees it (no lark import: a spec read from the
cache of parsed specs, ``lang.parsed``, is checked too)."""
from __future__ import annotations

import re
from functools import lru_cache

from ..errors import Diagnostic, Span, SpecError

# Lark takes ~20 us a token, and a manifest embeds its spec: without a cap, one hostile checkpoint
# stalls every reader (a 200,000-term expression parsed for > 12 s). The largest standard spec has
# ~700 tokens as counted here, a spec generated for a DCP folder ~13 a parameter, and 20,000 rules
# must bind (tests/test_hostile_lang.py): the cap is far above all of them and bounds a parse to
# a few seconds.
MAX_SPEC_CHARS = 16 << 20  # as a spec file (ucl.lang.spec.MAX_SPEC_BYTES)
MAX_SPEC_TOKENS = 150_000
# A spec that comes with its parameter list (a manifest, a generated description of a foreign folder)
# may be longer in proportion: a DCP folder of 90,000 per-expert tensors has a 1.2M-token spec. A hostile
# manifest can list fake parameters cheaply, so the factor is kept near what generated specs need: parsing
# still costs ~20x a bind of the same list (~0.3 ms a listed parameter), bounded by the manifest's size.
TOKENS_PER_PARAM = 16  # a generated DCP or DeepSpeed spec takes ~13 a parameter
# Counted before Lark runs, comments removed, in one regex match that stops at the cap (a refusal
# costs ~50 ns a token): a run of word characters, dots and braces (a name, a number, a pattern
# like layers.{i}.w) or any other visible character is one token. Never fewer than lark's, but
# where braces make text that lark refuses at the first brace anyway. (Patterns of nested or
# possessive repeats cost microseconds a line on blank or comment lines: measure before changing.)
SPEC_TOKEN = re.compile(r"(?>\s*(?:[\w.{}]+|\S))")  # one atomic group: 200,000 blank lines were slow
_COMMENT = re.compile(r"#[^\n]*")


@lru_cache(maxsize=8)
def _capped(max_tokens: int) -> re.Pattern:
    return re.compile(f"(?:{SPEC_TOKEN.pattern}){{{max_tokens + 1}}}")


def token_budget(params: int) -> int:
    """The token cap of a spec that describes ``params`` parameters (never below :data:`MAX_SPEC_TOKENS`)."""
    return max(MAX_SPEC_TOKENS, TOKENS_PER_PARAM * max(0, int(params)))


def count_tokens(text: str) -> int:
    """The tokens of ``text`` as the cap counts them (comments count nothing)."""
    return len(SPEC_TOKEN.findall(_COMMENT.sub("", text)))


def check_size(text: str, filename: str = "<spec>", max_tokens: int = MAX_SPEC_TOKENS) -> None:
    """UCL004 for spec text beyond :data:`MAX_SPEC_CHARS` or ``max_tokens`` (at the token that
    crosses the cap), found in time bounded by the cap, before the parser sees it."""
    def refuse(message: str, span: Span | None) -> SpecError:
        hint = "specs this large are refused so that a hostile file or manifest cannot stall its readers"
        return SpecError([Diagnostic("UCL004", message, span, hint)], None, filename)  # no source: lines may be huge

    if len(text) > MAX_SPEC_CHARS:
        raise refuse(f"the spec is {len(text):,} characters, more than the {MAX_SPEC_CHARS:,} a spec may have", None)
    code = _COMMENT.sub("", text)  # a comment ends its line: the columns before it do not move
    m = _capped(max_tokens).match(code)
    if m is not None:
        end = m.end()
        line, col = code.count("\n", 0, end) + 1, end - code.rfind("\n", 0, end - 1) - 1
        raise refuse(f"the spec has more than {max_tokens:,} tokens, the most this spec may have (the "
                     "largest standard spec has about 700)", Span(line, col, line, col + 1))
