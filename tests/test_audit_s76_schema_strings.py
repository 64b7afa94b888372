"""JSON schema string pattern and format (session 76): pydantic's constr(pattern=...), UUID,
datetime, date, time, timedelta, IPv4Address and AnyUrl write them, xgrammar (vLLM's default
backend) takes them, and they were refused by name. The automaton reads the JSON text, the
pattern and the format speak of the decoded value: every text the automaton takes must json.loads
to a string that fullmatches the pattern as Python's re, ECMA-262 (JSON Schema's dialect,
emulated here by a Python regex written apart for each pattern) and pydantic's Rust regex read
it, or that is valid by the format as Python's datetime / ipaddress / uuid, pydantic, or a checker
written here from the RFC's grammar decide. Random walks through the automaton (soundness),
values drawn apart and written every way JSON may spell them (completeness, where claimed), chosen
examples, the refusals, and guided generation on the demo model."""

from __future__ import annotations

import datetime
import functools
import ipaddress
import json
import random
import re
import string
import uuid
from typing import Optional

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
pytest.importorskip("pydantic")  # the oracle of schemas and of ECMA-style regexes (dev extra)
from pydantic import BaseModel, TypeAdapter, ValidationError, constr  # noqa: E402

from minivllm.runtime.guide import schema_regex
from minivllm.runtime.regex_fsm import RegexDFA
from minivllm.runtime.sampling_params import StructuredOutputsParams
from minivllm.runtime.schema_strings import FORMATS

from test_audit_s76_schema_ranges import guided_texts
from test_audit_s76_structured import _walk


@functools.lru_cache(maxsize=None)
def _dfa(schema_json: str) -> RegexDFA:
    return RegexDFA(schema_regex(json.loads(schema_json)))


def dfa_of(schema: dict) -> RegexDFA:
    return _dfa(json.dumps(schema, sort_keys=True))


# -- the JSON spellings of a value ---------------------------------------------------------------

_SHORT = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\b": "\\b", "\f": "\\f", "\n": "\\n",
          "\r": "\\r", "\t": "\\t"}


def spellings(c: str) -> list[str]:
    """The JSON texts of one character the automaton may take: itself where JSON writes it so,
    its short escape, \\u00XX in either case for the characters that must be escaped."""
    out = [] if c in '"\\' or ord(c) < 0x20 or c == "\x7f" else [c]
    if c in _SHORT:
        out.append(_SHORT[c])
    if c in '"\\/' or ord(c) < 0x20 or c == "\x7f":
        out += [f"\\u{ord(c):04x}", f"\\u{ord(c):04X}"]
    return out


def spelled(value: str, rnd: random.Random) -> str:
    return '"' + "".join(rnd.choice(spellings(c)) for c in value) + '"'


# -- patterns: each drawn with its ECMA-262 reading, as a Python regex written apart -------------

_ECMA_SPACE = ("\\t\\n\\v\\f\\r \\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f"
               "\\u3000\\ufeff")
_ATOMS = st.sampled_from([  # (Python's re, ECMA-262's meaning written for Python's re)
    ("a", "a"), ("b", "b"), ("1", "1"), ("é", "é"), ('"', '"'), ("\\\\", "\\\\"), ("/", "/"),
    ("\\n", "\\n"), ("\\t", "\\t"), ("-", "-"), (".", "[^\\n\\r\\u2028\\u2029]"),
    ("\\d", "[0-9]"), ("\\D", "[^0-9]"), ("\\w", "[A-Za-z0-9_]"), ("\\W", "[^A-Za-z0-9_]"),
    ("\\s", f"[{_ECMA_SPACE}]"), ("\\S", f"[^{_ECMA_SPACE}]"), ("[ab]", "[ab]"),
    ("[^a]", "[^a]"), ("[^\\d]", "[^0-9]"), ("[\\d_]", "[0-9_]"), ("[^\\s]", f"[^{_ECMA_SPACE}]"),
    ("[\\s\\S]", "[\\s\\S]"), ("[^\\D]", "[0-9]"), ("[^\\W_]", "[A-Za-z0-9]"),
    ("[\\x00-\\x1f]", "[\\x00-\\x1f]"), ('[^"]', '[^"]'), ("\\u00e9", "\\u00e9"),
    ("[^\\S ]", f"[{_ECMA_SPACE.replace(' ', '')}]")])


