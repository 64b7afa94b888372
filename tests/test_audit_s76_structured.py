"""Structured outputs audit (session 76): JSON schemas vLLM (xgrammar) takes that were refused or
written unlike it, bad schemas that crashed instead of being named, and regex anchors. Each is
checked against a reference of its own: a JSON Schema validator written here for the subset
(draft 2020-12's rules: 1.0 is an integer, numbers compare by value, true is not 1), Python's
json, and re.fullmatch."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from minivllm.runtime.regex_fsm import RegexDFA
from minivllm.runtime.sampling_params import StructuredOutputsParams

# -- the reference: JSON Schema's rules for the subset, written apart from guide.py ---------------


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_integer(v) -> bool:  # draft 6 on: a number whose fraction is zero
    return _is_number(v) and (isinstance(v, int) or math.isfinite(v) and v == int(v))


_TYPES = {"string": lambda v: isinstance(v, str), "integer": _is_integer, "number": _is_number,
          "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
          "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict)}


def _equal(a, b) -> bool:
    if _is_number(a) and _is_number(b):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _ref(ref: str, root: dict):
    _, section, name = ref.split("/")
    name = name.replace("%20", " ").replace("~1", "/").replace("~0", "~")
    return root[section][name]


def valid(v, schema, root=None) -> bool:
    """Whether the JSON value v is valid against `schema` (the keywords the subset takes)."""
    root = schema if root is None else root
    if isinstance(schema, bool):
        return schema
    if "$ref" in schema and not valid(v, _ref(schema["$ref"], root), root):
        return False
    t = schema.get("type")
    if t is not None and not any(_TYPES[k](v) for k in (t if isinstance(t, list) else [t])):
        return False
    if "enum" in schema and not any(_equal(v, e) for e in schema["enum"]):
        return False
    if "const" in schema and not _equal(v, schema["const"]):
        return False
    if "anyOf" in schema and not any(valid(v, s, root) for s in schema["anyOf"]):
        return False
    if "oneOf" in schema and sum(valid(v, s, root) for s in schema["oneOf"]) != 1:
        return False
    if "allOf" in schema and not all(valid(v, s, root) for s in schema["allOf"]):
        return False
    if isinstance(v, str) and not (schema.get("minLength", 0) <= len(v)
                                   <= schema.get("maxLength", math.inf)):
        return False
    if isinstance(v, list):
        if not schema.get("minItems", 0) <= len(v) <= schema.get("maxItems", math.inf):
            return False
        if "items" in schema and not all(valid(x, schema["items"], root) for x in v):
            return False
    if isinstance(v, dict):
        props = schema.get("properties", {})
        if any(r not in v for r in schema.get("required", ())):
            return False
        for k, x in v.items():
            if k in props and not valid(x, props[k], root):
                return False
            if k not in props and schema.get("additionalProperties", True) is False:
                return False
    return True


def dfa_of(schema) -> RegexDFA:
    return RegexDFA(StructuredOutputsParams(json=schema).pattern)


def check(schema, yes, no):
    """The schema's automaton takes each text of `yes` (each a JSON text valid against the
    schema) and none of `no`."""
    dfa = dfa_of(schema)
    for text in yes:
        assert valid(json.loads(text), schema), text  # the case itself is right
        assert dfa.fullmatch(text), text
    for text in no:
        assert not dfa.fullmatch(text), text


# -- numbers: 1.0 is the integer 1 --------------------------------------------------------------


@pytest.mark.parametrize("schema, yes, no", [
    ({"type": "integer", "enum": [1.0]}, ["1"], ["1.0", "2"]),
    ({"type": "integer", "const": 2.0}, ["2"], ["2.0"]),
    ({"type": "integer", "const": -0.0}, ["0"], ["-0.0", "-0"]),
    ({"type": ["integer", "null"], "enum": [3.0, None]}, ["3", "null"], ["3.0"]),
    # an integer or a number: a whole float written as the integer, the others as they are
    ({"type": ["number", "integer"], "enum": [1.5, 2.0]}, ["1.5", "2"], ["1", "2.0"]),
    ({"type": "integer", "const": 1, "enum": [1.0, 2]}, ["1"], ["1.0", "2"]),
    ({"type": "integer", "enum": [float(2 ** 53)]}, [str(2 ** 53)], [f"{2 ** 53}.0"]),
    # 1e30 is not 10**30 as a double: written as the double is, still a whole number
    ({"type": "integer", "enum": [1e30]}, ["1e+30"], [str(int(1e30))]),
])
def test_an_integer_enum_or_const_takes_whole_floats(schema, yes, no):
    """JSON Schema (draft 6 on): 1.0 is the integer 1, and xgrammar takes it. It was refused
    ('values [1.0] are not all of type integer'); written now as the integer (1, not 1.0: a
    draft 4 validator or a strict int parser takes only that)."""
    check(schema, yes, no)


@pytest.mark.parametrize("schema", [{"type": "integer", "enum": [1.5]},
                                    {"type": "integer", "const": float("inf")},
                                    {"type": "integer", "enum": [True]}])
def test_an_integer_enum_of_no_whole_number_is_still_refused(schema):
    with pytest.raises(ValueError, match="not all of type integer|not JSON"):
        StructuredOutputsParams(json=schema)


# -- strings: written as their characters, as xgrammar writes them -------------------------------


def test_enum_const_and_property_names_are_written_as_their_characters():
    """An enum / const string and a property name were written with json.dumps' ASCII escapes:
    the model had to spell "caf\\u00e9" (and an emoji as a surrogate pair's two escapes) where
    xgrammar writes "café", the text any model writes. Now the characters themselves, but for
    JSON's own escapes (\\" \\\\ \\n ...)."""
    schema = {"type": "object", "properties": {
        "caf\u00e9": {"enum": ["gr\u00fcn", "\U0001F600", 'a"b\\', "\u2028"]},
        "k": {"const": "\n\x7f\t"}}}
    dfa = dfa_of(schema)
    for value in ["gr\u00fcn", "\U0001F600", 'a"b\\', "\u2028"]:
        text = json.dumps({"caf\u00e9": value, "k": "\n\x7f\t"}, ensure_ascii=False)
        assert dfa.fullmatch(text), text
        assert valid(json.loads(text), schema)
    assert not dfa.fullmatch(json.dumps({"caf\u00e9": "gr\u00fcn", "k": "\n\x7f\t"}))  # ASCII


def test_a_lone_surrogate_is_written_as_its_escape():
    """No UTF-8 text spells a lone surrogate: its \\u escape is the only way to write it."""
    dfa = dfa_of({"enum": ["a\ud800"]})
    assert dfa.fullmatch('"a\\ud800"') and json.loads('"a\\ud800"') == "a\ud800"


# -- pydantic's tagged unions --------------------------------------------------------------------

TAGGED = {  # pydantic 2's model_json_schema() of a field Union[Cat, Dog] with discriminator
    "$defs": {
        "Cat": {"properties": {"pet_type": {"const": "cat", "title": "Pet Type", "type": "string"},
                               "meows": {"title": "Meows", "type": "integer"}},
                "required": ["pet_type", "meows"], "title": "Cat", "type": "object"},
        "Dog": {"properties": {"pet_type": {"const": "dog", "title": "Pet Type", "type": "string"},
                               "barks": {"title": "Barks", "type": "number"}},
                "required": ["pet_type", "barks"], "title": "Dog", "type": "object"}},
    "properties": {"pet": {
        "discriminator": {"mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"},
                          "propertyName": "pet_type"},
        "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "title": "Pet"}},
    "required": ["pet"], "title": "Model", "type": "object"}


def test_a_pydantic_tagged_union_is_taken():
    """pydantic writes OpenAPI's "discriminator" beside a tagged union's oneOf. It asserts nothing
    the branches' consts do not (xgrammar ignores it); it was refused ("['discriminator'] not
    supported"), and with it every pydantic model holding a discriminated union."""
    check(TAGGED, ['{"pet": {"pet_type": "cat", "meows": 3}}',
                   '{"pet": {"pet_type": "dog", "barks": 0.5}}'],
          ['{"pet": {"pet_type": "cat", "barks": 0.5}}', '{"pet": {"pet_type": "dog"}}'])


def test_pydantics_own_schema_of_a_tagged_union_is_taken():
    pydantic = pytest.importorskip("pydantic")
    from typing import Literal, Union

    class Cat(pydantic.BaseModel):
        pet_type: Literal["cat"]
        meows: int

    class Dog(pydantic.BaseModel):
        pet_type: Literal["dog"]
        barks: float

    class Model(pydantic.BaseModel):
        pet: Union[Cat, Dog] = pydantic.Field(discriminator="pet_type")

    dfa = dfa_of(Model.model_json_schema())
    for text in ('{"pet": {"pet_type": "cat", "meows": 3}}',
                 '{"pet":{"pet_type":"dog","barks":1}}'):
        assert dfa.fullmatch(text) and Model.model_validate_json(text)


# -- bad schemas: named, not a crash ------------------------------------------------------------


@pytest.mark.parametrize("schema", [
    {"type": {}}, {"type": [["string"]]}, {"type": [{}]}, {"type": {}, "enum": [1]},
    {"type": [None, "string"], "const": "a"}, {"type": None}, {"type": "int"}, {"type": []},
])
def test_a_type_that_is_no_json_type_is_named(schema):
    """A type that is a dict or holds a list was a TypeError (unhashable type), out of
    StructuredOutputsParams (which answers only ValueError as a bad request)."""
    with pytest.raises(ValueError, match=r"JSON schema type .* is no JSON type"):
        StructuredOutputsParams(json=schema)


@pytest.mark.parametrize("schema, match", [
    ({"type": "object", "properties": {"a": True}}, r"true \(any JSON value\) is not supported"),
    ({"type": "array", "items": False}, "false admits no value"),
])
def test_boolean_schemas_are_named(schema, match):
    """JSON Schema's true / false: they were 'a JSON schema is an object, got True'."""
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(json=schema)


def test_a_too_large_count_is_named_by_its_keywords():
    """maxLength 123,456 (xgrammar takes it) expands past the regex's bound: the error said only
    'the regex expands to more than 100000 states', of a regex the user never wrote."""
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(json={"type": "string", "maxLength": 123_456})
    assert "123456" in str(e.value) and "maxLength" in str(e.value)


# -- $ref ----------------------------------------------------------------------------------------


def test_refs_resolve_in_their_own_section():
    """#/definitions/A and #/$defs/A are two schemas: definitions' A was $defs' A (the two were
    merged into one dict, $defs winning)."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#/definitions/A"},
                                               "b": {"$ref": "#/$defs/A"}},
              "definitions": {"A": {"type": "integer"}}, "$defs": {"A": {"type": "null"}}}
    check(schema, ['{"a": 1, "b": null}'], ['{"a": null, "b": null}', '{"a": 1, "b": 1}'])


@pytest.mark.parametrize("ref, name", [("#/$defs/a~1b", "a/b"), ("#/$defs/a~0b", "a~b"),
                                       ("#/$defs/a%20b", "a b"), ("#/definitions/x~01", "x~1")])
def test_a_refs_name_is_a_json_pointer_token(ref, name):
    """A $ref is a URI fragment holding a JSON pointer: %-escapes, then ~1 (/) and ~0 (~)."""
    section = ref.split("/")[1]
    check({"$ref": ref, section: {name: {"type": "null"}}}, ["null"], ["1"])


def test_a_ref_to_a_path_or_a_missing_name_is_refused():
    for schema in ({"$ref": "#/$defs/A/b", "$defs": {"A": {"type": "null"}}},
                   {"$ref": "#/definitions/A", "$defs": {"A": {"type": "null"}}}):
        with pytest.raises(ValueError, match=r"\$ref"):
            StructuredOutputsParams(json=schema)


# -- regex anchors --------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", [r"^a$|^b$", r"^yes$|^no$|^n/a$", r"(^a|b)c", r"^a|b$",
                                     r"(?:^[0-9]+$|^none$)", r"^^a$$", r"^$", r"(?P<x>^ab$)|c"])
def test_anchors_at_each_alternatives_ends_are_taken(pattern):
    """^ / $ hold at the start / end of each alternative under fullmatch (xgrammar drops them):
    '^a$|^b$' was refused ('^ is supported at the pattern's start only')."""
    dfa = RegexDFA(pattern)
    for text in ["a", "b", "c", "ac", "bc", "ab", "", "yes", "no", "n/a", "12", "none", "a\n"]:
        assert dfa.fullmatch(text) == bool(re.fullmatch(pattern, text)), text
    assert StructuredOutputsParams(regex=pattern).pattern == pattern


@pytest.mark.parametrize("pattern, anchor", [("a^b", "^"), ("(a$|b)c", "$"), ("(^a)*", "^"),
                                             ("a$b", "$"), ("^a|b^", "^"), ("x(^a)", "^"),
                                             ("a?^b", "^")])
def test_anchors_where_something_may_come_around_them_are_refused(pattern, anchor):
    with pytest.raises(ValueError, match=re.escape(anchor) + " is supported only where"):
        RegexDFA(pattern)


_ATOMS = st.sampled_from(["a", "b", "[ab]", ".", "^", "$", "a?", "(?:a|b)"])


def _anchored_regexes():
    def extend(inner):
        return st.one_of(st.tuples(inner, inner).map("".join),
                         st.tuples(inner, inner).map(lambda t: f"(?:{t[0]}|{t[1]})"),
                         st.tuples(inner, inner).map(lambda t: f"{t[0]}|{t[1]}"),
                         inner.map(lambda r: f"(?:{r})*"))
    return st.recursive(_ATOMS, extend, max_leaves=6)


@settings(max_examples=300, deadline=None)
@example("^a$|^b$", ["a", "b", "ab"])
@given(_anchored_regexes(), st.lists(st.text(alphabet="ab\n", max_size=4), max_size=8))
def test_an_anchored_regex_is_refused_or_means_what_re_fullmatch_does(pattern, texts):
    try:
        dfa = RegexDFA(pattern)
    except ValueError as e:
        assert "supported only where" in str(e) or "repeat" in str(e), e
        return
    for text in texts:
        assert dfa.fullmatch(text) == bool(re.fullmatch(pattern, text)), (pattern, text)


# -- every output the automaton takes is valid: random schemas, random walks ---------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-99, 99)
    | st.floats(-4, 4, allow_nan=False).map(lambda f: round(f, 1))
    | st.text(alphabet='ab"\\/\n\t\x7f\u00e9\u2028\U0001F600', max_size=3),
    lambda c: st.lists(c, max_size=2) | st.dictionaries(st.text("a\u00e9\"", max_size=2), c,
                                                        max_size=2),
    max_leaves=4)


def _leaves():
    strings = st.builds(lambda lo, span: {"type": "string", "minLength": lo}
                        | ({} if span is None else {"maxLength": lo + span}),
                        st.integers(0, 2), st.none() | st.integers(0, 3))
    whole = st.integers(-50, 50).map(float)
    return st.one_of(
        strings,
        st.sampled_from([{"type": "integer"}, {"type": "number"}, {"type": "boolean"},
                         {"type": "null"}, {"type": ["string", "null"]},
                         {"type": ["integer", "boolean"]}]),
        st.lists(_JSON, min_size=1, max_size=3).map(lambda v: {"enum": v}),
        _JSON.map(lambda v: {"const": v}),
        st.lists(whole | st.integers(-5, 5), min_size=1, max_size=3)
        .map(lambda v: {"type": "integer", "enum": v}),
        st.lists(whole | st.floats(-2, 2, allow_nan=False), min_size=1, max_size=3)
        .map(lambda v: {"type": ["integer", "number"], "enum": v}))


def _containers(inner):
    names = st.text(alphabet='ab"\u00e9\\', min_size=1, max_size=2)

    def obj(props):
        return st.builds(lambda req, extra: {"type": "object", "properties": props,
                                             "required": [p for p in props if p in req],
                                             "additionalProperties": extra},
                         st.sets(st.sampled_from(sorted(props) or ["-"])), st.booleans())
    return st.one_of(
        st.builds(lambda item, lo, span: {"type": "array", "items": item, "minItems": lo}
                  | ({} if span is None else {"maxItems": lo + span}),
                  inner, st.integers(0, 2), st.none() | st.integers(0, 2)),
        st.dictionaries(names, inner, max_size=3).flatmap(obj),
        st.lists(inner, min_size=1, max_size=3).map(lambda o: {"anyOf": o}),
        inner.map(lambda s: {"$ref": "#/$defs/x~1y", "$defs": {"x/y": s}}))


def _walk(dfa: RegexDFA, alphabet: list[str], rnd: random.Random) -> str | None:
    """A random text the automaton takes (None if the walk found none): a character it takes
    at each step, ended at an accepting state by a coin."""
    state, text = dfa.start, []
    for _ in range(300):
        if dfa.accepts(state) and rnd.random() < 0.3:
            return "".join(text)
        moves = [(c, dfa.step(state, c)) for c in alphabet]
        moves = [(c, s) for c, s in moves if s != dfa.DEAD]
        if not moves:
            break
        c, state = rnd.choice(moves)
        text.append(c)
    return "".join(text) if dfa.accepts(state) else None


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.recursive(_leaves(), _containers, max_leaves=6), st.randoms(use_true_random=False))
def test_every_text_the_automaton_takes_is_valid_json_of_the_schema(schema, rnd):
    """The invariant behind structured outputs: whatever the model is let to write parses with
    json.loads and is valid against the schema (the validator above, not guide.py's)."""
    try:
        dfa = dfa_of(schema)
    except ValueError as e:  # only a nested $defs (the one-schema wrappers are not at the root)
        assert "$ref" in str(e), e
        return
    alphabet = sorted(set(' "\\/{}[],:-+.0123456789eEtrufalsnb')
                      | set(json.dumps(schema, ensure_ascii=False)))
    for _ in range(4):
        text = _walk(dfa, alphabet, rnd)
        if text is not None:
            assert valid(json.loads(text), schema), (schema, text)


_GARBAGE_KEYS = ["type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
                 "definitions", "properties", "required", "additionalProperties", "items",
                 "minItems", "maxItems", "minLength", "maxLength", "title", "a"]
_GARBAGE = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats()
    | st.sampled_from(["string", "integer", "object", "array", "null", "#/$defs/a", "a", "#"]),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(_GARBAGE_KEYS), c,
                                                        max_size=4),
    max_leaves=10)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@example({"type": {}})
@example({"type": [[1], {}]})
@given(_GARBAGE)
def test_any_schema_is_taken_or_refused_with_a_value_error(schema):
    try:
        StructuredOutputsParams(json=schema)
    except ValueError:
        pass
