"""Audit (session 76) of the reasoning split and the tool-call parsers against vLLM's
(vllm/reasoning/qwen3_reasoning_parser.py, vllm/tool_parsers/hermes_tool_parser.py,
vllm/tool_parsers/qwen3coder_tool_parser.py and their tests in tests/reasoning and
tests/tool_parsers).

The bug: where the prompt already opened the reasoning (Qwen3-2507 thinking models' template
writes <think> into the prompt), a completion that opens with <think> itself kept the tag in its
reasoning; vLLM's qwen3 parser strips it (extract_reasoning partitions on <think>, the streaming
path cuts it from the delta; its test case "with_think" on Qwen3-4B-Thinking-2507's tokenizer).

Then regression guards for the invariant the brief asks for: a completion cut at any token
boundary streams deltas that join to the whole response, whichever the phase, the tool_choice
and the parser, over texts that mix both parsers' tags, think tags, broken JSON and unicode."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from minivllm.runtime.chat_output import ChatOutput, merge_deltas, message
from minivllm.runtime.reasoning import ANSWER, REASONING, UNDECIDED, ReasoningSplit, \
    split_reasoning

PROPS = {"city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
         "metric": {"type": "boolean"}, "opts": {"type": "object"}, "hours": {"type": "array"}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": PROPS}}},
    {"type": "function", "function": {"name": "get_time"}}]


def stream(text: str, pieces: list[str], phase, mode="auto", parser="hermes", parallel=True,
           include_reasoning=True) -> tuple[list[dict], dict]:
    """(the stream's deltas, the whole message), as the server makes them: the last piece
    comes with the finish."""
    make = lambda: ChatOutput(phase, mode, include_reasoning, parallel, parser,  # noqa: E731
                              TOOLS)
    out = make()
    pieces = pieces or [""]
    deltas = [out.feed(p) for p in pieces[:-1]] + [out.feed(pieces[-1], last=True),
                                                   out.finish()]
    return deltas, message(make(), text)


def cut(text: str, points: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(p % (len(text) + 1) for p in points)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


# -- the bug: a leading <think> where the prompt opened the reasoning ------------------------


def test_a_leading_think_is_dropped_where_the_prompt_opened_the_reasoning():
    """vLLM's WITH_THINK / ONLY_OPEN_TAG cases (tests/reasoning/test_qwen3_reasoning_parser.py,
    run there with Qwen3-4B-Thinking-2507's tokenizer, whose template opens <think>)."""
    assert split_reasoning("<think>This is a reasoning section</think>This is the rest",
                           REASONING) == ("This is a reasoning section", "This is the rest")
    assert split_reasoning("<think>This is a reasoning section", REASONING) == (
        "This is a reasoning section", None)
    assert split_reasoning("<think>\nr</think>", REASONING) == ("\nr", None)
    # Only the completion's first tag: a later <think> is reasoning text, as before.
    assert split_reasoning("a<think>b</think>c", REASONING) == ("a<think>b", "c")
    # Unchanged: the prompt's phase still decides the rest.
    assert split_reasoning("<think>r</think>a", UNDECIDED) == ("r", "a")
    assert split_reasoning("<think>r</think>a", ANSWER) == (None, "<think>r</think>a")
    assert split_reasoning("<thin", REASONING) == ("<thin", None)
    assert split_reasoning("r</think>a", REASONING) == ("r", "a")


def test_a_leading_think_streams_as_the_whole_split_drops_it():
    text = "<think>\nI should call it.\n</think>\n\n<tool_call>\n" \
           '{"name": "get_time", "arguments": {}}\n</tool_call>'
    for k in range(len(text) + 1):
        deltas, whole = stream(text, [text[:k], text[k:]], REASONING)
        merged = merge_deltas(deltas)
        assert merged["reasoning"] == whole["reasoning"] == "\nI should call it.\n"
        assert [c["function"] for c in merged["tool_calls"]] == \
            [c["function"] for c in whole["tool_calls"]] == \
            [{"name": "get_time", "arguments": "{}"}]
    split = ReasoningSplit(REASONING)
    assert [split.feed(c) for c in "<think>ab"] == [("", "")] * 7 + [("a", ""), ("b", "")]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "think", ">", "a",
                                 "\n", "<", "\u00e9"]), max_size=10),
       st.lists(st.integers(0, 100), max_size=6))