def _patterns():
    def extend(inner):
        return st.one_of(
            st.tuples(inner, inner).map(lambda t: (t[0][0] + t[1][0], t[0][1] + t[1][1])),
            st.tuples(inner, inner).map(lambda t: (f"(?:{t[0][0]}|{t[1][0]})",
                                                   f"(?:{t[0][1]}|{t[1][1]})")),
            st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "*?"]))
            .map(lambda t: (f"(?:{t[0][0]}){t[1]}", f"(?:{t[0][1]}){t[1]}")),
            inner.map(lambda r: (f"({r[0]})", f"({r[1]})")))
    anchors = st.sampled_from([("", ""), ("^", "$"), ("^", ""), ("", "$")])
    return st.tuples(st.recursive(_ATOMS, extend, max_leaves=5), anchors).map(
        lambda t: (t[1][0] + t[0][0] + t[1][1], t[0][1]))


@functools.lru_cache(maxsize=None)
def _pydantic(pattern: str) -> TypeAdapter:
    return TypeAdapter(constr(pattern=pattern))


def holds(pattern: str, ecma: str, value: str, lo: int = 0, hi: int | None = None) -> bool:
    """Whether `value` fullmatches the pattern as Python's re and ECMA-262 read it, and is of
    lo..hi characters (`ecma`: the pattern's ECMA-262 meaning as a Python regex, anchors apart)."""
    return (bool(re.fullmatch(pattern, value)) and bool(re.fullmatch(ecma, value))
            and lo <= len(value) <= (len(value) if hi is None else hi))


def _rust_matches(pattern: str, value: str) -> bool:
    try:
        _pydantic(pattern).validate_python(value)
        return True
    except ValidationError:
        return False


_LENGTHS = st.one_of(st.just((0, None)), st.tuples(st.integers(0, 3), st.none()),
                     st.tuples(st.integers(0, 3), st.integers(0, 3)).map(
                         lambda t: (t[0], t[0] + t[1])))
_REFUSED = ("the lengths are held exactly only", "no string JSON can write")


def _dfa_or_refusal(pattern: str, lo: int, hi: int | None) -> tuple[RegexDFA | None, str]:
    """The automaton of the pattern within the lengths, or None and the refusal, which must be
    one of _REFUSED's."""
    try:
        return dfa_of(_string_schema(pattern, lo, hi)), ""
    except ValueError as e:
        assert any(why in str(e) for why in _REFUSED), e
        return None, str(e)


def _string_schema(pattern: str, lo: int, hi: int | None) -> dict:
    schema = {"type": "string", "pattern": pattern}
    if lo:
        schema["minLength"] = lo
    if hi is not None:
        schema["maxLength"] = hi
    return schema


# Characters where the dialects or JSON part: a Python-only digit and spaces, ECMA-only space
# (U+FEFF), a mark (Rust's \w, not Python's), line terminators, raw controls, an astral one.
_WALK_ALPHABET = sorted(set('ab1é"\\/-_ \n\t\r\x00\x1c\x7f\x85\xa0\u0301\u0663\u2028\ufeff'
                            '\U0001F600'
                            "ubfnrt0Aa2Ff5Cc7"))


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@example(("^\\S+$", "[^" + _ECMA_SPACE + "]+"), (0, None), random.Random(0))
@example(("\\d{2,}", "[0-9]{2,}"), (2, 3), random.Random(0))
@given(_patterns(), _LENGTHS, st.randoms(use_true_random=False))
def test_every_text_the_automaton_takes_is_a_value_the_pattern_holds(drawn, lengths, rnd):
    """Soundness: the random walks' texts parse as JSON strings whose values fullmatch the
    pattern in Python's re and in ECMA-262, match it in pydantic's Rust regex, and are within
    minLength / maxLength."""
    (pattern, ecma), (lo, hi) = drawn, lengths
    dfa, _ = _dfa_or_refusal(pattern, lo, hi)
    if dfa is None:
        return
    for _ in range(6):
        text = _walk(dfa, _WALK_ALPHABET, rnd)
        if text is None:
            continue
        value = json.loads(text)
        assert isinstance(value, str) and holds(pattern, ecma, value, lo, hi), (pattern, text)
        assert _rust_matches(pattern, value), (pattern, value)


