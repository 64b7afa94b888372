"""Session 76's audit of chat rendering against vLLM's parse_chat_messages (entrypoints/
chat_utils.py) and LLM.chat, with transformers' apply_chat_template as the oracle: LLM.chat
handed the template the raw OpenAI messages, where vLLM first reads them (text parts joined by
newlines, JSON string tool-call arguments parsed into objects, content null as ""), so that a
list of text parts rendered as a Python list's repr (Qwen3's template renders it as nothing) and
an earlier call's arguments as a JSON string inside JSON; a message with no role, a role or
content of the wrong type, or an image part rendered quietly instead of raising; the server
refused text parts vLLM reads (input_text, refusal, plain strings, a text part with no text);
chat_template_kwargs' chat_template (vLLM's LLM.chat takes it) was a TypeError."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minivllm import SamplingParams
from minivllm.runtime import openai_api as api
from minivllm.runtime.demo import build_tokenizer, ensure_demo_model
from minivllm.runtime.llm import LLM

from engine_helpers import make_llm
from test_reasoning_tools import TEMPLATE, TOOLS

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
USER = {"role": "user", "content": "What is the weather like today?"}
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}}


@pytest.fixture(scope="module")
def tok():
    t = build_tokenizer()
    t.chat_template = TEMPLATE
    return t


def prompts(tok, messages, **kw) -> list[dict]:
    """LLM.chat_prompts over `tok` alone (no model)."""
    return LLM.chat_prompts(SimpleNamespace(engine=SimpleNamespace(tokenizer=tok)), messages, **kw)


def oracle(tok, conversation, **kw) -> str:
    kw.setdefault("add_generation_prompt", True)
    return tok.apply_chat_template(conversation, tokenize=False, **kw)


def server_prompt(tok, body: dict) -> dict:
    """The chat endpoint's path: parse_chat, then render_chat."""
    req = api.parse_chat(body, {})
    llm = SimpleNamespace(chat_prompts=lambda m, **kw: prompts(tok, m, **kw))
    return api.render_chat(llm, req.messages, req.chat_options)


PARTS = {"role": "user", "content": [{"type": "text", "text": "Hello,"},
                                     {"type": "text", "text": "my name is"}]}


def test_llm_chat_joins_text_parts_with_newlines(tmp_path_factory, device):
    """vLLM joins a message's text parts with "\\n" before the template sees them (the "string"
    content format, Qwen3's); LLM.chat rendered the list itself: "[{'type': 'text', ...}]"."""
    path = ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))
    llm = make_llm(path, device, num_kv_blocks=32, max_model_len=128)
    joined = [{"role": "user", "content": "Hello,\nmy name is"}]
    out = llm.chat([PARTS], GREEDY, use_tqdm=False)[0]
    want = llm.get_tokenizer().apply_chat_template(joined, tokenize=False,
                                                   add_generation_prompt=True)
    assert out.prompt == want and "'type'" not in out.prompt
    assert out.outputs[0].token_ids == llm.chat(joined, GREEDY, use_tqdm=False)[0] \
        .outputs[0].token_ids
    # the last message continued, given as parts
    cont = [USER, {"role": "assistant", "content": [{"type": "text", "text": "Once upon"}]}]
    got = llm.chat_prompts(cont, add_generation_prompt=False, continue_final_message=True)
    assert got[0]["prompt"].endswith("<|im_start|>assistant\nOnce upon")


def test_llm_chat_reads_earlier_tool_calls_as_vllm(tok):
    """An assistant turn of a tool loop as OpenAI clients send it back: content null and the
    call's arguments a JSON string. vLLM hands the template the arguments as an object, so a
    template's `arguments | tojson` writes JSON; LLM.chat wrote the string's JSON
    ("\\"{...}\\"")."""
    loop = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"}]
    as_vllm = [USER, {"role": "assistant", "content": "", "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}}]},
               loop[2]]
    want = oracle(tok, as_vllm, tools=TOOLS)
    assert '"arguments": {"city": "Rome", "days": 1}' in want
    assert prompts(tok, loop, tools=TOOLS)[0]["prompt"] == want
    assert server_prompt(tok, {"messages": loop, "tools": TOOLS})["prompt"] == want
    # the same in a batch of conversations, and null / "" arguments as none ({}), as vLLM
    empty = [USER, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "get_time", "arguments": ""}}]}]
    got = prompts(tok, [loop, empty], tools=TOOLS)
    assert got[0]["prompt"] == want and '"arguments": {}' in got[1]["prompt"]


