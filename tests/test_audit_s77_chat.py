"""Session 77's audit of chat and server parity with current vLLM.

Earlier tool calls' arguments: vLLM's _postprocess_messages (entrypoints/chat_utils) parses an
assistant's tool_calls[].function.arguments into the object the chat template reads; since its
PR #48922 a string that is not JSON, or JSON that is not an object, becomes {} with a warning
rather than a 400 (such a string lives in the conversation's history, so refusing it refused
every later turn). minivllm refused broken JSON (ValueError in LLM.chat, 400 in the server) and
kept JSON arrays and numbers. A tool call of a type other than "function" is vLLM's 400.

max_tokens past the context: vLLM's server refuses a request whose prompt and requested output
tokens exceed max_model_len (renderers/params.py TokenizeParams: "This model's maximum context
length is ..."; max_tokens > max_model_len on its own; truncate_prompt_tokens past the room left,
-1 meaning that room) and lowers a max_tokens left to the server's default
(generation_config's max_new_tokens) to the room left (get_max_tokens), which
vllm:request_params_max_tokens then observes. minivllm's server took such requests and stopped
them at max_model_len, observing the default. vLLM's LLM.generate checks no max_tokens
(its TokenizeParams reserve no output tokens): the request stops at max_model_len, as here."""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import shutil

import pytest

from minivllm import SamplingParams
from minivllm.runtime.server import OpenAIServer

from engine_helpers import make_llm, serving
from test_audit_s76_chat import USER, oracle, prompts, server_prompt, tok  # noqa: F401
from test_reasoning_tools import TEMPLATE, TOOLS

MAX_LEN = 128
DEFAULT_MAX_TOKENS = 500  # generation_config.json's max_new_tokens: past any room left