_VALUE_ALPHABET = 'ab "\\\n\t/é1_-'  # over these Python's and ECMA's readings the pattern's


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@example(('^a"\\\\$', 'a"\\\\'), (0, None), ['a"\\', 'a"'], random.Random(0))
@example(("[^a]{1,3}", "[^a]{1,3}"), (2, None), ["\n\t", "/", "é/é", "a"], random.Random(0))
@example(("(?:ab)+", "(?:ab)+"), (3, 5), ["ab", "abab", "ababab"], random.Random(0))
@example(("(?:ab){1,2}", "(?:ab){1,2}"), (3, 10), ["ab", "abab", "ababab"], random.Random(0))
@example(("^(?:a|bc)(?:d\\n){0,3}$", "(?:a|bc)(?:d\\n){0,3}"), (2, 6),
         ["a", "ad\n", "bcd\nd\n", "ad\nd\nd\n"], random.Random(0))
@given(_patterns(), _LENGTHS, st.lists(st.text(_VALUE_ALPHABET, max_size=5), max_size=10),
       st.randoms(use_true_random=False))
def test_a_pattern_takes_exactly_the_values_both_dialects_hold(drawn, lengths, values, rnd):
    """Completeness over characters both dialects read alike: a value is taken, in each way JSON
    may spell it, iff it fullmatches the pattern as Python's re and ECMA-262 read it and is of
    minLength..maxLength characters. A refusal is of lengths no regex here keeps exactly or of a
    pattern no JSON string is a value of."""
    (pattern, ecma), (lo, hi) = drawn, lengths
    dfa, refusal = _dfa_or_refusal(pattern, lo, hi)
    if dfa is None:
        if _REFUSED[1] in refusal:
            assert not any(holds(pattern, ecma, v, lo, hi) for v in values), (pattern, values)
        return
    for value in values:
        want = holds(pattern, ecma, value, lo, hi)
        for text in (json.dumps(value, ensure_ascii=False), spelled(value, rnd)):
            assert dfa.fullmatch(text) == want, (pattern, lengths, value, text)


@pytest.mark.parametrize("schema, yes, no", [
    ({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, ["ABC-12"], ["abc-12", "ABC-1"]),
    ({"type": "string", "pattern": "[a-z]+"}, ["abc"], ["", "ab1"]),  # a fullmatch, as xgrammar
    ({"type": "string", "pattern": "^a.c$"}, ["abc", "a c", 'a"c', "a\\c", "a/c", "a\tc"],
     ["a\nc", "a\rc", "a\u2028c", "ac"]),
    ({"type": "string", "pattern": r"^\d+$"}, ["0123"], ["\u0663", "1\u0663"]),
    ({"type": "string", "pattern": r"^\w+$"}, ["a_Z9"], ["é", "a-b"]),
    ({"type": "string", "pattern": r"^\s$"}, [" ", "\t", "\n"], ["\xa0", "\x1c", "\ufeff"]),
    ({"type": "string", "pattern": r"^\S$"}, ["a", "é", '"'], [" ", "\x1c", "\ufeff", "\x85"]),
    ({"type": "string", "pattern": r"^\W$"}, ["-", " ", '"'], ["a", "é", "\u0301"]),
    ({"type": "string", "pattern": r"^[^\S ]$"}, ["\t", "\n"], [" ", "a", "\xa0"]),
    ({"type": "string", "pattern": r'^[^"\\]*$'}, ["it's", "é\n"], ['"', "a\\b"]),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4},
     ["ab", "abcd"], ["a", "abcde"]),
    ({"type": "string", "pattern": r"^\+?[0-9]{10,15}$", "maxLength": 12},
     ["0123456789", "+01234567890", "012345678901"], ["+012345678901", "0123456789012"]),
    ({"type": "string", "pattern": "^[A-Z][a-z]*(-[0-9]{2})?$", "maxLength": 5},
     ["Abcde", "Ab-12", "A-12"], ["Abcdef", "Abc-12"]),
    ({"type": "string", "format": "date", "maxLength": 10},
     ["2024-02-29", "2000-02-29", "2400-02-29", "0400-02-29", "0004-02-29", "0001-01-01"],
     ["2023-02-29", "2100-02-29", "0000-02-29", "0000-01-01"]),
    ({"type": ["string", "null"], "format": "uuid"},
     ["12345678-1234-1234-1234-1234567890ab", None], ["12345678123412341234123456789012"]),
    ({"anyOf": [{"type": "string", "format": "ipv4"}, {"type": "string", "format": "ipv6"}]},
     ["127.0.0.1", "::1"], ["127.0.0.01", "::1::"]),
])
def test_chosen_values(schema, yes, no):
    dfa = dfa_of(schema)
    for value in yes:
        assert dfa.fullmatch(json.dumps(value, ensure_ascii=False)), value
    for value in no:
        assert not dfa.fullmatch(json.dumps(value, ensure_ascii=False)), value


