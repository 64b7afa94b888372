"""Qwen3-Coder's XML tool calls (`--tool-call-parser qwen3_coder`, runtime/qwen3_coder_tools.py).

The expected messages are written by hand from the format and from the rules of vLLM 0.20's
Qwen3CoderToolParser.extract_tool_calls and its server's use of it (the module's docstring lists
them); the streamed split is checked against the whole-answer parse (hypothesis); the server end
to end on test_reasoning_tools' tiny checkpoint, its answer forced into the XML form by a
structured-output regex, against the LLM API's own completion of the same prompt."""

from __future__ import annotations

import argparse
import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from minivllm import SamplingParams
from minivllm.cli import build_parser
from minivllm.runtime import tool_calls
from minivllm.runtime.chat_output import ChatOutput, merge_deltas, message
from minivllm.runtime.qwen3_coder_tools import Qwen3CoderSplit, convert_value, parse_qwen3_coder
from minivllm.runtime.sampling_params import StructuredOutputsParams
from minivllm.runtime.server import OpenAIServer

from engine_helpers import make_llm, serving
from test_reasoning_tools import cut, functions, model_dir, streamed_message  # noqa: F401
from test_server import post, stream

PROPS = {"city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
         "metric": {"type": "boolean"}, "opts": {"type": "object"}, "hours": {"type": "array"},
         "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "unit": {"enum": ["C", "F"]}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": PROPS}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, CLOCK]
USER = [{"role": "user", "content": "What is the weather like in Paris?"}]


def call(name: str, **params: str) -> str:
    """A call as Qwen3-Coder's template writes it: each value on its own lines."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def args(content_calls) -> list:
    """(content, calls) with each call's arguments read back as objects."""
    content, calls = content_calls
    return [content, [(c["name"], json.loads(c["arguments"])) for c in calls]]


# -- whole answers -------------------------------------------------------------------------------


def test_the_formats_example_with_content_before():
    text = "Let me look.\n" + call("get_weather", city="Paris", days="3")
    content, calls = parse_qwen3_coder(text, TOOLS)
    assert content == "Let me look.\n"
    # The arguments are a JSON text, the parameters in their written order.
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}]


@pytest.mark.parametrize("name, written, value", [
    ("city", "3", "3"),  # a string stays text
    ("city", "  Paris  ", "  Paris  "),  # spaces are the value's
    ("city", "NULL", None),  # "null" in any case is null, even for a string (vLLM 0.20)
    ("city", "None", "None"),
    ("days", "7", 7), ("days", "-2", -2),
    ("days", "seven", "seven"), ("days", "2.5", "2.5"),  # not an int: the text
    ("temp", "2.5", 2.5), ("temp", "3.0", 3), ("temp", "1e2", 100),  # whole numbers as ints
    ("temp", "warm", "warm"), ("temp", "nan", "nan"),
    ("metric", "true", True), ("metric", "TRUE", True), ("metric", "yes", False),
    ("opts", '{"a": {"b": [1, null]}}', {"a": {"b": [1, None]}}),  # nested JSON
    ("opts", "{'a': True}", {"a": True}),  # a Python literal where JSON fails
    ("opts", "{a: 1}", "{a: 1}"),  # neither: the text
    # past json's recursion in any version (3.12 parses 5,000 levels): the text
    ("opts", "[" * 100_000 + "]" * 100_000, "[" * 100_000 + "]" * 100_000),
    ("hours", "[9, 12]", [9, 12]), ("hours", "(9, 12)", [9, 12]),  # a tuple: an array
    ("note", '{"x": 1}', {"x": 1}),  # anyOf without a type reads as an object
    ("note", "plain", "plain"),
    ("unit", "7", "7"),  # a schema without a "type" is a string
    ("wind", "7", "7"),  # a parameter the tool does not list keeps its text
])
def test_values_are_typed_by_the_tools_schema(name, written, value):
    assert json.loads(json.dumps(convert_value(written, name, PROPS))) == value
    _, calls = parse_qwen3_coder(call("get_weather", **{name: written}), TOOLS)
    assert json.loads(calls[0]["arguments"]) == {name: value}


