"""JSON schema strings held to a `pattern` or a `format` (pydantic's constr(pattern=...), UUID,
datetime, date, time, timedelta, IPv4Address, AnyUrl), as regexes over their JSON text for
guide.schema_regex.

A pattern (or a format) constrains a string's value; the automaton reads its JSON text. So the
value regex is parsed (regex_fsm.parse_pattern) and each of its character sets rewritten as the
ways JSON writes those characters: a character JSON writes as itself as itself, and '"', '\\',
the controls U+0000-U+001F and U+007F as their escapes (\\" \\\\ \\n ..., or \\u00XX in either
case; never raw, as guide's plain strings), '/' as itself or \\/. JSON's escapes are a
prefix-free code, so a text the rewritten regex takes decodes to one value, of as many
characters as the sets it went through, which the value regex takes: every text is a value the
pattern holds, and every value the pattern (narrowed as below) holds can be written, but one
holding a lone surrogate (no UTF-8 text spells one). Other characters' \\u escapes (\\u00e9 for
e-acute) are not taken: JSON allows them, a model writes the character.

What the value must match:
- `pattern`: the whole value (fullmatch, its ^ / $ dropped where regex_fsm takes them), as
  xgrammar (vLLM's default backend: its regex converter skips ^ and $) and llguidance do.
  JSON Schema's pattern is an unanchored search: every value written matches it (a fullmatch is
  a match), but "xabcx" is never written for "abc". The pattern is ECMA-262 (JSON Schema's
  dialect), read by Python's re here: where the two read a set apart, it is narrowed to what
  both (and pydantic's Rust regex) hold: \\d as [0-9], \\w as [A-Za-z0-9_], \\s as ASCII
  whitespace, \\W as ASCII, `.` without \\r, U+2028 and U+2029 (ECMA's line terminators); what
  they read as different strings altogether ({,n}: a count in Python, text in ECMA; \\a; [] and
  [^]) is refused.
- `format`: FORMATS, value regexes written here, each of values valid by the format's RFC. Unlike
  xgrammar, which writes its format regexes over the JSON text: its json-pointer writes a raw
  '"' or newline, its email's quoted local part a stray backslash. Dates check the day of each
  month and February 29 in leap years only; years are 0001-9999 (RFC 3339 allows 0000, Python's
  datetime does not); seconds 00-59 (RFC 3339's leap second 60 Python refuses); IPv4 octets are
  0-255 without leading zeros (JSON Schema's tests: they read as octal). Narrower than the
  RFCs, never wider: hostnames (and emails' domains) within RFC 1034's 253 characters as a
  union of label counts and lengths (_dotted: no name of 17 labels), emails with dot-atom local
  parts (of up to 32 characters, or 63 with dots: _EMAIL) and a dotted domain (as pydantic's
  email-validator wants), URIs without [IP-literal] hosts, IPv6 without zone ids, URI templates
  without the operators RFC 6570 reserves.
- `pattern` with `format`: refused (xgrammar keeps the format and drops the pattern).
- minLength / maxLength with either: the value regex cut to those lengths exactly (_bound:
  where its length varies in one place, as in ^[a-z]+$, or in one place but for a few choices,
  as in ^\\+?[0-9]{10,15}$, or is within them anyway, as a date's), else refused: a length
  varying in two places (an email's local part and domain) would need a count no regex keeps,
  so pydantic's HttpUrl (format uri, maxLength 2083) is refused. xgrammar drops the lengths.
"""

from __future__ import annotations

import functools
import re

from .regex_fsm import ANY_BUT_NEWLINE, CharSet, parse_pattern, shown_pattern

Node = tuple  # regex_fsm.parse_pattern's tree
EMPTY: Node = ("alt", [])  # no string at all


# -- formats: value regexes, ASCII sets written out (no \d: _portable leaves them as they are) --

_HEX = "[0-9A-Fa-f]"
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
# Divisible by 4, and by 400 where by 100 (the Gregorian rule): 0400 .. 9600, never 0000.
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
         f"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
         f"|{_LEAP_YEAR}-02-29)")
