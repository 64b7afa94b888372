"""Session 78's audit of the server's streamed responses (server-sent events of /v1/completions
and /v1/chat/completions) against current vLLM (vllm-project/vllm):
entrypoints/openai/completion/serving.py (completion_stream_generator),
entrypoints/openai/chat_completion/serving.py (chat_completion_stream_generator),
entrypoints/serve/utils/api_utils.py (should_include_usage) and the protocol models
(chat_completion/protocol.py, completion/protocol.py, generate/base/protocol.py).

An echoed stream's text_offset: vLLM carries previous_text_lens[i] past the echoed prompt's text
(delta_text is the prompt and the first token's); minivllm counted the first token's text alone,
so every later chunk's offsets were the prompt's length short.

continuous_usage_stats: vLLM's chunk usage is its own choice's tokens so far and its own prompt's
(previous_num_tokens[i], num_prompt_tokens[prompt_idx]), a chat's role (and echo) chunks 0 tokens
of completion; minivllm summed every choice and prompt seen. And it needs include_usage: vLLM's
should_include_usage gives continuous usage only with include_usage (a stream asking for no usage
gets none); an empty stream_options without a stream is taken (validate_stream_options refuses
only a non-empty one).

A chat stream's first chunks: vLLM sends every choice's role chunk first, then (echo) every
choice's echo, before any content; minivllm sent each choice's role just before its content.

A chat stream without a reasoning or tool parser: vLLM's delta is DeltaMessage(content=...) for
every output with tokens, "" where their text is held back (a stop string's buffer) or empty;
minivllm sent no chunk for such tokens, and a last chunk with an empty delta.

An "auto" tool call cut by max_tokens in a stream: vLLM's stream says "tool_calls" only where the
completion stopped (finish_reason "stop"), so it ends "length"; minivllm said "tool_calls".

A failure once the stream has begun (here a formatting error): vLLM catches it in the generator
and sends an error data event, then [DONE]; minivllm wrote a second HTTP response (a 500's status
line and JSON) into the event stream, with no [DONE].

prompt_tokens_details: vLLM's --enable-prompt-tokens-details gives usage {"cached_tokens": N}
(the prompt tokens found in the prefix cache) in a whole response and a stream's usage chunk, not
in continuous chunk usage; minivllm's server had no such option (OpenAIServer takes it now).

Found as vLLM's and left as they were (tested elsewhere or here): id, created and model constant
across a stream; n > 1 indexes (prompt * n + choice for completions) and one finish chunk each;
the usage chunk's choices []; stop_reason on the last chunk; chat and completion logprobs per
chunk; an engine failure's error event (test_server); tool call deltas' index, id, type, name
then argument pieces (test_tool_streaming); the reasoning fields (test_reasoning_tools)."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from minivllm.runtime import server as server_module
from minivllm.runtime.server import OpenAIServer

from engine_helpers import make_llm, serving
from test_reasoning_tools import model_dir  # noqa: F401 (a tiny Qwen3 with the tool tags)
from test_server import post, stream

PROMPTS = ["The quick brown fox", "Hello, my name is"]
USER = [{"role": "user", "content": "What is the weather like today?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "note": {"type": "string"}}}}}
NOTE_REGEX = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
              r'"note": "[a-z]{24}"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def plain(model_dir, device):  # noqa: F811
    """No reasoning or tool parser; prompt_tokens_details on."""
    srv = OpenAIServer(make_llm(model_dir, device, max_model_len=1024), port=0,
                       model_name="tiny", enable_prompt_tokens_details=True)
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def tools(model_dir, device):  # noqa: F811
    srv = OpenAIServer(make_llm(model_dir, device, max_model_len=1024, reasoning_parser="qwen3"),
                       port=0, model_name="tiny", enable_auto_tool_choice=True,
                       tool_call_parser="hermes")
    with serving(srv):
        yield srv


def raw_stream(server, path: str, body: dict) -> str:
    host, port = server.address
    req = urllib.request.Request(f"http://{host}:{port}{path}",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()


def by_index(events: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for ev in events:
        for c in ev["choices"]:
            out.setdefault(c["index"], []).append(c)
    return out


def prompt_tokens(server, text: str) -> int:
    status, got = post(server, "/tokenize", {"prompt": text})
    assert status == 200, got
    return got["count"]


# -- an echoed stream's text_offset --------------------------------------------------------------


def test_an_echoed_streams_offsets_continue_past_the_prompt(plain):
    body = {"prompt": PROMPTS, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 1}
    _, whole = post(plain, "/v1/completions", body)
    events = stream(plain, "/v1/completions", body)
    for index, chunks in by_index(events).items():
        assert chunks[0]["text"].startswith(PROMPTS[index]) and len(chunks) == 4
        sent = 0
        for c in chunks:  # vLLM's: from the text sent before, then on by each token's text
            tokens, offsets = c["logprobs"]["tokens"], c["logprobs"]["text_offset"]
            assert offsets == [sent + sum(map(len, tokens[:k])) for k in range(len(tokens))]
            sent += len(c["text"])
        offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
        if index == 0:  # its tokens' texts join to its text: the whole response's offsets
            assert offsets == whole["choices"][0]["logprobs"]["text_offset"]


# -- continuous usage ------------------------------------------------------------------------------


def test_continuous_usage_is_each_choices_own(plain):
    """Completions: each chunk its prompt's tokens and its choice's tokens so far (counted by the
    chunks' logprobs tokens), the usage chunk the whole request's."""
    counts = [prompt_tokens(plain, p) for p in PROMPTS]
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 4,
            "ignore_eos": True, "logprobs": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = stream(plain, "/v1/completions", body)
    so_far: dict[int, int] = {}
    for ev in events[:-1]:
        (c,) = ev["choices"]
        so_far[c["index"]] = so_far.get(c["index"], 0) + len(c["logprobs"]["tokens"])
        prompt = counts[c["index"] // 2]
        assert ev["usage"] == {"prompt_tokens": prompt, "completion_tokens": so_far[c["index"]],
                               "total_tokens": prompt + so_far[c["index"]]}
    assert so_far == {0: 3, 1: 3, 2: 3, 3: 3}
    last = events[-1]
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == sum(counts)
    assert last["usage"]["completion_tokens"] == 12


def test_a_chats_continuous_usage_starts_at_zero_for_each_choice(plain):
    _, whole = post(plain, "/v1/chat/completions", {"messages": USER, "max_tokens": 1})
    prompt = whole["usage"]["prompt_tokens"]
    events = stream(plain, "/v1/chat/completions", {
        "messages": USER, "n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 4,
        "ignore_eos": True, "logprobs": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    roles = [ev for ev in events if ev["choices"] and "role" in ev["choices"][0]["delta"]]
    assert all(ev["usage"] == {"prompt_tokens": prompt, "completion_tokens": 0,
                               "total_tokens": prompt} for ev in roles) and len(roles) == 2
    so_far: dict[int, int] = {}
    for ev in events[len(roles):-1]:
        (c,) = ev["choices"]
        so_far[c["index"]] = so_far.get(c["index"], 0) + len(c["logprobs"]["content"])
        assert ev["usage"]["prompt_tokens"] == prompt
        assert ev["usage"]["completion_tokens"] == so_far[c["index"]]
    assert so_far == {0: 3, 1: 3}
    counts = {k: v for k, v in events[-1]["usage"].items() if k != "prompt_tokens_details"}
    assert counts == {"prompt_tokens": prompt, "completion_tokens": 6, "total_tokens": prompt + 6}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPTS[0]}),
    ("/v1/chat/completions", {"messages": USER}),
], ids=["completion", "chat"])
def test_no_usage_without_include_usage(plain, path, body):
    """continuous_usage_stats asks for nothing where include_usage is false (vLLM's
    should_include_usage); an empty stream_options needs no stream."""
    events = stream(plain, path, {**body, "max_tokens": 3, "stream_options": {
        "include_usage": False, "continuous_usage_stats": True}})
    assert events and all("usage" not in ev for ev in events)
    status, got = post(plain, path, {**body, "max_tokens": 2, "stream_options": {}})
    assert status == 200, got
    status, got = post(plain, path, {**body, "max_tokens": 2,
                                     "stream_options": {"include_usage": False}})
    assert status == 400 and "stream" in got["error"]["message"]


# -- a chat stream's first chunks, and its deltas without parsers ---------------------------------


def test_every_choices_role_then_echo_come_first(plain):
    events = stream(plain, "/v1/chat/completions", {
        "messages": [*USER, {"role": "assistant", "content": "It is"}],
        "add_generation_prompt": False, "continue_final_message": True, "echo": True, "n": 3,
        "max_tokens": 2, "temperature": 1.0, "seed": 2})
    head = [ev["choices"][0] for ev in events[:6]]
    assert [(c["index"], c["delta"]) for c in head] == [
        *((k, {"role": "assistant", "content": ""}) for k in range(3)),
        *((k, {"content": "It is"}) for k in range(3))]
    assert all(len(ev["choices"]) == 1 for ev in events)


def test_a_plain_chat_streams_content_for_each_token(plain):
    """A stop string holds back the text of the tokens before it could be ruled out: vLLM still
    sends each token's chunk, its content "" (and the last chunk's content, "" too where the
    text ended before it)."""
    body = {"messages": USER, "max_tokens": 4, "ignore_eos": True, "stop": ["z" * 40],
            "stream_options": {"include_usage": True}}
    _, whole = post(plain, "/v1/chat/completions", {**body, "stream_options": None})
    events = stream(plain, "/v1/chat/completions", body)
    deltas = [ev["choices"][0]["delta"] for ev in events[1:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(deltas) == events[-1]["usage"]["completion_tokens"] == 4
    assert all(set(d) == {"content"} for d in deltas)
    assert deltas[0]["content"] == ""  # held back: the text is shorter than the stop string
    assert "".join(d["content"] for d in deltas) == whole["choices"][0]["message"]["content"]


# -- an "auto" tool call cut by max_tokens --------------------------------------------------------


def test_a_streamed_call_cut_by_max_tokens_ends_length(tools):
    body = {"messages": USER, "tools": [WEATHER], "structured_outputs": {"regex": NOTE_REGEX},
            "chat_template_kwargs": {"enable_thinking": False}}
    status, full = post(tools, "/v1/chat/completions", {**body, "max_tokens": 120})
    assert status == 200 and full["choices"][0]["finish_reason"] == "tool_calls", full
    cut = full["usage"]["completion_tokens"] - 8  # inside the note's letters
    _, whole = post(tools, "/v1/chat/completions", {**body, "max_tokens": cut})
    events = stream(tools, "/v1/chat/completions", {**body, "max_tokens": cut})
    calls = [p for ev in events for p in ev["choices"][0]["delta"].get("tool_calls", ())]
    assert calls and calls[0]["function"]["name"] == "get_weather"  # the call began streaming
    reasons = [c["finish_reason"] for ev in events for c in ev["choices"] if c["finish_reason"]]
    assert reasons == ["length"]
    assert whole["choices"][0]["finish_reason"] == "length"
    # Whole, the cut call is no call (vLLM's parser fails on it): its text is the content.
    assert "tool_calls" not in whole["choices"][0]["message"]


# -- a failure once the stream has begun -----------------------------------------------------------


@pytest.mark.parametrize("path, body, name", [
    ("/v1/completions", {"prompt": PROMPTS[0]}, "completion_choice"),
    ("/v1/chat/completions", {"messages": USER}, "chat_choice"),
], ids=["completion", "chat"])
def test_a_failure_mid_stream_is_an_error_event_then_done(plain, monkeypatch, path, body, name):
    real, calls = getattr(server_module, name), []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("formatting broke")
        return real(*args, **kw)

    monkeypatch.setattr(server_module, name, failing)
    text = raw_stream(plain, path, {**body, "max_tokens": 40, "ignore_eos": True})
    monkeypatch.undo()
    events = [e[len("data: "):] for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in text.split("\n\n") if e), text
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "formatting broke" in error["message"] and error["code"] == 500
    assert error["type"] == "InternalServerError"
    assert all("choices" in json.loads(e) for e in events[:-2])
    engine = plain.llm.engine
    deadline = time.monotonic() + 30
    while (engine.requests or plain.loop.owners) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.requests and not plain.loop.owners  # aborted, its blocks freed
    assert post(plain, path, {**body, "max_tokens": 2})[0] == 200


# -- prompt_tokens_details -------------------------------------------------------------------------


def test_prompt_tokens_details_count_the_cached_prompt(plain, tools):
    """The second request of a prompt finds its full blocks in the prefix cache: all but the
    last token's block (the last token is always computed), as vLLM's prefix cache."""
    prompt = " ".join(f"word{k}" for k in range(30)) + " and then"
    n = prompt_tokens(plain, prompt)
    block = plain.llm.config.block_size
    assert n > 2 * block
    body = {"prompt": prompt, "max_tokens": 2}
    _, first = post(plain, "/v1/completions", body)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    _, again = post(plain, "/v1/completions", body)
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": (n - 1) // block * block}
    events = stream(plain, "/v1/completions", {**body, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    assert all("prompt_tokens_details" not in ev["usage"] for ev in events[:-1])
    assert events[-1]["usage"] == again["usage"]
    # Off by default (vLLM's): no such key.
    _, other = post(tools, "/v1/completions", body)
    assert set(other["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    with pytest.raises(TypeError, match="enable_prompt_tokens_details"):
        OpenAIServer(plain.llm, port=0, listen=False, enable_prompt_tokens_details="yes")


def test_a_requests_logit_bias_is_clamped_to_100_as_vllms_server():
    """vLLM's server builds a request's SamplingParams through SamplingParams.from_optional,
    which clamps each logit bias to [-100, 100] (OpenAI's range) before the sampler adds it; a
    bias of 1e6 used to reach the sampler as given. What is no number is still refused."""
    from minivllm.runtime import openai_api as api

    for route in (lambda b: api.parse_completion({"prompt": "x", **b}, {}),
                  lambda b: api.parse_chat({"messages": [{"role": "user", "content": "x"}],
                                            **b}, {})):
        params = route({"logit_bias": {"5": 1e6, "7": -1e6, "9": 3, "11": -2.5}}).params
        assert params.logit_bias == {5: 100.0, 7: -100.0, 9: 3, 11: -2.5}
        with pytest.raises(api.RequestError, match="logit_bias"):
            route({"logit_bias": {"5": "high"}})