def test_the_text_spells_the_value_with_json_escapes():
    """The characters JSON must escape are written escaped (never raw), '/' either way; the
    escapes are whole (no stray backslash, no unfinished \\u)."""
    dfa = dfa_of({"type": "string", "pattern": '^"[\\\\/]{2}\n\x01\x7f$'})
    for text in ['"\\"\\\\/\\n\\u0001\\u007f"', '"\\u0022\\u005C\\/\\u000a\\u0001\\u007F"']:
        assert dfa.fullmatch(text), text
    for text in ['"""\\\\/\\n\\u0001\\u007f"', '"\\"\\\\/\n\\u0001\\u007f"',
                 '"\\"\\\\/\\n\x01\\u007f"', '"\\"\\\\/\\n\\u0001\x7f"',
                 '"\\"\\/\\n\\u0001\\u007f"', '"\\"\\\\/\\n\\u01\\u007f"']:
        assert not dfa.fullmatch(text), text


# -- formats ---------------------------------------------------------------------------------------

_TIME_SHAPE = r"[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})"


def _parses(parse, value) -> bool:
    try:
        parse(value)
        return True
    except ValueError:
        return False


def _date_ok(v: str) -> bool:
    return bool(re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", v)) and _parses(
        datetime.date.fromisoformat, v)


def _time_ok(v: str) -> bool:  # RFC 3339 full-time: the offset is required
    return bool(re.fullmatch(_TIME_SHAPE, v)) and _parses(datetime.time.fromisoformat, v)


def _date_time_ok(v: str) -> bool:
    return v[10:11] == "T" and _date_ok(v[:10]) and _time_ok(v[11:]) and _parses(
        datetime.datetime.fromisoformat, v)


def _duration_ok(v: str) -> bool:
    """RFC 3339 appendix A: P, then weeks alone, or date units then T and time units, each part
    a run of consecutive units (Y M D / H M S: no YD, no HS) of digits each."""
    def units(part: str, order: str) -> bool:
        found = re.findall("([0-9]+)([A-Z])", part)
        letters = "".join(u for _, u in found)
        return "".join(n + u for n, u in found) == part and bool(letters) and letters in order
    if not v.startswith("P"):
        return False
    body = v[1:]
    if re.fullmatch("[0-9]+W", body):
        return True
    date, t, time = body.partition("T")
    return (not date or units(date, "YMD")) and (not t or units(time, "HMS")) and bool(date or t)


def _hostname_ok(v: str, least_labels: int = 1) -> bool:
    labels = v.split(".")
    return len(v) <= 253 and len(labels) >= least_labels and all(
        1 <= len(label) <= 63 and label[0] != "-" and label[-1] != "-"
        and all(c in string.ascii_letters + string.digits + "-" for c in label)
        for label in labels)


def _email_ok(v: str) -> bool:
    """RFC 5321 / 5322: a dot-atom local part of at most 64 characters, a domain of labels (two
    at least, as email-validator, pydantic's, wants), at most 254 in all."""
    local, at, domain = v.rpartition("@")
    atext = string.ascii_letters + string.digits + "!#$%&'*+/=?^_`{|}~-"
    return (bool(at) and 1 <= len(local) <= 64 and len(v) <= 254
            and all(part and all(c in atext for c in part) for part in local.split("."))
            and _hostname_ok(domain, 2))


def _ipv4_ok(v: str) -> bool:
    return _parses(ipaddress.IPv4Address, v) and str(ipaddress.IPv4Address(v)) == v


def _ipv6_ok(v: str) -> bool:
    return "%" not in v and _parses(ipaddress.IPv6Address, v)


