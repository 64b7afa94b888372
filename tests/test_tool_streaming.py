"""Tool calls streamed as they are generated (`"stream": true` with tool_choice "auto"), as vLLM's
server streams them: a call's first delta its index, id, type and name, then pieces of its
arguments, the end sending what the whole answer's parse has beyond them.

Checked against the whole response (runtime/chat_output.message, whose results the earlier tests
fix to vLLM's non-streaming parsers) over generated answers cut anywhere (hypothesis): each
call's pieces join to the whole call's arguments exactly, its name and id come once, in its
first delta, the content joins to the whole content, the finish reason is "tool_calls" where
calls were made; an answer that turns out no call after a call began streaming (broken, cut
short) keeps its content as the whole response's. Then the server end to end on
test_reasoning_tools' tiny checkpoint: the SSE chunks of a call forced by a structured-output
regex, n=2 choices, against the whole response."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from minivllm.runtime import openai_api as api
from minivllm.runtime.chat_output import ChatOutput, message
from minivllm.runtime.reasoning import REASONING, UNDECIDED
from minivllm.runtime.server import OpenAIServer

from engine_helpers import make_llm, serving
from test_reasoning_tools import cut, functions, model_dir, streamed_message  # noqa: F401
from test_server import post, stream

PROPS = {"city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
         "metric": {"type": "boolean"}, "opts": {"type": "object"}, "hours": {"type": "array"}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": PROPS}}},
    {"type": "function", "function": {"name": "get_time"}}]
NAMES = st.sampled_from(["get_weather", "get_time", "other", "f\u00e9"])
TEXT = st.text("ab \n<>/\"\\\u00e9\U0001F600\x01", max_size=6)


# -- the invariants, whichever the parser ------------------------------------------------------


def streamed(parser_name: str, text: str, pieces: list[str], *, phase=None, parallel=True):
    """(deltas of the stream, its ChatOutput, the whole message, its ChatOutput)."""
    make = lambda: ChatOutput(phase, "auto", parallel_tool_calls=parallel,  # noqa: E731
                              tool_parser=parser_name, tools=TOOLS)
    parser = make()
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    whole_parser = make()
    return deltas, parser, message(whole_parser, text), whole_parser


def call_pieces(deltas: list[dict]) -> dict[int, list[tuple[int, dict]]]:
    """Each call index's deltas as (the delta's position, the tool call delta)."""
    calls: dict[int, list] = {}
    for k, d in enumerate(deltas):
        for piece in d.get("tool_calls", ()):
            calls.setdefault(piece["index"], []).append((k, piece))
    return calls


def check_invariants(deltas, parser, whole, whole_parser, malformed: bool) -> dict:
    content = "".join(d.get("content", "") for d in deltas)
    assert (content or None) == (whole["content"] or None)  # (3)
    assert "".join(d.get("reasoning", "") for d in deltas) == (whole.get("reasoning") or "")
    calls = call_pieces(deltas)
    for pieces in calls.values():  # (2): id, type and name once, in the first delta
        _, first = pieces[0]
        assert set(first) == {"index", "id", "type", "function"} and first["type"] == "function"
        assert set(first["function"]) == {"name", "arguments"}
        assert first["id"].startswith("chatcmpl-tool-")
        for _, later in pieces[1:]:
            assert set(later) == {"index", "function"} and set(later["function"]) == {"arguments"}
            assert later["function"]["arguments"]
    want = functions(whole.get("tool_calls"))
    if want or not calls:  # (1): each call's pieces join to its arguments exactly
        assert set(calls) <= set(range(len(want)))
        for k, w in enumerate(want):
            got = "".join(p["function"]["arguments"] for _, p in calls.get(k, ()))
            if not malformed or w["arguments"].startswith(got):
                assert calls[k][0][1]["function"]["name"] == w["name"]
                assert got == w["arguments"]
                assert json.dumps(json.loads(got)) == json.dumps(json.loads(w["arguments"]))
            else:  # a key given twice: the stream sent the first value, the parse keeps the last
                assert calls[k][0][1]["function"]["name"] == w["name"]
    else:  # (5): a call began streaming, then the answer turned out to be no call
        assert malformed
    stop = SimpleNamespace(finish_reason="stop")  # (4)
    assert (api._finish_reason(stop, whole_parser) == "tool_calls") == bool(want)
    assert (api._finish_reason(stop, parser) == "tool_calls") == bool(want or calls)
    return calls


# -- hermes ------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8)
_SHORT = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\b": "\\b", "\f": "\\f", "\n": "\\n",
          "\r": "\\r", "\t": "\\t"}


def _u(code: int) -> str:
    return "\\u%04x" % code if code % 2 else "\\u%04X" % code


def write_string(draw, s: str) -> str:
    """A JSON string for s, each character written raw, short-escaped or \\u-escaped (a
    surrogate pair beyond the BMP) as the draw says, where JSON allows."""
    out = []
    for ch in s:
        forms = [] if ch in '"\\' or ch < " " else [ch]
        if ch in _SHORT:
            forms.append(_SHORT[ch])
        code = ord(ch)
        high, low = divmod(code - 0x10000, 0x400)
        forms.append(_u(code) if code < 0x10000 else _u(0xD800 + high) + _u(0xDC00 + low))
        out.append(draw(st.sampled_from(forms)))
    return '"' + "".join(out) + '"'


def write_json(draw, value) -> str:
    """Any JSON text whose json.loads is `value` (spacing, escapes, number forms drawn)."""
    ws = lambda: draw(st.sampled_from(["", "", " ", "\n", "\t ", "  "]))  # noqa: E731
    if isinstance(value, dict):
        items = [ws() + write_string(draw, k) + ws() + ":" + ws() + write_json(draw, v) + ws()
                 for k, v in value.items()]
        return "{" + (",".join(items) or ws()) + "}"
    if isinstance(value, list):
        return "[" + (",".join(ws() + write_json(draw, v) + ws() for v in value) or ws()) + "]"
    if isinstance(value, str):
        return write_string(draw, value)
    if isinstance(value, float) and value == value and abs(value) != float("inf"):
        return draw(st.sampled_from([repr(value), "%.17e" % value, "%.17E" % value]))
    return json.dumps(value)


@st.composite
def hermes_answers(draw):
    """(text, malformed): content, then hermes blocks, perhaps spoilt at the end."""
    calls = draw(st.lists(st.tuples(NAMES, JSON, st.sampled_from(["name", "args", "extra"])),
                          max_size=3))
    blocks = []
    for name, arguments, order in calls:
        items = [("name", name), ("arguments", arguments)]
        if order == "args":
            items.reverse()
        elif order == "extra":
            items.append(("id", 7))
        body = write_json(draw, dict(items))
        blocks.append("<tool_call>" + draw(st.sampled_from(["\n", "", " "])) + body +
                      draw(st.sampled_from(["\n", ""])) + "</tool_call>")
    prefix = draw(st.text("ab \n<\u00e9", max_size=6))
    if blocks:
        prefix = prefix.replace("<", "")
    text = prefix + draw(st.sampled_from(["\n", ""])).join(blocks)
    spoil = draw(st.sampled_from(["", "", "unclosed", "cut", "stray", "tail"])) if blocks else ""
    if spoil == "unclosed":
        text = text[:-len("</tool_call>")]
    elif spoil == "cut":
        text = text[:len(text) - draw(st.integers(1, 40))]
    elif spoil == "stray":
        at = draw(st.integers(len(prefix), len(text)))
        text = text[:at] + draw(st.sampled_from(["}", ",", "x", '"', "\\"])) + text[at:]
    elif spoil == "tail":
        text += draw(st.sampled_from([" done", "\n<tool_call>", "<tool_call>\n{\"na"]))
    return text, spoil in ("cut", "stray", "tail")


@settings(max_examples=250, deadline=None)
@given(hermes_answers(), st.lists(st.integers(0, 600), max_size=14),
       st.sampled_from([None, UNDECIDED]), st.booleans())
def test_hermes_calls_stream_as_the_whole_answer_parses(answer, points, phase, parallel):
    text, malformed = answer
    if phase is not None:  # thinking before the answer (--reasoning-parser qwen3)
        text = "<think>\nhm \u00e9</think>\n\n" + text
    check_invariants(*streamed("hermes", text, cut(text, points), phase=phase, parallel=parallel),
                     malformed)


def test_hermes_arguments_stream_as_generated():
    """A long argument arrives in many pieces before the end, in json.dumps' form whatever the
    model's spacing and escapes; the first delta names the call."""
    note = "a long note, " * 8
    text = ('Let me see.\n<tool_call>\n{"name":"get_weather" , "arguments":{"city":"Paris",'
            '"note":"' + note + '\\u00e9\\ud83d\\ude00","days":[1,2.50,1e2]}}\n</tool_call>')
    deltas, *rest = streamed("hermes", text, [text[i:i + 3] for i in range(0, len(text), 3)])
    calls = check_invariants(deltas, *rest, malformed=False)
    assert rest[1]["tool_calls"][0]["function"]["arguments"] == json.dumps(
        {"city": "Paris", "note": note + "\u00e9\U0001F600", "days": [1, 2.5, 100.0]},
        ensure_ascii=False)
    early = [k for k, p in calls[0] if k < len(deltas) - 1 and p["function"]["arguments"]]
    assert len(early) > 20  # a piece a few characters
    first = calls[0][0][1]
    # The name before any argument (arguments "" as in OpenAI's first delta; vLLM's hermes
    # leaves the key out).
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d.get("content", "") for d in deltas[:calls[0][0][0] + 1]) == "Let me see.\n"
    assert deltas[-1] == {}  # all of it streamed before the end