def _history(arguments) -> list[dict]:
    """A tool loop whose earlier call has `arguments` as the client sent them back."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}
    return [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def _as_vllm(arguments) -> list[dict]:
    """The conversation vLLM hands the template for _history(...): content "" and arguments
    the object given."""
    conv = _history(arguments)
    conv[1] = {**conv[1], "content": ""}
    return conv


# Broken JSON (truncated by max_tokens, or by an EOS mid-string, as vLLM's reports), a blank
# string, JSON that is no object, and objects given already parsed that are no object.
COERCED = ['{"city": "Ro', "{x", "   ", "[1, 2]", "42", '"Rome"', "true", [1, 2], 7]


@pytest.mark.parametrize("arguments", COERCED, ids=repr)
def test_unreadable_history_arguments_become_an_empty_object(tok, caplog, arguments):  # noqa: F811
    """LLM.chat and the server render the conversation as the template renders it with
    arguments {} (transformers' apply_chat_template as the oracle), and warn as vLLM does;
    before, broken JSON was refused and JSON arrays and numbers reached the template."""
    want = oracle(tok, _as_vllm({}), tools=TOOLS)
    assert '"arguments": {}' in want
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        assert prompts(tok, _history(arguments), tools=TOOLS)[0]["prompt"] == want
        assert server_prompt(tok, {"messages": _history(arguments),
                                   "tools": TOOLS})["prompt"] == want
    warned = [r.getMessage() for r in caplog.records if r.name == "minivllm"]
    assert len(warned) == 2 and all("'get_weather'" in w and "coercing to an empty object" in w
                                    for w in warned), warned


def test_readable_history_arguments_are_kept_without_a_warning(tok, caplog):  # noqa: F811
    """The object and the empty forms vLLM reads silently stay as they were."""
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        for given, read in [('{"city": "Rome", "days": 1}', {"city": "Rome", "days": 1}),
                            ({"city": "Rome"}, {"city": "Rome"}), ("", {}), (None, {}),
                            ([], {}), (0, {})]:
            want = oracle(tok, _as_vllm(read), tools=TOOLS)
            assert prompts(tok, _history(given), tools=TOOLS)[0]["prompt"] == want, given
    assert not [r for r in caplog.records if r.name == "minivllm"]


def test_a_tool_call_of_another_type_is_refused_as_vllm(tok):  # noqa: F811
    conv = _history("{}")
    conv[1]["tool_calls"][0]["type"] = "custom"
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]: chat completions only "
                                         r"support assistant tool_calls of type 'function'"):
        prompts(tok, conv, tools=TOOLS)


# -- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The demo checkpoint, greedy, whose generation_config.json asks for more new tokens than
    any prompt leaves room for."""
    from minivllm.runtime.demo import ensure_demo_model

    path = str(tmp_path_factory.mktemp("s77") / "model")
    shutil.copytree(ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model")), path)
    gen_path = os.path.join(path, "generation_config.json")
    with open(gen_path) as f:
        gen = json.load(f)
    gen.update(temperature=0.0, max_new_tokens=DEFAULT_MAX_TOKENS)
    with open(gen_path, "w") as f:
        json.dump(gen, f)
    return path


@pytest.fixture(scope="module")
def server(model_dir, device):
    llm = make_llm(model_dir, device, max_model_len=MAX_LEN, num_kv_blocks=16)
    assert llm.get_diff_sampling_param()["max_tokens"] == DEFAULT_MAX_TOKENS
    srv = OpenAIServer(llm, port=0, model_name="tiny")
    with serving(srv):
        yield srv


def call(server, method: str, path: str, body=None):
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        return r.status, (json.loads(data) if method == "POST" else data.decode())
    finally:
        conn.close()


def max_tokens_observed(server) -> tuple[float, float]:
    """(sum, count) of vllm:request_params_max_tokens, as GET /metrics renders them."""
    status, text = call(server, "GET", "/metrics")
    assert status == 200
    got = dict(re.findall(r"^vllm:request_params_max_tokens_(sum|count)\{[^}]*\} (\S+)$",
                          text, re.M))
    assert set(got) == {"sum", "count"}, text
    got = {k: float(v) for k, v in got.items()}
    return got["sum"], got["count"]


def assert_refused(server, path, body, message: str, param: str) -> None:
    """A 400 with vLLM's words and param, nothing left in the engine."""
    status, answer = call(server, "POST", path, body)
    assert status == 400, answer
    assert answer["error"]["message"] == message and answer["error"]["param"] == param, answer
    assert not server.llm.engine.requests and not server.loop.owners


def test_the_server_serves_a_history_with_broken_arguments(server):
    """A 200 (was a 400), its prompt the one the same history with arguments {} gives."""
    def short(arguments):  # a history the small context holds
        return [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c", "content": "ok"}]

    body = {"messages": short('{"a": '), "chat_template": TEMPLATE, "max_tokens": 3,
            "ignore_eos": True}
    status, broken = call(server, "POST", "/v1/chat/completions", body)
    assert status == 200, broken
    status, fixed = call(server, "POST", "/v1/chat/completions", {**body, "messages": short({})})
    assert status == 200, fixed
    assert broken["usage"] == fixed["usage"]
    assert broken["choices"][0]["message"] == fixed["choices"][0]["message"]


PROMPT = list(range(10, 50))  # 40 token ids: MAX_LEN leaves 88 output tokens


def test_max_tokens_past_the_room_left_is_refused_as_vllm(server):
    """vLLM's server refuses what its LLM.generate serves (stopped at max_model_len); minivllm's
    server served it too."""
    room = MAX_LEN - len(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": room + 1, "ignore_eos": True}
    assert_refused(server, "/v1/completions", body,
                   f"This model's maximum context length is {MAX_LEN} tokens. However, you "
                   f"requested {room + 1} output tokens and your prompt contains {len(PROMPT)} "
                   f"input tokens, for a total of {MAX_LEN + 1} tokens. Please reduce the length "
                   f"of the input prompt or the number of requested output tokens. "
                   f"(parameter=input_tokens, value={len(PROMPT)})", "input_tokens")
    # every prompt is checked before any is queued
    assert_refused(server, "/v1/completions", {**body, "prompt": [PROMPT[:5], PROMPT]},
                   f"This model's maximum context length is {MAX_LEN} tokens. However, you "
                   f"requested {room + 1} output tokens and your prompt contains {len(PROMPT)} "
                   f"input tokens, for a total of {MAX_LEN + 1} tokens. Please reduce the length "
                   f"of the input prompt or the number of requested output tokens. "
                   f"(parameter=input_tokens, value={len(PROMPT)})", "input_tokens")
    # exactly the room: served, all of it generated
    status, answer = call(server, "POST", "/v1/completions", {**body, "max_tokens": room})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == room
    assert answer["choices"][0]["finish_reason"] == "length"
    # the same request to LLM.generate: taken and stopped at max_model_len (vLLM's LLM)
    llm = server.llm
    before = max_tokens_observed(server)
    out = server.loop.call(lambda: llm.generate(
        [{"prompt_token_ids": PROMPT}],
        SamplingParams(max_tokens=room + 100, temperature=0, ignore_eos=True), use_tqdm=False))
    assert len(out[0].outputs[0].token_ids) == room
    assert out[0].outputs[0].finish_reason == "length"
    after = max_tokens_observed(server)
    assert (after[0] - before[0], after[1] - before[1]) == (room + 100, 1)


def test_a_completions_default_16_tokens_count_against_the_context(server):
    """A completion without max_tokens asks for OpenAI's 16 (vLLM's CompletionRequest)."""
    long = list(range(10, 10 + MAX_LEN - 15))
    assert_refused(server, "/v1/completions", {"prompt": long},
                   f"This model's maximum context length is {MAX_LEN} tokens. However, you "
                   f"requested 16 output tokens and your prompt contains {len(long)} input "
                   f"tokens, for a total of {MAX_LEN + 1} tokens. Please reduce the length of "
                   f"the input prompt or the number of requested output tokens. "
                   f"(parameter=input_tokens, value={len(long)})", "input_tokens")
    status, answer = call(server, "POST", "/v1/completions",
                          {"prompt": long[1:], "ignore_eos": True})
    assert status == 200 and answer["usage"]["completion_tokens"] == 16, answer


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_max_model_len_names_its_field(server, field):
    assert_refused(server, "/v1/chat/completions",
                   {"messages": [USER], field: MAX_LEN + 1},
                   f"{field}={MAX_LEN + 1} cannot be greater than max_model_len={MAX_LEN}. "
                   f"Please request fewer output tokens. (parameter={field}, "
                   f"value={MAX_LEN + 1})", field)


def test_truncation_keeps_the_room_max_tokens_needs(server):
    """truncate_prompt_tokens=-1 keeps the last max_model_len - max_tokens prompt tokens
    (vLLM's max_input_tokens; minivllm kept max_model_len of them and refused the prompt), and
    a truncate_prompt_tokens past that room is vLLM's 400."""
    long = list(range(10, 10 + MAX_LEN + 20))
    status, answer = call(server, "POST", "/v1/completions",
                          {"prompt": long, "max_tokens": 8, "truncate_prompt_tokens": -1,
                           "ignore_eos": True})
    assert status == 200, answer
    assert answer["usage"] == {"prompt_tokens": MAX_LEN - 8, "completion_tokens": 8,
                               "total_tokens": MAX_LEN}
    status, whole = call(server, "POST", "/v1/completions",
                         {"prompt": long[-(MAX_LEN - 8):], "max_tokens": 8, "ignore_eos": True})
    assert whole["choices"][0]["text"] == answer["choices"][0]["text"]
    assert_refused(server, "/v1/completions",
                   {"prompt": long, "max_tokens": 8, "truncate_prompt_tokens": MAX_LEN - 7},
                   f"truncate_prompt_tokens={MAX_LEN - 7} cannot be greater than max_model_len "
                   f"- max_tokens = {MAX_LEN - 8}. Please request a smaller truncation size. "
                   f"(parameter=truncate_prompt_tokens, value={MAX_LEN - 7})",
                   "truncate_prompt_tokens")


def test_a_default_max_tokens_is_lowered_to_the_room_left(server):
    """A chat without max_tokens takes generation_config's max_new_tokens (500): vLLM's server
    gives it min(500, max_model_len - prompt_len), which the histogram observes; minivllm
    observed 500."""
    before = max_tokens_observed(server)
    status, answer = call(server, "POST", "/v1/chat/completions",
                          {"messages": [USER], "ignore_eos": True})
    assert status == 200, answer
    prompt_len = answer["usage"]["prompt_tokens"]
    assert answer["usage"]["completion_tokens"] == MAX_LEN - prompt_len
    after = max_tokens_observed(server)
    assert (after[0] - before[0], after[1] - before[1]) == (MAX_LEN - prompt_len, 1)