def test_a_reasoning_phase_split_drops_only_a_leading_think(pieces, points):
    text = "".join(pieces)
    split = ReasoningSplit(REASONING)
    got = [split.feed(p) for p in cut(text, points)] + [split.finish()]
    body = text[len("<think>"):] if text.startswith("<think>") else text
    before, tag, after = body.partition("</think>")
    assert ("".join(r for r, _ in got), "".join(a for _, a in got)) == (before, after)


# -- regression guards: any cut of any mix streams as the whole response --------------------

TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "</function>",
          "<parameter=", "</parameter>", "get_weather", "days", "city", ">", "\n", " ", "a", "3",
          "{", "}", '"', ":", ",", '"name"', '"arguments"', '"get_time"', "[", "]", "null",
          "1.5", "\\", "\\u00e9", "\\ud83d", "\\ude00", "\u00e9", "\U0001F600", "<th", "ink>",
          "<tool", "_call>", "</tool", "<func", "tion=", "</para", "meter>"]
WHOLE = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "P\\u00e9ris"}}\n'
         '</tool_call>', '<tool_call>{"arguments": {}, "name": "get_time"}</tool_call>',
         "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n"
         "<parameter=opts>\n{\"a\": [1]}\n</parameter>\n</function>\n</tool_call>",
         "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
         "<function=get_time>\n</function>", '[{"name": "get_time", "parameters": {}}]']


def check(text: str, pieces: list[str], phase, mode, parser, parallel, include_reasoning):
    deltas, whole = stream(text, pieces, phase, mode, parser, parallel, include_reasoning)
    for d in deltas:  # no empty text fields
        assert all(d[k] for k in ("content", "reasoning", "reasoning_content") if k in d), d
    merged = merge_deltas(deltas)
    assert merged.get("content") == (whole["content"] or None)
    assert merged.get("reasoning") == whole.get("reasoning")
    want = [c["function"] for c in whole.get("tool_calls", ())]
    if want:  # (a stream that began a call the whole parse finds broken keeps it: documented)
        assert [c["function"] for c in merged["tool_calls"]] == want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(TOKENS) | st.sampled_from(WHOLE), max_size=14),
       st.lists(st.integers(0, 400), max_size=10),
       st.sampled_from([None, REASONING, ANSWER, UNDECIDED]),
       st.sampled_from(["auto", "auto", "none", "required", "function:get_weather"]),
       st.sampled_from(["hermes", "qwen3_coder"]), st.booleans(), st.booleans())
def test_any_cut_of_any_answer_streams_as_the_whole_response(tokens, points, phase, mode,
                                                            parser, parallel, include):
    text = "".join(tokens)
    check(text, cut(text, points), phase, mode, parser, parallel, include)


EXAMPLES = [
    "<think>\nLet me think about <tool_call> and </think>\n\nSure \u00e9\U0001F600.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P\\u00e9ris", "days": '
    '[1, 2.50e1, true, null]}}\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": '
    '"get_time"}\n</tool_call> after',
    "thinking</think>ok <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"a\": [1]}\n"
    "</parameter>\n</function>\n<function=get_time>\n</function>\n</tool_call>\nafter",
    "<think>a</think><tool_call>\n<function=get_weather>\n<parameter=temp>\n2.5\n"
    "<parameter=metric>\nTRUE\n</function>",
]


def test_every_single_cut_streams_as_the_whole_response():
    """Each example cut once at every character (a token boundary anywhere), and fed a
    character at a time."""
    for text in EXAMPLES:
        for phase in (None, REASONING, UNDECIDED):
            for parser in ("hermes", "qwen3_coder"):
                for k in range(1, len(text), 2):
                    check(text, [text[:k], text[k:]], phase, "auto", parser, True, True)
                check(text, list(text), phase, "auto", parser, True, True)
