"""Reasoning (Qwen3's <think> ... </think>, `--reasoning-parser qwen3`) and tool calls (hermes
<tool_call> blocks, `--enable-auto-tool-choice --tool-call-parser hermes`; tool_choice
"required" and a named function as structured outputs), as vLLM's server makes them.

The splits, streamed piece by piece, are checked against whole-text references written here
(hypothesis); the guide's phases (the constraint starts after the reasoning) against the
compiled constraint itself; the server end to end on a tiny checkpoint whose tokenizer has
Qwen3's four tags as single tokens and a chat template that lists tools and writes the thinking
switch as Qwen3's, against the LLM API's own completions of the same prompts."""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from minivllm import SamplingParams
from minivllm.runtime import openai_api as api
from minivllm.runtime import reasoning, tool_calls
from minivllm.runtime.chat_output import ChatOutput, merge_deltas, message
from minivllm.runtime.guide import Guide, GuideCache, schema_regex
from minivllm.runtime.reasoning import ANSWER, REASONING, UNDECIDED
from minivllm.runtime.sampling_params import StructuredOutputsParams
from minivllm.runtime.server import OpenAIServer

from engine_helpers import make_llm, serving
from test_server import post, stream

TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# Qwen3's template in miniature: tools listed in the system turn, earlier calls as hermes blocks,
# tool results as <tool_response>, an assistant turn's reasoning_content as a closed think before
# its content (as Qwen3's writes the turns of a tool loop), enable_thinking=false as an empty
# think; thinking="open" (a stand-in for Qwen3-2507 thinking models' template) opens the think in
# the prompt.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- elif thinking is defined and thinking == 'open' %}<think>\n{% endif %}{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no arguments
TOOLS = [WEATHER, CLOCK]
USER = [{"role": "user", "content": "What is the weather like today?"}]
# A hermes block the answer is held to (structured outputs), so that random weights call a tool.
CALL_REGEX = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
              r'"days": [1-9]\}\}\n</tool_call>')


# -- the splits against whole-text references ------------------------------------------------


def reference_reasoning(text: str, phase: str) -> tuple[str, str]:
    """(reasoning, answer) by the rules in runtime/reasoning.py, on the whole text."""
    if phase != ANSWER and text.startswith("<think>"):  # a leading <think> opens (or repeats)
        phase, text = REASONING, text[len("<think>"):]
    elif phase == UNDECIDED:
        phase = ANSWER
    if phase == ANSWER:
        return "", text
    end = text.find("</think>")
    return (text, "") if end < 0 else (text[:end], text[end + len("</think>"):])


def cut(text: str, points: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(p % (len(text) + 1) for p in points)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


PIECES = st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "think", ">", "a", "b c",
                          "\n", "<", "é"])


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=12), st.sampled_from([REASONING, ANSWER, UNDECIDED]),
       st.lists(st.integers(0, 200), max_size=8))
def test_a_streamed_reasoning_split_equals_the_whole_texts(pieces, phase, points):
    text = "".join(pieces)
    split = reasoning.ReasoningSplit(phase)
    got = [split.feed(piece) for piece in cut(text, points)] + [split.finish()]
    want = reference_reasoning(text, phase)
    assert ("".join(r for r, _ in got), "".join(a for _, a in got)) == want
    assert reasoning.split_reasoning(text, phase) == (want[0] or None, want[1] or None)


def test_the_prompt_decides_where_a_completion_starts():
    s, e, turn = 7, 8, 1
    tags = reasoning.ThinkTags(s, e, frozenset({turn}))
    assert tags.prompt_phase([turn, s, 2]) == REASONING  # the template opened it
    assert tags.prompt_phase([turn, s, 2, e, 3]) == ANSWER  # enable_thinking=False
    assert tags.prompt_phase([turn, e, s]) == REASONING
    assert tags.prompt_phase([turn, 2, 3]) == UNDECIDED  # the model writes <think>
    # A tool loop's earlier turn thought (its reasoning written back, closed): the new turn's
    # model thinks anew.
    assert tags.prompt_phase([turn, s, 2, e, 3, turn, 4, turn, 5]) == UNDECIDED
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        reasoning.check_parser("deepseek_r1")