def _uuid_ok(v: str) -> bool:
    return len(v) == 36 and _parses(uuid.UUID, v) and str(uuid.UUID(v)) == v.lower()


_UNRESERVED_SUB = string.ascii_letters + string.digits + "-._~!$&'()*+,;="
_URI_PARTS = re.compile(r"(([^:/?#]+):)?(//([^/?#]*))?([^?#]*)(\?([^#]*))?(#(.*))?")  # RFC 3986 B


def _chars_ok(s: str, allowed: str) -> bool:
    """Each character allowed, or % and two hex digits (RFC 3986's pct-encoded)."""
    i = 0
    while i < len(s):
        if s[i] == "%":
            if not all(c in string.hexdigits for c in s[i + 1:i + 3]) or len(s) < i + 3:
                return False
            i += 3
        elif s[i] in allowed:
            i += 1
        else:
            return False
    return True


def _uri_ok(v: str, absolute: bool = True) -> bool:
    """RFC 3986: split by its appendix B, each part checked against its characters."""
    m = _URI_PARTS.fullmatch(v)
    scheme, authority, path, query, fragment = m.group(2, 4, 5, 7, 9)
    if scheme is None and absolute:
        return False
    if scheme is not None and not (scheme[0] in string.ascii_letters and all(
            c in string.ascii_letters + string.digits + "+-." for c in scheme)):
        return False
    pchar = _UNRESERVED_SUB + ":@"
    if authority is not None:
        userinfo, at, hostport = authority.rpartition("@")
        host, colon, port = hostport.rpartition(":") if ":" in hostport else (hostport, "", "")
        if not (_chars_ok(userinfo, _UNRESERVED_SUB + ":") and _chars_ok(host, _UNRESERVED_SUB)
                and all(c in string.digits for c in port)):
            return False
        if path and not path.startswith("/"):
            return False
    elif path.startswith("//"):
        return False
    elif scheme is None and ":" in path.split("/")[0]:
        return False
    return all(s is None or _chars_ok(s, allowed) for s, allowed in
               ((path, pchar + "/"), (query, pchar + "/?"), (fragment, pchar + "/?")))


def _uri_template_ok(v: str) -> bool:
    """RFC 6570: literals and expressions {op? varspec, ...}, no reserved operator."""
    literals = "".join(chr(c) for c in (0x21, 0x23, 0x24, 0x26, *range(0x28, 0x3C), 0x3D,
                                        *range(0x3F, 0x5C), 0x5D, 0x5F, *range(0x61, 0x7B),
                                        0x7E))
    i = 0
    while i < len(v):
        if v[i] == "{":
            end = v.find("}", i)
            if end < 0:
                return False
            body = v[i + 1:end]
            if body[:1] and body[0] in "+#./;?&":
                body = body[1:]
            for spec in body.split(","):
                name, colon, most = spec.partition(":")
                if spec.endswith("*"):
                    name, most = spec[:-1], ""
                elif colon and not re.fullmatch("[1-9][0-9]{0,3}", most):
                    return False
                if not all(part and _chars_ok(part, string.ascii_letters + string.digits + "_")
                           for part in name.split(".")):
                    return False
            i = end + 1
        elif v[i] == "%":
            if not _chars_ok(v[i:i + 3], ""):
                return False
            i += 3
        elif v[i] in literals:
            i += 1
        else:
            return False
    return True


def _json_pointer_ok(v: str) -> bool:
    return (v == "" or v.startswith("/")) and all(
        re.fullmatch("(?:[^~]|~[01])*", token, re.DOTALL) for token in v.split("/")[1:])


def _relative_json_pointer_ok(v: str) -> bool:
    digits = v[:len(v) - len(v.lstrip(string.digits))]
    rest = v[len(digits):]
    return (bool(digits) and (digits == "0" or digits[0] != "0")
            and (rest == "#" or _json_pointer_ok(rest)))


CHECKS = {"date": _date_ok, "time": _time_ok, "date-time": _date_time_ok,
          "duration": _duration_ok, "email": _email_ok, "hostname": _hostname_ok,
          "ipv4": _ipv4_ok, "ipv6": _ipv6_ok, "uuid": _uuid_ok, "uri": _uri_ok,
          "uri-reference": lambda v: _uri_ok(v, absolute=False),
          "uri-template": _uri_template_ok, "json-pointer": _json_pointer_ok,
          "relative-json-pointer": _relative_json_pointer_ok}