def test_a_hermes_call_cut_short_keeps_what_streamed_and_the_content():
    """max_tokens inside the JSON: the whole response is all content (vLLM's parser fails on
    it); the stream already sent the call's name and arguments so far (so did vLLM's) and ends
    with the content, finish_reason "tool_calls"."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    deltas, parser, whole, whole_parser = streamed("hermes", text, list(text))
    assert whole["content"] == text and "tool_calls" not in whole
    calls = check_invariants(deltas, parser, whole, whole_parser, malformed=True)
    assert "".join(p["function"]["arguments"] for _, p in calls[0]) == '{"city": "Par'
    # A closed block streams its whole call, but a later broken one makes all of it content.
    text = ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {]}\n</tool_call>')
    deltas, parser, whole, whole_parser = streamed("hermes", text, list(text))
    calls = check_invariants(deltas, parser, whole, whole_parser, malformed=True)
    assert [p["function"]["arguments"] for _, p in calls[0]] == ["", "{", "}"] and 1 in calls


def test_a_hermes_stream_ends_its_last_piece_as_the_whole_parse():
    """The last piece (with the finish) is not streamed but read whole: a block that breaks
    there sends no call."""
    head = '<tool_call>\n{"na'
    text = head + 'me": "f", "arguments": {"a": 1}}x\n</tool_call>'
    deltas, *rest = streamed("hermes", text, [head, text[len(head):]])
    check_invariants(deltas, *rest, malformed=True)
    assert not call_pieces(deltas) and "".join(d.get("content", "") for d in deltas) == text


# -- qwen3_coder -------------------------------------------------------------------------------

VALUES = st.sampled_from(["Paris", "3", "-2", "2.5", "1e400", "true", "null", '{"a": [1]}',
                          "[1, 2]", "{1, 2}", "", "\n", "a<b", "</parameter", "\u00e9\U0001F600",
                          "x\n\n", "</function"])
XML_CALL = st.tuples(NAMES, st.dictionaries(st.sampled_from(list(PROPS) + ["x"]), VALUES,
                                            max_size=3), st.sampled_from(["", "no_param_end",
                                                                          "no_function_end"]))


def xml_call(name, params, drop) -> str:
    end = "" if drop == "no_param_end" else "</parameter>"
    body = "".join(f"<parameter={k}>\n{v}\n{end}\n" for k, v in params.items())
    return f"<function={name}>\n{body}" + ("" if drop == "no_function_end" else "</function>\n")


@st.composite
def xml_answers(draw):
    """(text, malformed): content, then Qwen3-Coder's blocks (one call or two a block, some
    tags left out), perhaps spoilt at the end."""
    calls = draw(st.lists(XML_CALL, max_size=3))
    blocks, k = [], 0
    while k < len(calls):
        take = draw(st.integers(1, 2))
        blocks.append("<tool_call>\n" + "".join(xml_call(*c) for c in calls[k:k + take]) +
                      "</tool_call>")
        k += take
    prefix = draw(st.text(" \nab<\u00e9", max_size=6))
    text = prefix + draw(st.sampled_from(["\n", ""])).join(blocks)
    if draw(st.booleans()) and calls:  # a bare function, no block
        text = prefix + xml_call(*calls[0])
    spoil = draw(st.sampled_from(["", "", "cut", "tail", "unreadable"]))
    # A function without its </function> runs on into the next one's parameters: a key may
    # come twice (the stream cannot take back the first value).
    spoil = spoil or ("run_on" if any(c[2] == "no_function_end" for c in calls) else "")
    # A value JSON cannot write (a set) or an infinite number: vLLM's parser fails on the
    # answer, which is then all content, though the call began streaming.
    spoil = spoil or ("unwritable" if any(v in ("{1, 2}", "1e400") for c in calls
                                          for v in c[1].values()) else "")
    if spoil == "cut":
        text = text[:len(text) - draw(st.integers(1, 40))]
    elif spoil == "tail":
        text += draw(st.sampled_from([" done", "<tool_call>", "</tool_call>", "<function=",
                                      "<tool_call>\n<function=g>\n<parameter=x>\n1"]))
    elif spoil == "unreadable":
        text += "<tool_call>\n<function=g>\n<parameter=x</parameter>\n</function>\n</tool_call>"
    return text, spoil != ""


@settings(max_examples=250, deadline=None)
@given(xml_answers(), st.lists(st.integers(0, 600), max_size=14),
       st.sampled_from([None, REASONING]), st.booleans())
def test_qwen3_coder_calls_stream_as_the_whole_answer_parses(answer, points, phase, parallel):
    text, malformed = answer
    if phase is not None:  # the prompt opened the think
        text = "thinking \u00e9</think>\n\n" + text
    check_invariants(*streamed("qwen3_coder", text, cut(text, points), phase=phase,
                               parallel=parallel), malformed)


def test_qwen3_coder_parameters_stream_as_they_close():
    """vLLM's pieces: the name with "{" (vLLM sends "" then "{"), each '"name": value' typed
    by the tools once its </parameter> came, "}" at </function>: all before the end."""
    text = ("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"a\": [1]}\n</parameter>\n"
            "</function>\n</tool_call>")
    deltas, *rest = streamed("qwen3_coder", text, [text[i:i + 2] for i in range(0, len(text), 2)])
    calls = check_invariants(deltas, *rest, malformed=False)
    assert [p["function"] for _, p in calls[0]] == [
        {"name": "get_weather", "arguments": "{"}, {"arguments": '"city": "Paris"'},
        {"arguments": ', "days": 3'}, {"arguments": ', "opts": {"a": [1]}'}, {"arguments": "}"}]
    assert all(k < len(deltas) - 1 for k, _ in calls[0]) and deltas[-1] == {}


def test_a_bare_qwen3_coder_function_waits_for_the_end():
    """A <function= outside any <tool_call> is a call only if no block ever comes: it is sent
    whole at the end."""
    text = "<function=get_time>\n</function>"
    deltas, *rest = streamed("qwen3_coder", text, list(text))
    calls = check_invariants(deltas, *rest, malformed=False)
    assert [k for k, _ in calls[0]] == [len(deltas) - 1]


# -- the server ----------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "note": {"type": "string"}}}}}
USER = [{"role": "user", "content": "What is the weather like today?"}]
NOTE_REGEX = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
              r'"note": "[a-z]{24}"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def server(model_dir, device):  # noqa: F811 (the imported fixture)
    srv = OpenAIServer(make_llm(model_dir, device, max_model_len=1024, reasoning_parser="qwen3"),
                       port=0, model_name="tiny", enable_auto_tool_choice=True,
                       tool_call_parser="hermes")
    with serving(srv):
        yield srv


def test_the_server_streams_a_calls_arguments_as_generated(server):
    body = {"messages": USER, "tools": [WEATHER], "max_tokens": 120, "n": 2,
            "chat_template_kwargs": {"enable_thinking": False},
            "structured_outputs": {"regex": NOTE_REGEX}}
    status, whole = post(server, "/v1/chat/completions", body)
    assert status == 200, whole
    events = stream(server, "/v1/chat/completions", body)
    assert all(len(ev["choices"]) == 1 for ev in events)
    for index in (0, 1):
        choice = whole["choices"][index]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        mine = [ev for ev in events if ev["choices"][0]["index"] == index]
        merged, reasons = streamed_message(mine)
        assert reasons == ["tool_calls"] and "content" not in merged
        assert functions(merged["tool_calls"]) == functions(choice["message"]["tool_calls"])
        pieces = [(k, p) for k, ev in enumerate(mine)
                  for p in ev["choices"][0]["delta"].get("tool_calls", ())]
        first = pieces[0][1]
        assert set(first) == {"index", "id", "type", "function"} and first["index"] == 0
        assert first["function"] == {"name": "get_weather", "arguments": ""}
        assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"}
                   for _, p in pieces[1:])
        # The note's letters came in many chunks, before the last one (its finish_reason).
        early = [p["function"]["arguments"] for k, p in pieces[1:] if k < len(mine) - 1]
        assert len(early) > 10
        note = json.loads(merged["tool_calls"][0]["function"]["arguments"])["note"]
        assert sum(1 for a in early if a.strip('"') and a.strip('"') in note) > 5


# -- the hermes scanner against json.loads -----------------------------------------------------


def _has_repeated_keys(text: str) -> bool:
    repeated = []

    def pairs(items):
        keys = [k for k, _ in items]
        repeated.extend([1] if len(set(keys)) < len(keys) else [])
        return dict(items)

    json.loads(text, object_pairs_hook=pairs)
    return bool(repeated)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_scanner_reads_a_call_as_json_loads_does(data):
    """Fed a call's JSON in pieces, CallScanner's arguments are always a prefix of json.dumps of
    json.loads' (and all of it at the end), its name json.loads' name; text json.loads refuses
    is never a whole call to it."""
    from minivllm.runtime.json_stream import CallScanner

    items = [("name", data.draw(TEXT)), ("arguments", data.draw(JSON))]
    text = write_json(data.draw, dict(items if data.draw(st.booleans()) else items[::-1]))
    if data.draw(st.booleans()):  # spoilt, perhaps
        at = data.draw(st.integers(0, len(text)))
        text = text[:at] + data.draw(st.sampled_from(
            ["}", "]", ":", ",", '"', "\\", "0", "-", "e", ".", "true", "NaN", "\\u12", "\\ud800",
             '"name": 1,', '"arguments": 2,'])) + text[at:]
    try:
        call = json.loads(text)
    except ValueError:
        call = None
    scanner = CallScanner()
    whole = isinstance(call, dict) and isinstance(call.get("name"), str) and \
        "arguments" in call and not _has_repeated_keys(text)
    final = json.dumps(call["arguments"], ensure_ascii=False) if whole else None
    for piece in cut(text, data.draw(st.lists(st.integers(0, 400), max_size=10))):
        scanner.feed(piece)
        if whole:
            assert not scanner.failed and final.startswith(scanner.args)
    if whole:
        assert scanner.done and (scanner.name, scanner.args) == (call["name"], final)
    elif call is None:
        assert scanner.failed or not scanner.done