NAMES = st.sampled_from(["get_weather", "get_time", "f"])
ARGS = st.dictionaries(st.sampled_from(["city", "days", "q"]),
                       st.one_of(st.integers(-5, 5), st.text("ab <>/\"é", max_size=4)), max_size=3)


@settings(max_examples=200, deadline=None)
@given(st.text("ab \n<", max_size=6), st.lists(st.tuples(NAMES, ARGS), min_size=0, max_size=3),
       st.booleans(), st.lists(st.integers(0, 300), max_size=10))
def test_a_streamed_answers_tool_calls_equal_the_whole_ones(prefix, calls, unclosed, points):
    """Content before the first block, then the blocks; the last may lack its closing tag (a
    completion that ended at EOS). Streamed in any pieces, the content and calls equal those
    read from the whole answer, and those are the calls written; content that is only
    whitespace is none beside calls (vLLM's server drops it)."""
    prefix = prefix.replace("<", "") if calls else prefix  # no stray tag before the blocks
    blocks = [f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>"
              for n, a in calls]
    if blocks and unclosed:
        blocks[-1] = blocks[-1][:-len("</tool_call>")]
    text = prefix + "\n".join(blocks)
    split = tool_calls.ToolCallSplit()
    content = "".join(split.feed(piece) for piece in cut(text, points))
    tail, got = split.finish()
    want = text if not calls else prefix if prefix.strip() else ""
    assert content + tail == want
    assert got == [{"name": n, "arguments": json.dumps(a, ensure_ascii=False)} for n, a in calls]


def test_whitespace_before_calls_is_no_content_but_without_calls_it_is():
    """vLLM 0.20's server (_parse_tool_calls_from_content): beside tool calls, content that is
    only whitespace becomes null; a broken block keeps the whole answer as content."""
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    for text, want in (("\n\n" + call, ""), (" \n", " \n"), ("\n" + call[:-3], "\n" + call[:-3]),
                       ("\nhi\n" + call, "\nhi\n")):
        split = tool_calls.ToolCallSplit()
        sent = "".join(split.feed(c) for c in text)
        tail, calls = split.finish()
        assert sent + tail == want, text


def test_an_answer_whose_block_is_not_a_call_is_content():
    for text in ('<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>',  # broken JSON
                 '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
                 'hi <tool_call>["f"]</tool_call>',
                 # nested past json's recursion (3.12's C limit is 8,000): a model may write
                 # anything
                 '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 +
                 '}</tool_call>'):
        split = tool_calls.ToolCallSplit()
        sent = split.feed(text)
        tail, calls = split.finish()
        assert (sent + tail, calls) == (text, []) and tool_calls.parse_hermes(text[text.find("<"):]) is None


def test_tool_choice_schemas_hold_the_answer_to_the_tools():
    required = re.compile(schema_regex(tool_calls.choice_schema("required", TOOLS)))
    ok = '[{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}, ' \
         '{"name": "get_time", "parameters": {}}]'
    assert required.fullmatch(ok)
    assert tool_calls.parse_required(ok) == [
        {"name": "get_weather", "arguments": '{"city": "Rome", "days": 3}'},
        {"name": "get_time", "arguments": "{}"}]
    assert not required.fullmatch('[{"name": "get_rain", "parameters": {}}]')
    assert not required.fullmatch("[]")  # at least one call
    named = re.compile(schema_regex(tool_calls.choice_schema("function:get_weather", TOOLS)))
    assert named.fullmatch('{"city": "Paris", "days": 2}') and not named.fullmatch("{}")
    assert tool_calls.choice_schema("auto", TOOLS) is None
    assert tool_calls.parse_required('[{"name": "get_time", "parameters": {}') is None
    assert tool_calls.parse_required("[" * 100_000 + "]" * 100_000) is None  # past json's depth