def test_a_type_given_loosely_or_as_a_list():
    """vLLM reads the type's text lowercased by prefix ("int64", "Float"); a list of types is
    no name it knows: the value goes through ast.literal_eval."""
    props = {"a": {"type": "Int64"}, "b": {"type": "Float"}, "c": {"type": ["string", "null"]}}
    assert [convert_value(v, k, props) for k, v in [("a", "4"), ("b", "0.5"), ("c", "5"),
                                                    ("c", "Paris")]] == [4, 0.5, 5, "Paris"]


def test_newlines_strip_one_each_side():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\n\nParis\n\n</parameter>\n" \
           "<parameter=opts>{\"k\": 1}</parameter>\n</function>\n</tool_call>"
    assert args(parse_qwen3_coder(text, TOOLS)) == [
        None, [("get_weather", {"city": "\nParis\n", "opts": {"k": 1}})]]


def test_several_calls_in_blocks_and_in_one_block():
    text = call("get_weather", city="Rome") + "\n" + call("get_time") + \
        "\n<tool_call>\n<function=get_time>\n</function>\n<function=get_weather>\n" \
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    assert args(parse_qwen3_coder(text, TOOLS)) == [None, [
        ("get_weather", {"city": "Rome"}), ("get_time", {}), ("get_time", {}),
        ("get_weather", {"days": 2})]]


def test_unknown_functions_and_parameters_keep_their_text():
    text = call("get_rain", days="3", opts="{}") + call("get_weather", wind="null", days="1")
    assert args(parse_qwen3_coder(text, TOOLS)) == [None, [
        ("get_rain", {"days": "3", "opts": "{}"}), ("get_weather", {"wind": None, "days": 1})]]
    # Without tools (a request's tools are its own), every value is text.
    assert args(parse_qwen3_coder(call("get_weather", days="3"), None)) == [
        None, [("get_weather", {"days": "3"})]]


def test_unclosed_tags_read_to_the_end():
    """A completion that stopped (EOS, max_tokens) inside a call: the open value, function and
    block run to the end of the answer (a lazy `$` leaves a last newline out of the value)."""
    assert args(parse_qwen3_coder("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
                                  TOOLS)) == [None, [("get_weather", {"city": "Par"})]]
    assert args(parse_qwen3_coder(
        "hm <tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n", TOOLS)) == \
        ["hm ", [("get_weather", {"days": 4})]]
    # A missing </parameter> ends at the next <parameter= or at </function>.
    assert args(parse_qwen3_coder(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n5\n"
        "</function>\n</tool_call>", TOOLS)) == [None, [("get_weather", {"city": "Rome",
                                                                         "days": 5})]]


def test_a_bare_function_without_tool_call_tags_is_a_call():
    assert args(parse_qwen3_coder("ok: <function=get_time>\n</function>", TOOLS)) == [
        "ok: ", [("get_time", {})]]


def test_what_after_the_calls_and_whitespace_before_them_are_not_content():
    text = " \n\n" + call("get_time") + "\nDone, I think."
    assert parse_qwen3_coder(text, TOOLS) == (None, [{"name": "get_time", "arguments": "{}"}])


@pytest.mark.parametrize("text", [
    "no call here, just <b>text</b>",
    "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",  # hermes: no XML
    "<tool_call>\n<function=get_weather",  # the name never closed: no call
    "x <tool_call>\n</tool_call> <function=get_time>\n</function>",  # outside the block
    # A parameter tag without its ">" (vLLM's parser raises): none of the calls.
    call("get_time") + "<tool_call>\n<function=get_weather>\n<parameter=cit",
    # Values JSON cannot carry (vLLM's parser fails on them): an infinite whole number, a set.
    call("get_weather", temp="inf"), call("get_weather", opts="{1, 2}"),
])
def test_an_answer_without_a_readable_call_is_all_content(text):
    assert parse_qwen3_coder(text, TOOLS) == (text, [])


# -- streaming: the split as it comes equals the whole answer's -------------------------------

VALUES = st.sampled_from(["Paris", "3", "2.5", "true", "null", '{"a": [1]}', "[1, 2]", "", "\n",
                          "a<b", "</parameter", "é"])
CALL = st.tuples(st.sampled_from(["get_weather", "get_time", "other"]),
                 st.dictionaries(st.sampled_from(list(PROPS) + ["x"]), VALUES, max_size=3))


@settings(max_examples=300, deadline=None)
@given(st.text(" \nab<", max_size=6), st.lists(CALL, max_size=3), st.sampled_from(
    ["", "\n", " tail", "<function=", "<tool_call>", "</tool_call>"]), st.integers(0, 40),
       st.lists(st.integers(0, 400), max_size=12))
def test_a_streamed_answer_ends_as_the_whole_one(prefix, calls, tail, cut_off, points):
    """Content before the calls as it comes, then the calls; the answer may stop anywhere in
    its last `cut_off` characters (EOS or max_tokens inside a call). Fed in any pieces, what is
    sent and then finished equals the whole answer's parse."""
    text = prefix + "\n".join(call(n, **p) for n, p in calls) + tail
    text = text[:len(text) - cut_off] if calls else text
    split = Qwen3CoderSplit(TOOLS)
    sent = "".join(split.feed(piece) for piece in cut(text, points))
    rest, got = split.finish()
    content, want = parse_qwen3_coder(text, TOOLS)
    assert (sent + rest, got) == (content or "", want)
    # Nothing is sent that a later tag could make part of a call.
    assert "<tool_call>" not in sent and "<function=" not in sent


def test_content_streams_before_the_calls_come():
    split = Qwen3CoderSplit(TOOLS)
    assert [split.feed(p) for p in ["  ", "Sure", ", <tool", "_call>\n<function=get_time>"]] == \
        ["", "  Sure", ", ", ""]
    assert split.finish() == ("", [{"name": "get_time", "arguments": "{}"}])
    whitespace_only = Qwen3CoderSplit(TOOLS)
    assert whitespace_only.feed("\n\n") == ""  # held: it is no content if a call follows
    assert whitespace_only.finish() == ("\n\n", [])


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["plain", "Let me see. " + call("get_weather", city="Rome", days="2"),
                        call("get_time") + call("other", x="1"), " \n" + call("get_time"),
                        "<tool_call>\n<function=get_weather"]),
       st.booleans(), st.lists(st.integers(0, 200), max_size=8))
