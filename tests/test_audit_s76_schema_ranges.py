"""JSON schema number bounds (session 76): minimum, maximum, exclusiveMinimum and
exclusiveMaximum of an integer or a number, which xgrammar (vLLM's default backend) takes and
pydantic writes (Field(ge=0), conint(ge=1, le=10)), were refused by name. Each regex is checked
against a reference of its own: Python's int / Decimal / float comparisons of the text's value
with the bound, both as the bound is written (a float as its repr) and as json.loads reads the
text, through Python's re.fullmatch and the automaton (regex_fsm.RegexDFA). additionalProperties
given as a schema is taken: only the listed properties are ever written."""

from __future__ import annotations

import json
import math
import operator
import re
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from minivllm import SamplingParams
from minivllm.runtime.guide import schema_regex
from minivllm.runtime.regex_fsm import RegexDFA
from minivllm.runtime.sampling_params import StructuredOutputsParams

_JSON_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
_JSON_PLAIN_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?")
_NOT_JSON = ["01", "-0", "+1", "1.0", "00", "-01", "1e1", " 1", "1 ", "", "-", "1.", ".5", "0x1",
             "--1"]


def _written(b) -> Decimal:
    return Decimal(repr(b)) if isinstance(b, float) else Decimal(b)


def _within(text: str, schema: dict) -> bool:
    """Whether a JSON number text satisfies the schema's bounds: its value as Python reads it
    (json.loads: an int, or a double) compared with the bound as Python compares them (an int
    with a float exactly), and its decimal value compared with the bound as written."""
    value, exact = json.loads(text), Decimal(text)
    for key, op in (("minimum", operator.ge), ("exclusiveMinimum", operator.gt),
                    ("maximum", operator.le), ("exclusiveMaximum", operator.lt)):
        if key in schema and not (op(value, schema[key]) and op(exact, _written(schema[key]))):
            return False
    return True


def _matchers(schema):
    pattern = StructuredOutputsParams(json=schema).pattern
    dfa = RegexDFA(pattern)
    return pattern, lambda text: (bool(re.fullmatch(pattern, text)), dfa.fullmatch(text))


# -- integers ----------------------------------------------------------------------------------

_INT_BOUND = st.one_of(
    st.integers(-300, 300),
    st.integers(-10 ** 40, 10 ** 40),
    st.integers(0, 40).map(lambda k: 10 ** k), st.integers(0, 40).map(lambda k: -10 ** k),
    st.integers(1, 40).map(lambda k: 10 ** k - 1),
    st.integers(-300, 300).map(lambda i: i + 0.5),
    st.floats(-1e6, 1e6, allow_nan=False),
    st.sampled_from([0.0, -0.0, 1e30, -1e30, 2.0 ** 63, 0.1, -0.1, 9007199254740993]))


@st.composite
def _bounded_schemas(draw, kind: str, bound):
    keys = draw(st.sets(st.sampled_from(["minimum", "exclusiveMinimum", "maximum",
                                         "exclusiveMaximum"]), min_size=1))
    schema = {"type": kind}
    for key in sorted(keys):
        schema[key] = draw(bound)
    if draw(st.booleans()) and {"minimum", "maximum"} <= keys:  # equal bounds: one value
        schema["maximum"] = schema["minimum"]
    return schema


def _integer_schemas():
    return _bounded_schemas("integer", _INT_BOUND)