@pytest.mark.parametrize("tools, choice, match", [
    ([{"type": "retrieval"}], None, r"tools\[0\] must be"),
    ([{"function": {"name": ""}}], None, "name must be a non-empty string"),
    ([WEATHER, WEATHER], None, "two tools are named"),
    ([{"function": {"name": "f", "parameters": "x"}}], None, "parameters must be"),
    ([{"function": {"name": "f", "strict": True, "returns": 1}}], None, "unknown fields"),
    (TOOLS, "any", "'tool_choice' must be"),
    (TOOLS, {"type": "function", "function": {"name": "get_rain"}}, "not among the tools"),
    (None, "required", "`tools` must be set"),
    (None, "auto", "`tools` must be set"),
    ([], {"function": {"name": "f"}}, "`tools` must be set"),
])
def test_bad_tools_and_tool_choices_are_named(tools, choice, match):
    fields = {"tool_choice": choice} if choice is not None else {}
    if tools is not None:
        fields["tools"] = tools
    with pytest.raises(api.RequestError, match=match):
        api.parse_chat({"messages": USER, **fields}, {})


def test_tool_choice_defaults_and_constraints():
    assert api.parse_chat({"messages": USER, "tools": TOOLS}, {}).tool_mode == "auto"
    assert api.parse_chat({"messages": USER}, {}).tool_mode == "none"
    auto = api.parse_chat({"messages": USER, "tools": TOOLS}, {})
    assert auto.params.skip_special_tokens is False and auto.params.structured_outputs is None
    named = api.parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, {})
    assert named.tool_mode == "function:get_time"
    assert named.params.structured_outputs == StructuredOutputsParams(json={"type": "object",
                                                                            "properties": {}})
    with pytest.raises(api.RequestError, match="give one constraint"):
        api.parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": "required",
                        "guided_regex": "a"}, {})


def test_history_tool_calls_reach_the_template_as_objects():
    msgs = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    req = api.parse_chat({"messages": msgs, "tools": TOOLS}, {})
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome", "days": 1}
    assert req.messages[1]["content"] == ""
    # Arguments that are not JSON reach it as {} (vLLM's chat_utils, since its PR 48922).
    broken = api.parse_chat({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{x"}}]}]}, {})
    assert broken.messages[0]["tool_calls"][0]["function"]["arguments"] == {}


# Qwen3-Coder's XML calls (the qwen3_coder parser's; hermes leaves them content) and their names.
XML_CALLS = {"<think>a</think>Sure. <tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n"
             "</function>\n</tool_call>": ["f"], " <function=g>\n</function>": ["g"],
             "<tool_call>\n<function=get_weather>\n<parameter=days>\n3": ["get_weather"]}


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["<think>r1</think>\n\nok", "<think>a</think><tool_call>\n"
                        '{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "plain",
                        '<tool_call>\n{"name": "f", "arguments": {}}'
                        "\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": [1]}",
                        *XML_CALLS]),
       st.sampled_from([None, UNDECIDED, REASONING]), st.sampled_from(["none", "auto"]),
       st.sampled_from(tool_calls.PARSERS), st.lists(st.integers(0, 100), max_size=8))
def test_a_streamed_chat_message_equals_the_whole_one(text, phase, mode, tool_parser, points):
    parser = ChatOutput(phase, mode, tool_parser=tool_parser, tools=TOOLS)
    deltas = [parser.feed(piece) for piece in cut(text, points)] + [parser.finish()]
    streamed = merge_deltas(deltas)
    whole = message(ChatOutput(phase, mode, tool_parser=tool_parser, tools=TOOLS), text)
    for key in ("reasoning", "content"):
        assert streamed.get(key) == (whole.get(key) or None)
    strip = lambda calls: [c["function"] for c in calls or ()]  # noqa: E731 (ids are random)
    assert strip(streamed.get("tool_calls")) == strip(whole.get("tool_calls"))
    r, a = reference_reasoning(text, phase) if phase is not None else ("", text)
    assert whole.get("reasoning") == (r or None)
    if mode == "none" or "<tool_call>" not in a and "<function=" not in a:
        assert whole["content"] == (a if a or not r else None)
    if mode == "auto" and text in XML_CALLS:  # read by qwen3_coder only, from the answer only
        want = XML_CALLS[text] if tool_parser == "qwen3_coder" and "<function=" in a else []
        assert [c["name"] for c in strip(whole.get("tool_calls"))] == want


