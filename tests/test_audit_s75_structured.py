"""Structured outputs audit (session 75): JSON schemas whose keywords contradict each other are
refused by name before any work, as the bad constraints of test_structured_outputs.py are."""

import re

import pytest

from minivllm.runtime.guide import schema_regex
from minivllm.runtime.regex_fsm import RegexDFA
from minivllm.runtime.sampling_params import StructuredOutputsParams


@pytest.mark.parametrize("schema", [
    {"const": "a", "enum": ["b"]},
    {"enum": ["x", "y"], "const": "z", "type": "string"},
    {"const": True, "enum": [1]},  # true is not 1 in JSON
    {"const": [1, 2], "enum": [[2, 1]]},
])
def test_a_const_outside_its_enum_is_refused(schema):
    """Both const and enum: the value must be among the enum's values too. A const outside them
    admits nothing; it was taken alone (the enum ignored), so the output, the const, broke the
    enum."""
    with pytest.raises(ValueError, match="const .* is not among the enum values"):
        StructuredOutputsParams(json=schema)


@pytest.mark.parametrize("schema, yes, no", [
    ({"enum": ["a", "b"], "const": "b"}, ['"b"'], ['"a"']),
    ({"const": 1, "enum": [1.0, 2]}, ["1"], ["2", "1.0"]),  # equal numbers: the const is written
    ({"const": {"k": [1]}, "enum": [{"k": [1.0]}, None]}, ['{"k": [1]}'], ["null"]),
])
def test_a_const_among_its_enum_is_the_only_value(schema, yes, no):
    dfa = RegexDFA(schema_regex(schema))
    assert all(dfa.fullmatch(t) for t in yes) and not any(dfa.fullmatch(t) for t in no)


def test_a_string_schema_whose_max_length_is_below_its_min_length_is_named():
    """As arrays' maxItems < minItems: named by the schema's keywords, not by the regex written
    for it ('min repeat greater than max repeat at position 39' of a pattern the user never
    wrote)."""
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(json={"type": "string", "minLength": 5, "maxLength": 2})
    assert "maxLength 2 < minLength 5" in str(e.value) and "repeat" not in str(e.value)
    with pytest.raises(ValueError, match=re.escape("maxLength 0 < minLength 1")):
        schema_regex({"type": "object", "properties": {
            "s": {"type": ["string", "null"], "minLength": 1, "maxLength": 0}}})
    dfa = RegexDFA(schema_regex({"type": "string", "minLength": 2, "maxLength": 2}))
    assert dfa.fullmatch('"ab"') and not dfa.fullmatch('"a"') and not dfa.fullmatch('"abc"')


def test_a_tools_required_parameters_without_properties_are_refused():
    """{"type": "object", "required": ["a"]} with no properties was held to the empty object,
    which its own required breaks: a constrained answer that could never satisfy its schema."""
    from minivllm.runtime.tool_calls import choice_schema

    def tool(params):
        return {"type": "function", "function": {"name": "f", "parameters": params}}

    bad = tool({"type": "object", "required": ["a"]})
    for choice in ("function:f", "required"):
        with pytest.raises(ValueError, match=r"tool 'f': its parameters require \['a'\]"):
            choice_schema(choice, [bad])
    assert choice_schema("function:f", [tool({"type": "object"})]) == \
        {"type": "object", "properties": {}}  # no required: a function without arguments