def _integer_candidates(schema, extra) -> set[int]:
    out = {0, 1, -1, 10, -10, *extra}
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        if key in schema:
            b = math.floor(schema[key])
            out |= {b + d for d in range(-12, 13)}
            out |= {b * 10, b // 10, -b, b * 10 + 7, 2 * b, b + 10 ** 6, b - 10 ** 6}
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@example({"type": "integer", "minimum": -10 ** 30, "maximum": 10 ** 30}, [])
@example({"type": "integer", "minimum": 1.5}, [])
@example({"type": "integer", "exclusiveMinimum": 2.0, "exclusiveMaximum": 7}, [])
@example({"type": "integer", "maximum": 1e30}, [10 ** 30, 10 ** 30 + 1])
@example({"type": "integer", "minimum": 7, "maximum": 7}, [])
@example({"type": "integer", "minimum": -0.5, "maximum": 0.5}, [])
@given(_integer_schemas(), st.lists(st.integers(-10 ** 45, 10 ** 45), max_size=20))
def test_an_integer_range_admits_exactly_the_integers_within_it(schema, extra):
    candidates = _integer_candidates(schema, extra)  # each bound's neighbours among them
    try:
        pattern, match = _matchers(schema)
    except ValueError as e:  # only an empty range: named by its keywords
        assert "no integer is within them" in str(e) and "imum" in str(e), e
        assert not any(_within(str(x), schema) for x in candidates)
        return
    for x in candidates:
        want = _within(str(x), schema)
        assert match(str(x)) == (want, want), (schema, x, pattern[:200])
    for text in _NOT_JSON:
        assert match(text) == (False, False), (schema, text)
    assert len(pattern) < 20_000


def test_an_integer_ranges_regex_grows_with_the_digits_not_the_values():
    """-10**30 .. 10**30 is 2 * 10**30 + 1 integers but a few alternatives per digit."""
    pattern = schema_regex({"type": "integer", "minimum": -10 ** 30, "maximum": 10 ** 30})
    assert len(pattern) < 200, pattern
    odd = schema_regex({"type": "integer", "minimum": -(10 ** 30 + 12345678901234567),
                        "maximum": 31415926535897932384626433832795028})
    assert len(odd) < 4000
    dfa = RegexDFA(odd)
    assert dfa.fullmatch("31415926535897932384626433832795028")
    assert not dfa.fullmatch("31415926535897932384626433832795029")
    assert dfa.fullmatch(str(-(10 ** 30 + 12345678901234567)))
    assert not dfa.fullmatch(str(-(10 ** 30 + 12345678901234568)))


@pytest.mark.parametrize("schema, yes, no", [
    ({"type": "integer", "minimum": 0}, ["0", "7", "10", "123456789012345678901234567890"],
     ["-1", "-0", "01", "+1", "1.0"]),
    ({"type": "integer", "minimum": 1, "maximum": 10}, ["1", "5", "10"], ["0", "11", "100"]),
    ({"type": "integer", "exclusiveMinimum": 0}, ["1", "99"], ["0", "-0", "-1"]),
    ({"type": "integer", "exclusiveMaximum": 0}, ["-1", "-100"], ["0", "-0", "1"]),
    ({"type": "integer", "minimum": 1.5, "maximum": 3.5}, ["2", "3"], ["1", "4", "2.5"]),
    ({"type": "integer", "exclusiveMinimum": 1.5, "exclusiveMaximum": 3.0}, ["2"], ["1", "3"]),
    ({"type": "integer", "minimum": -3, "maximum": -3}, ["-3"], ["3", "-4", "-2", "-03"]),
    ({"type": ["integer", "null"], "minimum": 2}, ["2", "null"], ["1"]),
])
def test_chosen_integer_bounds(schema, yes, no):
    _, match = _matchers(schema)
    for text in yes:
        assert match(text) == (True, True), text
    for text in no:
        assert match(text) == (False, False), text


# -- numbers -----------------------------------------------------------------------------------

_NUMBER_BOUND = st.one_of(
    st.integers(-300, 300),
    st.integers(-10 ** 20, 10 ** 20),
    st.floats(-1e6, 1e6, allow_nan=False),
    st.floats(-1.0, 1.0, allow_nan=False),
    st.integers(-3000, 3000).map(lambda i: i / 100),
    st.sampled_from([0, 0.0, 0.1, 0.5, 1e-7, -1e-7, 1e20, 0.3, 2.675, 1e15 + 0.5]))


def _number_schemas():
    return _bounded_schemas("number", _NUMBER_BOUND)


def _plain(d: Decimal) -> str:
    """A Decimal as a JSON number without exponent (no trailing '.', no '+')."""
    text = f"{d:f}"
    return text[:-1] if text.endswith(".") else text


def _number_candidates(schema, extra) -> set[str]:
    out = {"0", "0.0", "1", "-1", "0.5", "-0.5", *(_plain(d) for d in extra)}
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        if key not in schema:
            continue
        b = schema[key]
        w = _written(b)
        out |= {_plain(w), _plain(w) + ("0" if "." in _plain(w) else ".0"), _plain(-w)}
        out.add(_plain(Decimal(float(b))))  # the double's own value, all its digits
        for toward in (math.inf, -math.inf):
            out.add(_plain(Decimal(repr(math.nextafter(float(b), toward)))))
        exponent = w.adjusted() if w else 0
        for k in range(0, 20):
            step = Decimal(1).scaleb(exponent - k)
            out |= {_plain(w + step), _plain(w - step)}
    return out


def _ordinary(text: str) -> bool:
    """A text whose decimal value and double agree on every comparison: at most 15 significant
    digits (two such decimals are two doubles) and no subnormal magnitude; not a -0."""
    d = Decimal(text)
    digits = len(d.normalize().as_tuple().digits)
    negative_zero = text.startswith("-") and d == 0
    return not negative_zero and digits <= 15 and (d == 0 or 1e-300 < abs(d) < 1e300)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@example({"type": "number", "minimum": 0}, [])
@example({"type": "number", "exclusiveMinimum": 0}, [Decimal("1e-330"), Decimal("3e-324")])
@example({"type": "number", "exclusiveMinimum": 0.5}, [Decimal("0.50000000000000001")])
@example({"type": "number", "minimum": 0.1, "maximum": 0.75}, [])
@example({"type": "number", "minimum": -2.5, "exclusiveMaximum": 3}, [])
@example({"type": "number", "minimum": 1e20, "maximum": 1e20}, [])
@given(_number_schemas(),
       st.lists(st.decimals(-10 ** 7, 10 ** 7, allow_nan=False, allow_infinity=False, places=4)
                | st.decimals(-1, 1, allow_nan=False, allow_infinity=False, places=17),
                max_size=20))
def test_a_number_range_admits_only_numbers_within_it(schema, extra):
    """Every text admitted is a JSON number within the bounds, both as its decimal value and as
    the double json.loads reads (exclusiveMinimum 0.5 does not admit 0.50000000000000001, read
    as 0.5); every ordinary number within them (see _ordinary) is admitted, without exponent."""
    candidates = _number_candidates(schema, extra)
    try:
        pattern, match = _matchers(schema)
    except ValueError as e:  # an empty range, named by its keywords
        assert "no number is within them" in str(e) and "imum" in str(e), e
        assert not any(_within(t, schema) for t in candidates if _ordinary(t))
        return
    for text in candidates:
        assert _JSON_PLAIN_NUMBER.fullmatch(text), text  # the candidate itself is JSON
        got = match(text)
        assert got[0] == got[1], (schema, text)
        if got[0]:
            assert _within(text, schema), (schema, text, pattern[:300])
        elif _ordinary(text):
            assert not _within(text, schema), (schema, text, pattern[:300])
    for text in ["01", "+1", "1.", ".5", "00.5", "1e5", "-", ""]:
        assert match(text) == (False, False), (schema, text)


@pytest.mark.parametrize("schema, yes, no", [
    ({"type": "number", "minimum": 0}, ["0", "0.0", "3.25", "120"], ["-1", "-0.5", "1e5", "01"]),
    ({"type": "number", "exclusiveMinimum": 0}, ["0.001", "1", "0.5"], ["0", "0.0", "-0.1"]),
    ({"type": "number", "minimum": 0, "maximum": 1}, ["0", "0.25", "1", "1.000"],
     ["1.0001", "2", "-0.1"]),
    ({"type": "number", "minimum": 0.1, "maximum": 0.75}, ["0.1", "0.10", "0.5", "0.75"],
     ["0.09", "0.7501", "0.8", "1"]),
    ({"type": "number", "minimum": -1.5, "maximum": -1.5}, ["-1.5", "-1.50"], ["-1.4", "1.5"]),
    ({"type": "number", "exclusiveMaximum": -2}, ["-2.001", "-3"], ["-2", "-2.0", "-1"]),
    ({"type": ["number", "null"], "maximum": 10}, ["null", "10", "-7.5"], ["10.5"]),
])
def test_chosen_number_bounds(schema, yes, no):
    _, match = _matchers(schema)
    for text in yes:
        assert match(text) == (True, True), text
    for text in no:
        assert match(text) == (False, False), text


# -- refusals, enums, additionalProperties -----------------------------------------------------


@pytest.mark.parametrize("schema, match", [
    ({"type": "integer", "minimum": 5, "maximum": 3}, "minimum 5, maximum 3: no integer"),
    ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "no integer"),
    ({"type": "integer", "minimum": 1.2, "maximum": 1.8}, "no integer"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "no number"),
    ({"type": "number", "minimum": 2, "maximum": 1.5}, "no number"),
    # draft 4's boolean form (xgrammar: "Value must be a number")
    ({"type": "integer", "minimum": 0, "exclusiveMinimum": True}, "exclusiveMinimum must be a"),
    ({"type": "number", "maximum": "3"}, "maximum must be a finite number"),
    ({"type": "number", "maximum": float("inf")}, "maximum must be a finite number"),
    ({"type": "integer", "minimum": float("nan")}, "minimum must be a finite number"),
    ({"type": "integer", "minimum": 10 ** 100}, "more than 80 digits"),
    ({"type": "number", "maximum": 1e300}, "more than 80 digits"),
    ({"type": "number", "maximum": 10 ** 400}, "beyond a double"),
    ({"type": "integer", "minimum": 0, "multipleOf": 2}, r"\['multipleOf'\] not supported"),
    ({"type": "string", "minimum": 0}, r"\['minimum'\] not supported"),
    ({"type": "integer", "enum": [1, 2], "minimum": 3}, "all outside minimum 3"),
    ({"type": "object", "properties": {}, "additionalProperties": 3}, "additionalProperties"),
])
def test_bounds_that_admit_nothing_or_cannot_be_held_are_refused_by_name(schema, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(json=schema)


@pytest.mark.parametrize("schema, yes, no", [
    ({"type": "integer", "enum": [1, 5, 10], "minimum": 2}, ["5", "10"], ["1"]),
    ({"enum": [0.5, 1.5, "a", None], "exclusiveMaximum": 1}, ["0.5", '"a"', "null"], ["1.5"]),
    ({"type": "number", "const": 3, "maximum": 3}, ["3"], ["3.0", "2"]),
])
def test_bounds_beside_an_enum_keep_the_values_within_them(schema, yes, no):
    """JSON Schema: a value must satisfy both. xgrammar writes every enum value whatever the
    bounds; here the ones beyond them are dropped (a schema that keeps none is refused)."""
    _, match = _matchers(schema)
    for text in yes:
        assert match(text) == (True, True), text
    for text in no:
        assert match(text) == (False, False), text


def test_additional_properties_given_as_a_schema_is_taken():
    """Only the listed properties are written, so any additionalProperties holds; its schema is
    not compiled (one the regexes could not hold to is taken too)."""
    props = {"a": {"type": "integer", "minimum": 0}}
    base = schema_regex({"type": "object", "properties": props})
    for extra in ({"type": "string"}, {}, {"type": "object"}, {"format": "date"}):
        assert schema_regex({"type": "object", "properties": props,
                             "additionalProperties": extra}) == base
    dfa = RegexDFA(base)
    assert dfa.fullmatch('{"a": 3}') and not dfa.fullmatch('{"a": -3}')
    assert not dfa.fullmatch('{"a": 3, "b": "x"}')


def test_pydantic_style_schemas_are_taken():
    """What pydantic writes for conint(ge=1, le=10), Field(gt=0) on a float, and
    Field(ge=0, lt=1) (a probability)."""
    schema = {"title": "M", "type": "object", "properties": {
        "n": {"title": "N", "type": "integer", "minimum": 1, "maximum": 10},
        "price": {"title": "Price", "type": "number", "exclusiveMinimum": 0},
        "p": {"title": "P", "type": "number", "minimum": 0, "exclusiveMaximum": 1}},
        "required": ["n", "price", "p"]}
    _, match = _matchers(schema)
    assert match('{"n": 10, "price": 0.01, "p": 0.999}') == (True, True)
    for bad in ('{"n": 11, "price": 1, "p": 0}', '{"n": 1, "price": 0, "p": 0}',
                '{"n": 1, "price": 1, "p": 1}', '{"n": 1, "price": 1, "p": 1.0}'):
        assert match(bad) == (False, False), bad


# -- the engine ----------------------------------------------------------------------------------

BOUNDED = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": -5, "maximum": 12},
    "big": {"type": "integer", "exclusiveMinimum": 10 ** 20},
    "x": {"type": "number", "exclusiveMinimum": 0, "maximum": 2.5},
    "ys": {"type": "array", "items": {"type": "integer", "minimum": 3, "exclusiveMaximum": 7},
           "maxItems": 3}},
    "additionalProperties": {"type": "string"}}