# -- a checkpoint with the tags --------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from minivllm.runtime.demo import MODEL_SHAPE, build_tokenizer

    path = str(tmp_path_factory.mktemp("tagged") / "model")
    tok = build_tokenizer()
    tok.add_tokens(TAGS)  # as Qwen3's: added tokens, not special ones
    tok.chat_template = TEMPLATE
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(vocab_size=len(tok), bos_token_id=None, eos_token_id=eos,
                         pad_token_id=tok.pad_token_id, **MODEL_SHAPE)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    with open(f"{path}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": eos, "temperature": 0.0}, f)
    return path


@pytest.fixture(scope="module")
def llm(model_dir, device):
    return make_llm(model_dir, device, max_model_len=1024, reasoning_parser="qwen3")


def ids_of(llm, *tags):
    return [llm.get_tokenizer().convert_tokens_to_ids(t) for t in tags]


def test_a_guide_waits_for_the_reasoning_to_end(llm):
    tok = llm.get_tokenizer()
    start, end = ids_of(llm, "<think>", "</think>")
    cache = GuideCache(tok, llm.engine.vocab_size, llm.engine.eos_ids)
    compiled = cache.get("[0-9]{2}")
    digits = [tok.convert_tokens_to_ids(d) for d in "12"]
    vocab = llm.engine.vocab_size
    tags = llm.engine.think_tags
    assert (tags.start, tags.end) == (start, end)
    def ids(bits):
        return set(np.flatnonzero(np.unpackbits(bits, bitorder="little")).tolist())

    inside = Guide(compiled, REASONING, tags)
    assert inside.bits([5, 9, start], vocab) is None  # nothing held inside the reasoning
    after = [5, 9, start, end, digits[0]]  # the same output, grown
    assert np.array_equal(inside.bits(after, vocab),
                          compiled.bits(compiled.walk(compiled.start, b"1"), vocab))
    undecided = Guide(compiled, UNDECIDED, tags)
    assert ids(undecided.bits([], vocab)) == set(compiled.allowed(compiled.start, vocab)) | {start}
    assert undecided.bits([start, 4], vocab) is None  # it thinks
    plain = Guide(compiled, UNDECIDED, tags)
    assert np.array_equal(plain.bits(digits[:1], vocab),
                          compiled.bits(compiled.walk(compiled.start, b"1"), vocab))
    assert compiled.bits(compiled.start, vocab).flags.writeable is False  # the copy was set
    with pytest.raises(ValueError, match="reasoning tags"):
        Guide(compiled, REASONING)