def test_an_assistants_reasoning_reaches_the_template_as_reasoning_content(tok):
    """vLLM copies an assistant message's "reasoning" (its own responses' field) to
    "reasoning_content", the name Qwen3's template reads."""
    conv = [USER, {"role": "assistant", "content": "ok", "reasoning": "think first"}, USER]
    want = oracle(tok, [USER, {"role": "assistant", "content": "ok",
                               "reasoning_content": "think first"}, USER])
    assert "<think>\nthink first\n</think>" in want
    assert prompts(tok, conv)[0]["prompt"] == want


@pytest.mark.parametrize("messages, error, match", [
    (["hello"], TypeError, r"messages\[0\] must be an object with 'role' and 'content', got str"),
    ([{"content": "x"}], ValueError, r"messages\[0\] has no 'role'"),
    ([{"role": 5, "content": "x"}], TypeError, r"messages\[0\]\.role must be a string, got int"),
    ([USER, {"role": "user", "content": 5}], TypeError,
     r"messages\[1\]\.content must be a string, an array of text parts or null, got int"),
    ([{"role": "user", "content": {"text": "x"}}], TypeError, "content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     ValueError, r"messages\[0\]\.content\[0\]: only text parts are supported .* 'image_url'"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA"}}]}],
     ValueError, "only text parts are supported .* 'input_audio'"),
    ([{"role": "user", "content": [{"text": "x"}]}], ValueError, "only text parts .* None"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], TypeError,
     r"content\[0\]\.text must be a string, got int"),
    ([[USER], USER], TypeError, r"messages\[1\] must be a conversation"),
    ([[USER], [USER, {"role": "user"}, "x"]], TypeError, r"messages\[1\]\[2\] must be an object"),
    # (broken arguments JSON is no longer refused: vLLM's {} since its PR 48922, test_audit_s77_chat)
    ([USER, {"role": "assistant", "tool_calls": "f()"}], TypeError, "tool_calls must be an array"),
])
def test_malformed_messages_raise_before_any_rendering(tok, messages, error, match):
    """These rendered quietly ('<|im_start|>\\nx', a role "5", content "5", the parts' repr) or
    raised transformers' error about the string's first character; vLLM's parser refuses them
    (its server answers 400)."""
    with pytest.raises(error, match=match):
        prompts(tok, messages)


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "only text parts"),
    ([{"content": "x"}], r"messages\[0\].*role"),
    (["x"], r"messages\[0\] must be an object"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"messages\[0\]\.content"),
])
def test_malformed_messages_are_a_400(messages, match):
    """(These were 400s already; the server now reads messages with LLM.chat's reader.)"""
    with pytest.raises(api.RequestError, match=match):
        api.parse_chat({"messages": messages}, {})


def test_the_server_reads_the_text_parts_vllm_reads(tok):
    """vLLM's parser reads input_text, output_text and refusal parts, and plain strings, as text
    and skips a part whose text is null or empty; the server answered all of them 400 "only
    text parts are supported"."""
    content = ["a", "", {"type": "input_text", "text": "b"}, {"type": "text", "text": None},
               {"type": "output_text", "text": "c"}, {"type": "refusal", "refusal": "d"}]
    want = oracle(tok, [{"role": "user", "content": "a\nb\nc\nd"}])
    messages = [{"role": "user", "content": content}]
    assert server_prompt(tok, {"messages": messages})["prompt"] == want
    assert prompts(tok, messages)[0]["prompt"] == want


def test_chat_template_kwargs_may_name_the_template(tok):
    """vLLM's LLM.chat updates its template arguments with chat_template_kwargs, so a
    chat_template there is the template; here it was "got multiple values for keyword argument
    'chat_template'". Its tools, too, win over the argument's."""
    other = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert prompts(tok, [USER], chat_template_kwargs={"chat_template": other})[0]["prompt"] == \
        f"[user] {USER['content']}\n"
    with pytest.raises(TypeError, match="chat_template must be a Jinja template string"):
        prompts(tok, [USER], chat_template_kwargs={"chat_template": 5})
    one = prompts(tok, [USER], tools=TOOLS, chat_template_kwargs={"tools": TOOLS[:1]})[0]
    assert '"get_weather"' in one["prompt"] and '"get_time"' not in one["prompt"]


def test_other_roles_and_keys_reach_the_template_as_given(tok):
    """vLLM maps no role (a developer message reaches a Qwen3-style template as "developer")
    and keeps a message's name and a tool message's tool_call_id."""
    conv = [{"role": "developer", "content": "Be brief.", "name": "ops"}, USER]
    named = "{% for m in messages %}{{ m.role }}/{{ m.name }}/{{ m.tool_call_id }}|{% endfor %}"
    tool = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert prompts(tok, conv)[0]["prompt"] == oracle(tok, conv)
    assert prompts(tok, [*conv, tool], chat_template=named)[0]["prompt"] == \
        "developer/ops/|user//|tool//c1|"