def guided_texts(tmp_path_factory, device, schema: dict, prompts: list[str], *,
                 max_tokens: int, n: int, seed: int) -> list[str]:
    """The finished outputs of the engine's guided decoding on the demo model, sampled at
    temperature 1, each checked to fullmatch the schema's regex and to have stopped; each
    cut-short one checked to be a prefix the automaton still walks. At least one finishes."""
    from minivllm.runtime.demo import ensure_demo_model

    from engine_helpers import make_llm

    llm = make_llm(ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model")), device,
                   max_model_len=512)
    constraint = StructuredOutputsParams(json=schema)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, n=n, seed=seed,
                            structured_outputs=constraint)
    dfa, texts = RegexDFA(constraint.pattern), []
    for out in llm.generate(prompts, params, use_tqdm=False):
        for c in out.outputs:
            if c.finish_reason == "length":
                assert dfa.walk(dfa.start, c.text) != dfa.DEAD, c.text
                continue
            assert c.finish_reason == "stop" and re.fullmatch(constraint.pattern, c.text)
            texts.append(c.text)
    assert texts
    return texts


def test_guided_outputs_are_within_their_bounds(tmp_path_factory, device):
    """Through the engine's guided decoding on the demo model, sampled at temperature 1: each
    finished output parses and is within its bounds, each cut-short one is a prefix of one."""
    for text in guided_texts(tmp_path_factory, device, BOUNDED,
                             ["The quick brown fox", "Hello, my name is", "0"],
                             max_tokens=120, n=4, seed=5):
        value, exact = json.loads(text), json.loads(text, parse_float=Decimal)
        assert list(value) == ["n", "big", "x", "ys"]
        assert type(value["n"]) is int and -5 <= value["n"] <= 12
        assert type(value["big"]) is int and value["big"] > 10 ** 20
        assert 0 < value["x"] <= 2.5 and 0 < exact["x"] <= Decimal("2.5")
        assert len(value["ys"]) <= 3 and all(type(y) is int and 3 <= y < 7
                                             for y in value["ys"])