_HOUR, _MIN_SEC = "(?:[01][0-9]|2[0-3])", "[0-5][0-9]"  # 00-23, 00-59
_TIME = (f"{_HOUR}:{_MIN_SEC}:{_MIN_SEC}(?:\\.[0-9]+)?"  # RFC 3339 full-time: with an offset
         f"(?:Z|[+-]{_HOUR}:{_MIN_SEC})")
_N = "[0-9]+"
_DURATION_TIME = f"T(?:{_N}H(?:{_N}M(?:{_N}S)?)?|{_N}M(?:{_N}S)?|{_N}S)"
_DURATION = (f"P(?:(?:{_N}D|{_N}M(?:{_N}D)?|{_N}Y(?:{_N}M(?:{_N}D)?)?)(?:{_DURATION_TIME})?"
             f"|{_DURATION_TIME}|{_N}W)")  # RFC 3339 appendix A


def _dotted(least: int, most_chars: int) -> str:
    """Names of at least `least` dot-separated labels (RFC 1123: letters, digits and inner
    hyphens, 1-63 characters) and at most `most_chars` characters in all. The total is the
    labels' count times their lengths, which no regex counts: a union of shapes each within it
    (at 253: 2 labels of up to 63, 4 of 62, 8 of 30, 16 of 14), one of which nearly every name
    has."""
    shapes = []
    for count in (2, 4, 8, 16):
        longest = min(63, (most_chars - (count - 1)) // count)
        label = f"[A-Za-z0-9](?:[A-Za-z0-9-]{{0,{longest - 2}}}[A-Za-z0-9])?"
        shapes.append(f"{label}(?:\\.{label}){{{least - 1},{count - 1}}}")
    return "(?:" + "|".join(shapes) + ")"


_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9][0-9]|[0-9])"
_IPV4 = f"{_OCTET}(?:\\.{_OCTET}){{3}}"
_H16 = f"{_HEX}{{1,4}}"
_LS32 = f"(?:{_H16}:{_H16}|{_IPV4})"
_IPV6 = "(?:" + "|".join([  # RFC 3986's IPv6address, one line each
    f"(?:{_H16}:){{6}}{_LS32}",
    f"::(?:{_H16}:){{5}}{_LS32}",
    f"(?:{_H16})?::(?:{_H16}:){{4}}{_LS32}",
    f"(?:(?:{_H16}:){{0,1}}{_H16})?::(?:{_H16}:){{3}}{_LS32}",
    f"(?:(?:{_H16}:){{0,2}}{_H16})?::(?:{_H16}:){{2}}{_LS32}",
    f"(?:(?:{_H16}:){{0,3}}{_H16})?::{_H16}:{_LS32}",
    f"(?:(?:{_H16}:){{0,4}}{_H16})?::{_LS32}",
    f"(?:(?:{_H16}:){{0,5}}{_H16})?::{_H16}",
    f"(?:(?:{_H16}:){{0,6}}{_H16})?::"]) + ")"