def test_a_streamed_chat_message_equals_the_whole_one(text, parallel, points):
    parser = ChatOutput(None, "auto", parallel_tool_calls=parallel, tool_parser="qwen3_coder",
                        tools=TOOLS)
    deltas = [parser.feed(piece) for piece in cut(text, points)] + [parser.finish()]
    streamed = merge_deltas(deltas)
    whole = message(ChatOutput(None, "auto", parallel_tool_calls=parallel,
                               tool_parser="qwen3_coder", tools=TOOLS), text)
    assert streamed.get("content") == (whole["content"] or None)
    assert functions(streamed.get("tool_calls")) == functions(whole.get("tool_calls"))
    content, calls = parse_qwen3_coder(text, TOOLS)
    assert functions(whole.get("tool_calls")) == (calls if parallel else calls[:1])
    assert whole["content"] == (content if calls else text)


# -- bad input -----------------------------------------------------------------------------------


def test_unknown_parser_names_list_the_choices():
    with pytest.raises(ValueError, match=re.escape("['hermes', 'qwen3_coder']")):
        tool_calls.check_parser("qwen3_xml")
    with pytest.raises(ValueError, match=re.escape("['hermes', 'qwen3_coder']")):
        tool_calls.answer_split("mistral", TOOLS)
    # The CLI offers the same names (it does not import the runtime to list them).
    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flag = next(a for a in serve.choices["serve"]._actions if "--tool-call-parser" in
                a.option_strings)
    assert tuple(flag.choices) == tool_calls.PARSERS
    assert build_parser().parse_args(["serve", "--tool-call-parser", "qwen3_coder"]
                                     ).tool_call_parser == "qwen3_coder"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "qwen3_xml"])


# -- the server ----------------------------------------------------------------------------------