def test_a_guide_over_a_vocabulary_of_digit_pieces_spells_only_the_range():
    """At the token level (CompiledGuide over a byte-level vocabulary of digit pieces): a text
    tokenized any way ends accepted iff it is an integer within the bounds, and every state's
    allowed ids are the tokens that walk it."""
    from test_session51_mutants import ByteLevelTok

    from minivllm.runtime.guide import CompiledGuide, TokenIndex

    pieces = [b"-", *(str(d).encode() for d in range(10)), b"12", b"00", b"-1", b"99", b"."]
    index = TokenIndex(ByteLevelTok(pieces), len(pieces))
    schema = {"type": "integer", "minimum": -15, "exclusiveMaximum": 100}
    guide = CompiledGuide(schema_regex(schema), index, (len(pieces) + 1,))

    def texts(state, text, depth):
        yield state, text
        if depth:
            for i in sorted(guide.allowed(state, len(pieces) + 2)):
                if i < len(pieces):
                    after = guide.walk(state, index.bytes[i])
                    assert after is not None
                    yield from texts(after, text + index.bytes[i].decode(), depth - 1)

    seen = set()
    for state, text in texts(guide.start, "", 3):
        want = {i for i, b in index.bytes.items() if guide.walk(state, b) is not None}
        assert set(guide.allowed(state, len(pieces) + 2)) - {len(pieces) + 1} == want
        if guide.accepts(state):
            seen.add(text)
    assert seen == {str(x) for x in range(-15, 100)}