# RFC 5322's dot-atom (atext runs joined by single dots), as runs of a character with a dot or
# not before it: at most 63 characters, so that with a domain of at most 190 an address is
# within RFC 5321's 254. Quoted local parts and address literals are not written.
_ATEXT = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_EMAIL = f"{_ATEXT}(?:\\.?{_ATEXT}){{0,31}}@{_dotted(2, 190)}"
# RFC 3986 (URI, URI-reference), its hosts reg-names (no [IP-literal]).
_PCT = f"%{_HEX}{{2}}"
_SUB = "A-Za-z0-9\\-._~!$&'()*+,;="  # a class's body: unreserved and sub-delims
_PCHAR = f"(?:[{_SUB}:@]|{_PCT})"
_AUTHORITY = f"(?:(?:[{_SUB}:]|{_PCT})*@)?(?:[{_SUB}]|{_PCT})*(?::[0-9]*)?"
_PATHS = (f"//{_AUTHORITY}(?:/{_PCHAR}*)*|/(?:{_PCHAR}+(?:/{_PCHAR}*)*)?")
_TAIL = f"(?:\\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?"  # query, fragment
_URI = f"[A-Za-z][A-Za-z0-9+.\\-]*:(?:{_PATHS}|{_PCHAR}+(?:/{_PCHAR}*)*|){_TAIL}"
_RELATIVE_REF = f"(?:{_PATHS}|(?:[{_SUB}@]|{_PCT})+(?:/{_PCHAR}*)*|){_TAIL}"
# RFC 6570, its operators but those reserved for future extensions (= , ! @ |).
_VARCHAR = f"(?:[A-Za-z0-9_]|{_PCT})"
_VARSPEC = f"{_VARCHAR}(?:\\.?{_VARCHAR})*(?::[1-9][0-9]{{0,3}}|\\*)?"
_URI_TEMPLATE = (f"(?:[\\x21\\x23\\x24\\x26\\x28-\\x3b\\x3d\\x3f-\\x5b\\x5d\\x5f\\x61-\\x7a\\x7e]"
                 f"|{_PCT}|\\{{[+#./;?&]?{_VARSPEC}(?:,{_VARSPEC})*\\}})*")
_JSON_POINTER = "(?:/(?:[^/~]|~[01])*)*"  # RFC 6901: any character but / and ~ (~0, ~1)

FORMATS = {
    "date": _DATE, "time": _TIME, "date-time": f"{_DATE}T{_TIME}", "duration": _DURATION,
    "email": _EMAIL, "hostname": _dotted(1, 253), "ipv4": _IPV4, "ipv6": _IPV6,
    "uuid": f"{_HEX}{{8}}(?:-{_HEX}{{4}}){{3}}-{_HEX}{{12}}",
    "uri": _URI, "uri-reference": f"(?:{_URI}|{_RELATIVE_REF})", "uri-template": _URI_TEMPLATE,
    "json-pointer": _JSON_POINTER,
    "relative-json-pointer": f"(?:0|[1-9][0-9]*)(?:#|{_JSON_POINTER})",
}


# -- one value character: the sets both dialects hold, as JSON text --------------------------

# Each class escape's characters as neither dialect's have fewer (inner, written out) and as
# neither's have more (outer: Python's class and these; w: all of non-ASCII, so that \W is
# ASCII, as pydantic's Rust \w holds marks Python's does not).
_INNER = {"d": (("0", "9"),), "w": (("0", "9"), ("A", "Z"), ("_", "_"), ("a", "z")),
          "s": (("\t", "\r"), (" ", " "))}
_OUTER = {"d": (), "w": (("\x80", "\U0010ffff"),), "s": (("\ufeff", "\ufeff"),)}
_DOT = CharSet(ranges=(("\n", "\n"), ("\r", "\r"), ("\u2028", "\u2029")), negated=True)


def _portable(cs: CharSet) -> list[CharSet]:
    """Sets whose union holds only characters `cs` holds as Python's re, ECMA-262 and Rust's
    regex read it (regex_fsm's CharSet is Python's: \\d holds every decimal digit)."""
    if cs == ANY_BUT_NEWLINE:  # `.` (or [^\n], narrowed alike)
        return [_DOT]
    if not cs.classes:
        return [cs]
    lower = tuple(k for k in cs.classes if k.islower())
    upper = [k.lower() for k in cs.classes if k.isupper()]
    outer = CharSet(ranges=cs.ranges + tuple(r for k in lower for r in _OUTER[k]), classes=lower)
    if not cs.negated:  # [R \d \S]: R, [0-9], and what no dialect's \s holds
        inner = CharSet(ranges=cs.ranges + tuple(r for k in lower for r in _INNER[k]))
        return [inner] + [CharSet(ranges=_OUTER[k], classes=(k,), negated=True) for k in upper]
    if not upper:  # [^R \d]: neither R nor any dialect's \d
        return [CharSet(ranges=outer.ranges, classes=lower, negated=True)]
    # [^R \d \S]: what every dialect's \s holds, but R and any dialect's \d; a few characters
    held = [c for lo, hi in _INNER[upper[0]] for c in map(chr, range(ord(lo), ord(hi) + 1))
            if all(any(a <= c <= b for a, b in _INNER[k]) for k in upper) and c not in outer]
    return [CharSet(ranges=tuple((c, c) for c in held))]