def test_the_engine_constrains_the_answer_not_the_reasoning(llm):
    """Greedy, a bias on the tags: an undecided prompt's completion takes <think> (+50, allowed
    beside the constraint's first characters), then </think> (+100, nothing held inside the
    reasoning), then the constraint; a prompt that closed the think is held from its first
    token, and one that opened it waits for </think>."""
    start, end = ids_of(llm, "<think>", "</think>")
    regex = "[0-9]{3}"
    params = SamplingParams(temperature=0, max_tokens=12, logit_bias={start: 50, end: 100},
                            structured_outputs=StructuredOutputsParams(regex=regex))
    undecided = llm.chat(USER, params, use_tqdm=False)[0].outputs[0]
    assert undecided.token_ids[:2] == [start, end]
    assert re.fullmatch(regex, undecided.text[len("<think></think>"):]), undecided.text
    closed = llm.chat(USER, params, chat_template_kwargs={"enable_thinking": False},
                      use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(regex, closed.text) and start not in closed.token_ids
    opened = llm.chat(USER, params, chat_template_kwargs={"thinking": "open"},
                      use_tqdm=False)[0].outputs[0]
    assert opened.token_ids[0] == end and re.fullmatch(regex, opened.text[len("</think>"):])


def test_a_reasoning_parser_needs_the_tags_as_tokens(device):
    from minivllm.runtime.demo import ensure_demo_model

    with pytest.raises(ValueError, match="<think> to be one token"):
        make_llm(ensure_demo_model(), device, reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        make_llm(ensure_demo_model(), device, reasoning_parser="r1")


# -- the server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llm):
    srv = OpenAIServer(llm, port=0, model_name="tiny", enable_auto_tool_choice=True,
                       tool_call_parser="hermes")
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def reference(model_dir, device):
    """The LLM API without a server (and without a reasoning parser: the texts it gives are
    what the server's parsers read)."""
    return make_llm(model_dir, device, max_model_len=1024)


def streamed_message(events):
    deltas = [c["delta"] for ev in events for c in ev["choices"]]
    reasons = [c["finish_reason"] for ev in events for c in ev["choices"] if c["finish_reason"]]
    assert deltas[0] == {"role": "assistant", "content": ""}  # the first chunk: the role
    merged = merge_deltas(deltas[1:])
    return merged, reasons


def functions(calls):
    return [c["function"] for c in calls or ()]


def test_auto_tool_calls_are_read_from_the_answer(server, reference):
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 160,
            "chat_template_kwargs": {"enable_thinking": False},
            "structured_outputs": {"regex": CALL_REGEX}}
    status, whole = post(server, "/v1/chat/completions", body)
    assert status == 200, whole
    choice = whole["choices"][0]
    text = reference.chat(USER, SamplingParams(
        temperature=0, max_tokens=160, skip_special_tokens=False,
        structured_outputs=StructuredOutputsParams(regex=CALL_REGEX)), tools=TOOLS,
        chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0].outputs[0].text
    written = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
    assert functions(choice["message"]["tool_calls"]) == [
        {"name": "get_weather", "arguments": json.dumps(written["arguments"])}]
    assert choice["message"]["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning"] is None  # the prompt closed the think
    merged, reasons = streamed_message(stream(server, "/v1/chat/completions", body))
    assert functions(merged["tool_calls"]) == functions(choice["message"]["tool_calls"])
    assert "content" not in merged and reasons == ["tool_calls"]


def test_the_reasoning_is_split_from_the_answer(server, reference):
    """A prompt that opened the think: all the completion is reasoning until </think>; greedy,
    it is the LLM API's text. include_reasoning false drops it."""
    body = {"messages": USER, "max_tokens": 12, "chat_template_kwargs": {"thinking": "open"}}
    _, whole = post(server, "/v1/chat/completions", body)
    text = reference.chat(USER, SamplingParams(temperature=0, max_tokens=12),
                          chat_template_kwargs={"thinking": "open"},
                          use_tqdm=False)[0].outputs[0].text
    want_r, want_a = reasoning.split_reasoning(text, REASONING)
    msg = whole["choices"][0]["message"]
    assert (msg["reasoning"], msg["reasoning_content"], msg["content"]) == (want_r, want_r, want_a)
    merged, _ = streamed_message(stream(server, "/v1/chat/completions", body))
    assert (merged.get("reasoning"), merged.get("content")) == (want_r, want_a)
    _, dropped = post(server, "/v1/chat/completions", {**body, "include_reasoning": False})
    assert dropped["choices"][0]["message"]["reasoning"] is None
    # The bias forces <think></think> into an undecided prompt's completion: an empty reasoning.
    start, end = ids_of(reference, "<think>", "</think>")
    _, biased = post(server, "/v1/chat/completions", {
        "messages": USER, "max_tokens": 8, "logit_bias": {str(start): 50, str(end): 100},
        "guided_regex": "[a-z]{3}"})
    msg = biased["choices"][0]["message"]
    assert msg["reasoning"] is None and re.fullmatch("[a-z]{3}", msg["content"])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_required_and_named_tool_choices_call_a_tool(server, choice):
    body = {"messages": USER, "tools": TOOLS, "tool_choice": choice, "max_tokens": 120,
            "chat_template_kwargs": {"enable_thinking": False}}
    _, whole = post(server, "/v1/chat/completions", body)
    c = whole["choices"][0]
    # The constraint ends the answer (its EOS) once the JSON is whole: "tool_calls" for
    # "required", the completion's "stop" for a named function (vLLM's and OpenAI's).
    reason = "tool_calls" if choice == "required" else "stop"
    assert c["message"]["content"] == "" and c["finish_reason"] == reason
    calls = functions(c["message"]["tool_calls"])
    assert calls
    for call in calls:
        args = json.loads(call["arguments"])
        if call["name"] == "get_weather":
            assert args["city"] in ("Paris", "Rome") and isinstance(args["days"], int)
        else:
            assert call["name"] == "get_time" and args == {}
    merged, reasons = streamed_message(stream(server, "/v1/chat/completions", body))
    assert functions(merged.get("tool_calls")) == calls and reasons == [reason]


def test_a_required_answer_cut_short_is_content():
    text = '[{"name": "get_time", "param'
    for parser in (ChatOutput(None, "required"), ChatOutput(UNDECIDED, "required")):
        assert message(parser, text) == {"role": "assistant", "content": text,
                                         **({"reasoning": None, "reasoning_content": None}
                                            if parser.reasoning_parser else {})}


def test_tool_requests_the_server_cannot_serve_are_refused(server, llm):
    status, body = post(server, "/v1/chat/completions", {
        "messages": USER, "tools": TOOLS, "tool_choice": "required", "response_format": {
            "type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}})
    assert status == 400 and "give one constraint" in body["error"]["message"]
    with pytest.raises(ValueError, match="needs a tool_call_parser"):
        OpenAIServer(llm, port=0, enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        OpenAIServer(llm, port=0, enable_auto_tool_choice=True, tool_call_parser="mistral")


def test_auto_tool_choice_needs_the_servers_parser(model_dir, device):
    """A parser without enable_auto_tool_choice starts (the constrained choices need none), and
    "auto" is refused there as without both (vLLM's)."""
    srv = OpenAIServer(make_llm(model_dir, device, max_model_len=1024), port=0,
                       tool_call_parser="hermes")
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        status, body = post(srv, "/v1/chat/completions", {"messages": USER, "tools": TOOLS})
        assert status == 400 and "--enable-auto-tool-choice" in body["error"]["message"]
        status, body = post(srv, "/v1/chat/completions", {
            "messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})
        assert status == 200 and "tool_calls" not in body["choices"][0]["message"]
        assert "reasoning" not in body["choices"][0]["message"]  # no reasoning parser
    finally:
        srv.shutdown()
        thread.join(timeout=10)


def test_tokenize_renders_tools_and_earlier_calls(server, reference):
    msgs = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    _, body = post(server, "/tokenize", {"messages": msgs, "tools": TOOLS})
    as_objects = [msgs[0], {**msgs[1], "tool_calls": [{**msgs[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Rome", "days": 1}}}]}, msgs[2]]
    want = reference.chat_prompts(as_objects, tools=TOOLS)[0]
    assert body["tokens"] == want["prompt_token_ids"]
    assert '"get_weather"' in want["prompt"] and '"city": "Rome"' in want["prompt"]


# -- what the audit of the first version found (dbg/s52/tools_audit.md) ----------------------


def test_a_tool_loops_next_turn_thinks_anew(server, reference):
    """Qwen3's template writes the reasoning of the tool loop's earlier turn, closed, into the
    prompt: the next turn's completion still starts undecided (its own <think> is reasoning)."""
    start, end = ids_of(reference, "<think>", "</think>")
    # "reasoning": what vLLM's parser reads (and passes on as reasoning_content); a message's own
    # reasoning_content is dropped, as in vLLM (test_audit_s77_server_logprobs).
    loop = [*USER, {"role": "assistant", "content": "", "reasoning": "it needs a tool",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {
                        "name": "get_time", "arguments": None}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    req = api.parse_chat({"messages": loop, "tools": TOOLS, "tool_choice": "none"}, {})
    prompt = api.render_chat(reference, req.messages, req.chat_options)  # the server's path
    assert "</think>" in prompt["prompt"] and '"arguments": {}' in prompt["prompt"]  # null: {}
    assert server.llm.engine.think_tags.prompt_phase(prompt["prompt_token_ids"]) == UNDECIDED
    body = {"messages": loop, "tools": TOOLS, "tool_choice": "none", "max_tokens": 8,
            "logit_bias": {str(start): 50, str(end): 100}, "guided_regex": "[a-z]{3}",
            "logprobs": True}
    _, whole = post(server, "/v1/chat/completions", body)
    c = whole["choices"][0]
    # It took <think> (allowed: undecided), then </think>, then the constraint.
    assert [t["token"] for t in c["logprobs"]["content"][:2]] == ["<think>", "</think>"]
    assert c["message"]["reasoning"] is None and re.fullmatch("[a-z]{3}", c["message"]["content"])


def test_parallel_tool_calls_false_keeps_the_first_call(server):
    two = CALL_REGEX + r'\n<tool_call>\n\{"name": "get_time", "arguments": \{\}\}\n</tool_call>'
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 200, "guided_regex": two,
            "chat_template_kwargs": {"enable_thinking": False}}
    _, both = post(server, "/v1/chat/completions", body)
    names = [c["name"] for c in functions(both["choices"][0]["message"]["tool_calls"])]
    assert names == ["get_weather", "get_time"]
    _, first = post(server, "/v1/chat/completions", {**body, "parallel_tool_calls": False})
    assert functions(first["choices"][0]["message"]["tool_calls"]) == \
        functions(both["choices"][0]["message"]["tool_calls"])[:1]
    merged, _ = streamed_message(stream(server, "/v1/chat/completions",
                                        {**body, "parallel_tool_calls": False}))
    assert functions(merged["tool_calls"]) == functions(first["choices"][0]["message"]["tool_calls"])


def test_hidden_reasoning_hides_its_logprobs_and_leaves_content_null(server):
    body = {"messages": USER, "max_tokens": 6, "chat_template_kwargs": {"thinking": "open"},
            "logprobs": True, "include_reasoning": False}
    _, whole = post(server, "/v1/chat/completions", body)
    c = whole["choices"][0]
    assert c["finish_reason"] == "length" and c["logprobs"] is None
    assert (c["message"]["content"], c["message"]["reasoning"]) == (None, None)  # vLLM's
    events = stream(server, "/v1/chat/completions", body)
    assert all(ch["logprobs"] is None for ev in events for ch in ev["choices"])
    _, shown = post(server, "/v1/chat/completions", {**body, "include_reasoning": True})
    assert shown["choices"][0]["logprobs"] is not None


def test_required_tools_share_their_defs():
    """Each tool's $defs go to the top of the "required" schema, where their $refs look."""
    guest = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}}
    book = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"guest": {"$ref": "#/$defs/Guest"}},
        "$defs": {"Guest": guest}}}}
    bare = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
    schema = tool_calls.choice_schema("required", [book, bare])
    pattern = re.compile(schema_regex(schema))
    assert pattern.fullmatch('[{"name": "book", "parameters": {"guest": {"name": "Ada"}}}, '
                             '{"name": "ping", "parameters": {}}]')
    assert not pattern.fullmatch('[{"name": "book", "parameters": {"guest": "Ada"}}]')
    other = {"type": "function", "function": {"name": "b2", "parameters": {
        "type": "object", "properties": {"g": {"$ref": "#/$defs/Guest"}},
        "$defs": {"Guest": {"type": "integer"}}}}}
    with pytest.raises(ValueError, match="'Guest' in their \\$defs differently"):
        tool_calls.choice_schema("required", [book, other])


def test_a_torchrun_rank_without_the_tokenizer_passes_the_reasoning_check(model_dir, monkeypatch):
    """Under torchrun only rank 0 loads the tokenizer: the other ranks go on to serve it."""
    import minivllm.runtime.llm as llm_module

    class Reached(Exception):
        pass

    def serve_rank_0(config):
        raise Reached
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(llm_module, "make_executor", serve_rank_0)
    with pytest.raises(Reached):
        llm_module.LLM(model_dir, device="cpu", tensor_parallel_size=2, reasoning_parser="qwen3",
                       attention_backend="reference")