_PYDANTIC = {"date": datetime.date, "time": datetime.time, "date-time": datetime.datetime,
             "uuid": uuid.UUID, "ipv4": ipaddress.IPv4Address, "ipv6": ipaddress.IPv6Address}


def test_every_format_xgrammar_takes_is_taken():
    assert set(FORMATS) == set(CHECKS) == {
        "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
        "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}


_FORMAT_ALPHABET = sorted(set(string.digits + "abcdefnrtuxyzABCDEFTZPYMWDHS-:.+@/%?#~!$&'()*,;=_"
                              '[]{}|^`"\\\n\x00 é'))


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(FORMATS)), st.randoms(use_true_random=False))
def test_every_text_the_automaton_takes_is_a_value_of_the_format(name, rnd):
    """Soundness: each random walk's text is a JSON string valid by the format (the checkers
    above; Python's and pydantic's parsers too where they have one)."""
    dfa = dfa_of({"type": "string", "format": name})
    for _ in range(5):
        text = _walk(dfa, _FORMAT_ALPHABET, rnd)
        if text is None:
            continue
        value = json.loads(text)
        assert CHECKS[name](value), (name, text)
        if name in _PYDANTIC:
            TypeAdapter(_PYDANTIC[name]).validate_python(value)


def _dates():
    return st.dates(datetime.date(1, 1, 1), datetime.date(9999, 12, 31))


def _times():
    offsets = st.integers(-23 * 60 - 59, 23 * 60 + 59).map(
        lambda m: f"{'+' if m >= 0 else '-'}{abs(m) // 60:02d}:{abs(m) % 60:02d}")
    return st.builds(lambda t, frac, tz: t.strftime("%H:%M:%S") + frac + tz,
                     st.times(), st.sampled_from(["", ".5", ".123456", ".0000000001"]),
                     st.just("Z") | offsets)


_LABEL = st.from_regex(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,8}[A-Za-z0-9])?", fullmatch=True)
_VALUES = {  # values drawn apart from the regexes, in the forms the formats claim to take
    "date": _dates().map(str),
    "time": _times(),
    "date-time": st.builds(lambda d, t: f"{d}T{t}", _dates(), _times()),
    "duration": st.sampled_from(["P1Y", "P1Y2M", "P1Y2M3D", "P2M3D", "P3D", "PT1H", "PT1H2M",
                                 "PT1H2M3S", "PT2M3S", "PT3S", "P1W", "P1DT1S", "P10Y0M0DT0H"]),
    "email": st.builds(lambda local, labels: f"{local}@{'.'.join(labels)}",
                       st.from_regex(r"[a-z0-9!#$%&'*+/=?^_`{|}~-]+(\.[a-z0-9_-]+)*",
                                     fullmatch=True).filter(lambda s: len(s) <= 32),
                       st.lists(_LABEL, min_size=2, max_size=5)),
    "hostname": st.lists(_LABEL, min_size=1, max_size=8).map(".".join),
    "ipv4": st.integers(0, 2 ** 32 - 1).map(lambda n: str(ipaddress.IPv4Address(n))),
    "ipv6": st.integers(0, 2 ** 128 - 1).flatmap(lambda n: st.sampled_from([
        str(ipaddress.IPv6Address(n)), ipaddress.IPv6Address(n).exploded,
        str(ipaddress.IPv6Address(n)).upper()])),
    "uuid": st.uuids().flatmap(lambda u: st.sampled_from([str(u), str(u).upper()])),
    "uri": st.sampled_from(["http://example.com", "https://a.b/c/d?e=f&g#h", "mailto:x@y.z",
                            "urn:isbn:0451450523", "file:///tmp/a%20b", "a:", "ftp://u:p@h:21/",
                            "http://h/~a/(b)/c;d=e,f!g$h'i*+"]),
    "uri-reference": st.sampled_from(["http://example.com", "//h/p", "/a/b", "a/b", "", "?q",
                                      "#f", "../x", "a%2Fb"]),
    "uri-template": st.sampled_from(["http://x/{a}", "{+path}/here", "{#x,y}", "/{a.b:3}{c*}",
                                     "plain", "%20{var}"]),
    "json-pointer": st.lists(st.text(alphabet='ab/~"\\\n\x01é', max_size=3), max_size=3).map(
        lambda tokens: "".join("/" + t.replace("~", "~0").replace("/", "~1") for t in tokens)),
    "relative-json-pointer": st.sampled_from(["0", "1#", "10/a~0b", "2/", "0/\n"]),
}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(FORMATS)).flatmap(lambda n: st.tuples(st.just(n), _VALUES[n])),
       st.randoms(use_true_random=False))