# JSON writes every other character as itself (U+007F escaped, as guide's plain strings: no
# text holds a raw DEL); no UTF-8 text holds a surrogate.
_NOT_LITERAL = (("\x00", "\x1f"), ('"', '"'), ("\\", "\\"), ("\x7f", "\x7f"),
                ("\ud800", "\udfff"))
_ESCAPABLE = [*map(chr, range(0x20)), '"', "\\", "\x7f", "/"]
_SHORT = {'"': '"', "\\": "\\\\", "/": "/", "\b": "b", "\f": "f", "\n": "n", "\r": "r",
          "\t": "t"}


def _escapes(chars: list[str]) -> list[str]:
    """The regexes of the JSON escapes of these characters: each one's short escape (\\n), and
    \\u00XX for all of them in either case, by XX's first digit."""
    out = ["\\\\" + _SHORT[c] for c in chars if c in _SHORT]
    last: dict[str, set[str]] = {}
    for c in chars:
        first, second = f"{ord(c):02x}"
        last.setdefault(first, set()).update({second, second.upper()})
    for first, seconds in last.items():
        runs = _runs(sorted(seconds))
        digits = "".join(a if a == b else f"{a}-{b}" for a, b in runs)
        out.append(f"\\\\u00{first}" + (digits if len(seconds) == 1 else f"[{digits}]"))
    return out


def _runs(chars: list[str]) -> list[tuple[str, str]]:
    """Sorted characters as ranges of consecutive ones."""
    runs: list[tuple[str, str]] = []
    for c in chars:
        if runs and ord(runs[-1][1]) + 1 == ord(c):
            runs[-1] = (runs[-1][0], c)
        else:
            runs.append((c, c))
    return runs


def _char(c: str) -> str:
    """c in a regex, in a class or not: \\u and four hex digits but for letters, digits and
    astral characters (which no escape of regex_fsm's spells)."""
    if c.isascii() and c.isalnum():
        return c
    return f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else c


def _without(ranges, cut) -> list[tuple[str, str]]:
    """The characters of `ranges` outside those of `cut`, as ranges."""
    out = []
    for lo, hi in sorted(ranges):
        a = ord(lo)
        for c_lo, c_hi in sorted(cut):
            if ord(c_hi) < a or ord(c_lo) > ord(hi):
                continue
            if ord(c_lo) > a:
                out.append((chr(a), chr(ord(c_lo) - 1)))
            a = max(a, ord(c_hi) + 1)
        if a <= ord(hi):
            out.append((chr(a), hi))
    return out


def _literal(cs: CharSet) -> str | None:
    """The regex of the characters of cs JSON writes as themselves; None if there are none."""
    if cs.negated:
        cs = CharSet(ranges=cs.ranges + _NOT_LITERAL, classes=cs.classes, negated=True)
        if not cs.meets(0, 0x10FFFF):
            return None
        body = "".join(_char(lo) + ("" if lo == hi else "-" + _char(hi)) for lo, hi in cs.ranges)
        return "[^" + body + "".join("\\" + k for k in cs.classes) + "]"
    ranges = _without(cs.ranges, _NOT_LITERAL)  # _portable's positive sets have no classes
    if not ranges:
        return None
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _char(ranges[0][0])
    return "[" + "".join(_char(lo) + ("" if lo == hi else "-" + _char(hi))
                         for lo, hi in ranges) + "]"


def _unit(cs: CharSet) -> tuple[str, bool] | None:
    """The regex of the JSON texts of one character of cs (and whether it is one atom), None
    where JSON writes none."""
    sets = _portable(cs)
    parts = [r for r in map(_literal, sets) if r is not None]
    parts += _escapes([c for c in _ESCAPABLE if any(c in s for s in sets)])
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0], not parts[0].startswith("\\\\")
    return "(?:" + "|".join(parts) + ")", True