# The answer the regex holds the tiny model's greedy completion to: content, then one call.
CALL_REGEX = (r"Let me check\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
              r"(Paris|Rome)\n</parameter>\n<parameter=days>\n[1-9]\n</parameter>\n"
              r"<parameter=metric>\n(true|false)\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def llm(model_dir, device):  # noqa: F811 (the imported fixture)
    return make_llm(model_dir, device, max_model_len=1024)


@pytest.fixture(scope="module")
def server(llm):
    srv = OpenAIServer(llm, port=0, model_name="tiny", enable_auto_tool_choice=True,
                       tool_call_parser="qwen3_coder")
    with serving(srv):
        yield srv


def test_the_server_reads_xml_calls_typed_by_the_requests_tools(server, llm):
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 200,
            "chat_template_kwargs": {"enable_thinking": False},
            "structured_outputs": {"regex": CALL_REGEX}}
    text = llm.chat(USER, SamplingParams(
        temperature=0, max_tokens=200, skip_special_tokens=False,
        structured_outputs=StructuredOutputsParams(regex=CALL_REGEX)), tools=TOOLS,
        chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0].outputs[0].text
    city, days, metric = re.fullmatch(
        r"(?s).*<parameter=city>\n(\w+)\n.*<parameter=days>\n(\d)\n.*<parameter=metric>\n(\w+)\n.*",
        text).groups()
    status, whole = post(server, "/v1/chat/completions", body)
    assert status == 200, whole
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check.\n"
    typed = {"city": city, "days": int(days), "metric": metric == "true"}
    assert functions(choice["message"]["tool_calls"]) == [
        {"name": "get_weather", "arguments": json.dumps(typed)}]
    assert choice["message"]["tool_calls"][0]["id"].startswith("chatcmpl-tool-")  # as hermes'
    events = stream(server, "/v1/chat/completions", body)
    merged, reasons = streamed_message(events)
    assert merged["content"] == "Let me check.\n" and reasons == ["tool_calls"]
    assert functions(merged["tool_calls"]) == functions(choice["message"]["tool_calls"])
    # The content came before the answer ended, and the call's parameters one by one as they
    # closed, before the last chunk: its name and "{" first, then each '"name": value'.
    early = [c["delta"] for ev in events[1:] for c in ev["choices"] if not c["finish_reason"]]
    assert "".join(d.get("content", "") for d in early) == "Let me check.\n"
    pieces = [p["function"] for d in early for p in d.get("tool_calls", ())]
    assert pieces[0] == {"name": "get_weather", "arguments": "{"}
    assert [p["arguments"] for p in pieces[1:4]] == [
        f'"city": "{city}"', f', "days": {days}', f', "metric": {metric}']


def test_the_server_without_the_tools_schema_keeps_text(server):
    """The types come from the request's own tools: a tool without parameters leaves "3"."""
    bare = [{"type": "function", "function": {"name": "get_weather"}}]
    _, whole = post(server, "/v1/chat/completions", {
        "messages": USER, "tools": bare, "max_tokens": 200,
        "chat_template_kwargs": {"enable_thinking": False},
        "structured_outputs": {"regex": CALL_REGEX}})
    got = json.loads(whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    assert isinstance(got["days"], str) and got["metric"] in ("true", "false")


def test_required_stays_json_constrained_with_this_parser(server):
    """vLLM's qwen3_coder parser supports "required" and named choices the standard way: JSON
    held by structured outputs, read without the parser (so no XML here)."""
    body = {"messages": USER, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}, "max_tokens": 40}
    _, whole = post(server, "/v1/chat/completions", body)
    c = whole["choices"][0]
    assert functions(c["message"]["tool_calls"]) == [{"name": "get_time", "arguments": "{}"}]
    assert c["message"]["content"] == "" and c["finish_reason"] == "stop"


def test_the_server_refuses_an_unknown_parser(llm):
    with pytest.raises(ValueError, match=re.escape("one of ['hermes', 'qwen3_coder']")):
        OpenAIServer(llm, port=0, enable_auto_tool_choice=True, tool_call_parser="qwen3coder")