def test_values_of_each_format_drawn_apart_are_taken(drawn, rnd):
    """Completeness for the forms each format's regex claims: valid values drawn apart (by
    Python's date / ipaddress / uuid, or listed) are taken, however JSON spells them."""
    name, value = drawn
    assert CHECKS[name](value), (name, value)  # the case itself is right
    dfa = dfa_of({"type": "string", "format": name})
    for text in (json.dumps(value, ensure_ascii=False), spelled(value, rnd)):
        assert dfa.fullmatch(text), (name, text)


@pytest.mark.parametrize("name, bad", [
    ("date", ["2023-02-29", "1900-02-29", "2100-02-29", "1800-02-29", "2023-04-31",
              "2023-13-01", "2023-00-10", "0000-01-01", "2023-1-01", "20230101", "2024-02-30"]),
    ("time", ["24:00:00Z", "12:60:00Z", "23:59:60Z", "12:00:00", "12:00Z", "12:00:00+24:00",
              "12:00:00.Z"]),
    ("date-time", ["2024-01-01 12:00:00Z", "2024-01-01T12:00:00", "2023-02-29T00:00:00Z"]),
    ("duration", ["P", "PT", "P1D1Y", "P1Y1D", "PT1H1S", "P1.5D", "1D", "P1WT1H"]),
    ("email", ["a@b", "a..b@c.d", ".a@b.c", "a.@b.c", "a@-b.c", "a b@c.d",
               "a" * 65 + "@b.c", "a@" + "b" * 64 + ".c"]),
    ("hostname", ["-a", "a-", "a..b", "a_b", "", "a." + "b" * 64, ".a"]),
    ("ipv4", ["01.2.3.4", "256.1.1.1", "1.2.3", "1.2.3.4.5", "1.2.3.04"]),
    ("ipv6", [":::", "1::2::3", "1:2:3:4:5:6:7:8:9", "::ffff:1.2.3.04", "12345::", "::g"]),
    ("uuid", ["12345678123412341234123456789012", "{12345678-1234-1234-1234-123456789012}",
              "12345678-1234-1234-1234-12345678901"]),
    ("uri", ["no-scheme", "1a:b", "a b:c", "http://a b", "http://h/%zz", "http://h:x/"]),
    ("uri-reference", ["a:b:c d", "%", "a b"]),
    ("uri-template", ["{", "{}", "{a", "{=a}", "{a:0}", "{a:10000}", "a b"]),
    ("json-pointer", ["a", "/~", "/~2"]),
    ("relative-json-pointer", ["01", "-1", "a", "0a", "0#/"]),
])
def test_values_outside_each_format_are_refused(name, bad):
    dfa = dfa_of({"type": "string", "format": name})
    for value in bad:
        assert not CHECKS[name](value), (name, value)  # the case itself is right
        assert not dfa.fullmatch(json.dumps(value, ensure_ascii=False)), (name, value)


def test_a_hostnames_labels_and_length_are_rfc_1123s():
    """Labels of up to 63 characters, names of up to 253: each shape of the union within it."""
    dfa = dfa_of({"type": "string", "format": "hostname"})
    for value in ["a" * 63 + ".b", ".".join(["a" * 62] * 4), ".".join(["a" * 14] * 16)]:
        assert _hostname_ok(value) and dfa.fullmatch(json.dumps(value)), value
    for value in ["a" * 64, ".".join(["a" * 63] * 4)]:
        assert not dfa.fullmatch(json.dumps(value)), value


# -- pydantic's schemas ----------------------------------------------------------------------------

class Event(BaseModel):
    id: uuid.UUID
    when: datetime.datetime
    day: datetime.date
    at: datetime.time
    code: constr(pattern=r"^[A-Z]{3}-\d{2}$")
    name: constr(pattern=r"^[A-Za-z ]+$", min_length=1, max_length=12)
    host: ipaddress.IPv4Address
    note: Optional[str] = None