def _text(node: Node) -> tuple[str, bool] | None:
    """The regex of the JSON texts (the inside of the quotes) of node's values, and whether it
    is one atom (a quantifier may follow it); None where there is none."""
    kind = node[0]
    if kind == "set":
        return _unit(node[1])
    if kind == "cat":
        parts = [_text(n) for n in node[1]]
        if None in parts:
            return None
        return parts[0] if len(parts) == 1 else ("".join(r for r, _ in parts), False)
    if kind == "alt":
        parts = [p for p in map(_text, node[1]) if p is not None]
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else ("(?:" + "|".join(r for r, _ in parts) + ")",
                                                 True)
    _, item, lo, hi = node
    inner = _text(item)
    if inner is None or inner[0] == "":
        return ("", False) if inner is not None or lo == 0 else None
    if (lo, hi) in ((0, 0), (1, 1)):
        return ("", False) if lo == 0 else inner
    regex = inner[0] if inner[1] else f"(?:{inner[0]})"
    count = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get(
        (lo, hi), f"{{{lo}}}" if lo == hi else f"{{{lo},{'' if hi is None else hi}}}")
    return regex + count, False


# -- lengths ---------------------------------------------------------------------------------


def _lengths(node: Node) -> tuple[int, int | None]:
    """The fewest and most characters of node's strings (None: no most); (0, 0) for EMPTY."""
    kind = node[0]
    if kind == "set":
        return 1, 1
    if kind == "rep":
        _, item, lo, hi = node
        a, b = _lengths(item)
        return lo * a, 0 if b == 0 else None if b is None or hi is None else hi * b
    spans = [_lengths(n) for n in node[1] if n != EMPTY]
    if not spans:
        return 0, 0
    highs = [b for _, b in spans]
    if kind == "cat":
        return sum(a for a, _ in spans), None if None in highs else sum(highs)
    return min(a for a, _ in spans), None if None in highs else max(highs)


class _NoExactBound(Exception):
    pass


def _choices(node: Node) -> list[Node] | None:
    """node as a few alternatives of its own, each of fewer places its length varies in: an
    alternation's, or each count of a repetition of one length (x{1,3}: x, xx, xxx); None where
    there are more than 8."""
    if node[0] == "alt" and len(node[1]) <= 8:
        return node[1]
    if node[0] == "rep":
        _, item, lo, hi = node
        each, each_most = _lengths(item)
        if each == each_most and hi is not None and hi - lo < 8:
            return [("rep", item, k, k) for k in range(lo, hi + 1)]
    return None


def _bound(node: Node, lo: int, hi: int | None, spare: int = 64) -> Node:
    """node's strings of lo..hi characters (hi None: no most), exactly: node itself where they
    are all of them, EMPTY where none, else its one place of varying length recounted (an
    alternative's each), a concatenation's places of a few choices (\\+?[0-9]{10,15}) split
    into alternatives first (at most `spare` in all). _NoExactBound where the length varies in
    two places of many choices (a+b+ within 4: which way it splits is no regex's count)."""
    least, most = _lengths(node)
    if lo <= least and (hi is None or most is not None and most <= hi):
        return node
    if (hi is not None and least > hi) or (most is not None and most < lo):
        return EMPTY
    kind = node[0]
    if kind == "alt":
        share = spare // max(len(node[1]), 1)
        return ("alt", [n for n in (_bound(n, lo, hi, share) for n in node[1]) if n != EMPTY])
    if kind == "cat":
        items = list(node[1])
        spans = [_lengths(n) for n in items]
        varying = [i for i, (a, b) in enumerate(spans) if a != b]
        if len(varying) == 1:
            (i,) = varying
            fixed = sum(a for j, (a, _) in enumerate(spans) if j != i)
            items[i] = _bound(items[i], max(lo - fixed, 0), None if hi is None else hi - fixed,
                              spare)
            return EMPTY if items[i] == EMPTY else ("cat", items)
        split = [(len(c), i, c) for i in varying if (c := _choices(items[i])) is not None]
        if split and min(split)[0] <= spare:
            _, i, options = min(split, key=lambda t: t[:2])
            return _bound(("alt", [("cat", items[:i] + [o] + items[i + 1:]) for o in options]),
                          lo, hi, spare)
    if kind == "rep":
        _, item, a, b = node
        each, each_most = _lengths(item)
        if each == each_most and each > 0:  # n copies are n * each characters
            a = max(a, -(-lo // each))
            if hi is not None:
                b = hi // each if b is None else min(b, hi // each)
            return EMPTY if b is not None and a > b else ("rep", item, a, b)
    raise _NoExactBound


# -- the schema ------------------------------------------------------------------------------


def _check_dialects(pattern: str) -> None:
    """ValueError for what ECMA-262 (JSON Schema's patterns) and Python's re read as different
    strings, beyond the sets _portable narrows: {,n} (a count in Python, the text "{,n}" in
    ECMA), \\a (a bell in Python, "a" in ECMA), [] and [^] (in Python a class whose first
    character is "]"; in ECMA no character, and any)."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if pattern[i + 1:i + 2] == "a":
                raise ValueError(f"JSON schema pattern {shown_pattern(pattern)}: \\a is a bell "
                                 f"in Python's re and 'a' in ECMA-262: write \\x07 or a")
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            if pattern[j:j + 1] == "]":
                raise ValueError(f"JSON schema pattern {shown_pattern(pattern)}: a class "
                                 f"opening with ] (ECMA-262 reads [] and [^] as no character "
                                 f"and any, Python's re ] as a member): write \\]")
            i = j
            continue
        elif c == "{" and re.match(r"\{,[0-9]*\}", pattern[i:]):
            raise ValueError(f"JSON schema pattern {shown_pattern(pattern)}: {{,n}} counts in "
                             f"Python's re and is text in ECMA-262: write {{0,n}}")
        i += 1


@functools.lru_cache(maxsize=256)
def _string_text(regex: str, lo: int, hi: int | None) -> str | None:
    """The regex of the JSON texts of the values `regex` fullmatches of lo..hi characters."""
    found = _text(_bound(parse_pattern(regex), lo, hi))
    return None if found is None else f'"{found[0]}"'


def string_regex(schema: dict, lo: int, hi: int | None) -> str:
    """The regex of the JSON texts of a string schema's values, given its `pattern` or its
    `format` and its minLength lo / maxLength hi (checked by the caller): see the module's
    docstring. ValueError for a pattern regex_fsm does not take, a format not in FORMATS, both,
    lengths not held exactly, or no value JSON can write."""
    if "pattern" in schema and "format" in schema:
        raise ValueError("JSON schema pattern with format is not supported (give one: no regex "
                         "here holds a value to two)")
    if "format" in schema:
        name = schema["format"]
        if not isinstance(name, str) or name not in FORMATS:
            raise ValueError(f"JSON schema format {name!r:.60} not supported (supported: "
                             f"{', '.join(FORMATS)})")
        regex, what = FORMATS[name], f"format {name!r}"
    else:
        regex = schema["pattern"]
        if not isinstance(regex, str):
            raise ValueError(f"JSON schema pattern must be a string, got {regex!r:.60}")
        _check_dialects(regex)
        what = f"pattern {shown_pattern(regex)}"
    lengths = " with " + " / ".join(f"{k} {schema[k]}" for k in ("minLength", "maxLength")
                                    if k in schema)
    try:
        text = _string_text(regex, lo, hi)
    except _NoExactBound:
        raise ValueError(f"JSON schema {what}{lengths}: the lengths are held exactly only where "
                         f"the value's length varies in one place (as in ^[a-z]+$ or "
                         f"^\\+?[0-9]{{10,15}}$) or is within them anyway") from None
    if text is None:
        raise ValueError(f"JSON schema {what}{'' if (lo, hi) == (0, None) else lengths}: no "
                         f"string JSON can write is one of its values")
    return text