def test_pydantics_own_schemas_are_taken_and_their_texts_validate():
    """What model_json_schema() writes for these fields (format uuid, date-time, date, time,
    ipv4; pattern with min_length / max_length) is taken; each random walk's text is one
    pydantic's model_validate_json takes. (timedelta's format duration is taken too, but
    pydantic's timedelta refuses what Python's cannot hold, P1000000000D, RFC 3339's or not.)"""
    schema = Event.model_json_schema()
    assert schema_regex(TypeAdapter(datetime.timedelta).json_schema())
    dfa = RegexDFA(StructuredOutputsParams(json=schema).pattern)
    rnd = random.Random(7)
    alphabet = sorted(set(_FORMAT_ALPHABET) | set(json.dumps(schema)) | set(" nul"))
    seen = 0
    for _ in range(40):
        text = _walk(dfa, alphabet, rnd)
        if text is not None:
            seen += 1
            Event.model_validate_json(text)
    assert seen


@pytest.mark.parametrize("schema, match", [
    ({"type": "string", "format": "idn-email"}, "format 'idn-email' not supported"),
    ({"type": "string", "format": 3}, "format 3 not supported"),
    ({"type": "string", "format": "date", "pattern": "^2"}, "pattern with format"),
    ({"type": "string", "pattern": 5}, "pattern must be a string"),
    ({"type": "string", "pattern": "a(?=b)"}, r"\(\?\.\.\.\)"),  # look-arounds stay refused
    ({"type": "string", "pattern": r"(a)\1"}, r"\\1"),
    ({"type": "string", "pattern": r"\bword"}, r"\\b"),
    ({"type": "string", "pattern": "a{,2}"}, r"\{,n\}"),
    ({"type": "string", "pattern": r"\a"}, "bell"),
    ({"type": "string", "pattern": "[]a]"}, "opening with ]"),
    ({"type": "string", "pattern": "[^]a]"}, "opening with ]"),
    ({"type": "string", "pattern": "^a+b+$", "maxLength": 4}, "held exactly only"),
    ({"type": "string", "format": "email", "maxLength": 100}, "held exactly only"),
    ({"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083}, "held exactly"),
    ({"type": "string", "pattern": "^[a-z]{3}$", "maxLength": 2}, "no string JSON can write"),
    ({"type": "string", "format": "date", "minLength": 11}, "no string JSON can write"),
    ({"type": "string", "pattern": "[\ud800-\udfff]"}, "no string JSON can write"),
    ({"type": "integer", "format": "int32"}, r"\['format'\] not supported"),
    ({"type": "string", "enum": ["a"], "pattern": "a"}, r"\['pattern'\] not supported"),
])
def test_what_cannot_be_held_is_refused_by_name(schema, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(json=schema)


def test_lengths_within_the_format_anyway_are_taken():
    """A date is 10 characters: minLength 1 / maxLength 10 change nothing; AnyUrl's minLength 1
    (any URI is 2 at least) neither."""
    for schema in ({"type": "string", "format": "date", "minLength": 1, "maxLength": 10},
                   {"type": "string", "format": "uri", "minLength": 1}):
        bare = {"type": "string", "format": schema["format"]}
        assert schema_regex(schema) == schema_regex(bare)


# -- the engine ------------------------------------------------------------------------------------

def test_guided_outputs_are_values_of_their_formats_and_patterns(tmp_path_factory, device):
    """Through the engine's guided decoding on the demo model, sampled at temperature 1: each
    finished output is one pydantic validates and the checkers above take, each cut-short one a
    prefix the automaton still walks."""

    class Small(BaseModel):
        id: uuid.UUID
        day: datetime.date
        code: constr(pattern=r'^[A-Z]{2}"\d$')
        host: ipaddress.IPv4Address

    for text in guided_texts(tmp_path_factory, device, Small.model_json_schema(),
                             ["The quick brown fox", "0"], max_tokens=160, n=3, seed=11):
        Small.model_validate_json(text)
        value = json.loads(text)
        assert _uuid_ok(value["id"]) and _date_ok(value["day"]) and _ipv4_ok(value["host"])
        assert re.fullmatch(r'[A-Z]{2}"[0-9]', value["code"]), value
