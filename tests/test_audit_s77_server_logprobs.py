"""Session 77's third audit of the OpenAI server and chat parsing against current vLLM
(vllm-project/vllm).

A completion's echo with an explicit prompt_logprobs: vLLM's CompletionRequest.to_sampling_params
(entrypoints/openai/completion/protocol.py) falls back to `logprobs` only where prompt_logprobs
is None (`if prompt_logprobs is None and self.echo: prompt_logprobs = self.logprobs`); minivllm
scored the prompt at max(logprobs, prompt_logprobs).

prompt_logprobs 0 with "stream": true: vLLM's check_logprobs (completion and chat_completion
protocol.py) refuses a stream's prompt_logprobs only when > 0 or -1; minivllm refused any.

A chat message's other keys: vLLM's _parse_chat_message_content (renderers/chat_utils.py) hands
the template role and content, a string name or task of any role, an assistant's tool_calls and
reasoning (also as reasoning_content), a tool message's tool_call_id and a developer message's
tools (None where not given), and nothing else; minivllm passed every key through, for any role
(LLM.chat and the server alike)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from minivllm import SamplingParams
from minivllm.runtime import openai_api as api
from minivllm.runtime.demo import ensure_demo_model
from minivllm.runtime.server import OpenAIServer

from engine_helpers import make_llm, serving
from test_audit_s76_chat import USER, oracle, prompts, server_prompt, tok  # noqa: F401

PROMPT = "Hello there"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))


@pytest.fixture(scope="module")
def reference(model_dir, device):
    """The LLM API on the same checkpoint: what vLLM's sampling params give."""
    return make_llm(model_dir, device, max_model_len=256, num_kv_blocks=16)


@pytest.fixture(scope="module")
def server(model_dir, device):
    srv = OpenAIServer(make_llm(model_dir, device, max_model_len=256, num_kv_blocks=16),
                       port=0, model_name="tiny")
    with serving(srv):
        yield srv


def send(server, path: str, body: dict) -> tuple[int, str]:
    """-> (status, the raw answer: JSON, or a stream's events)."""
    host, port = server.address
    req = urllib.request.Request(f"http://{host}:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def events(text: str) -> list[dict]:
    chunks = [e[len("data: "):] for e in text.split("\n\n") if e]
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


# -- echo with an explicit prompt_logprobs -------------------------------------------------------


def test_echo_takes_an_explicit_prompt_logprobs_smaller_than_logprobs(server, reference):
    """The brief's reproduction: the prompt is scored at prompt_logprobs 1, as the LLM API's
    SamplingParams(logprobs=3, prompt_logprobs=1) (vLLM's to_sampling_params), not at 3: the
    echoed prompt tokens' top_logprobs and the prompt_logprobs field hold the token itself and
    one alternative at most."""
    status, text = send(server, "/v1/completions", {
        "prompt": PROMPT, "echo": True, "logprobs": 3, "prompt_logprobs": 1, "max_tokens": 1,
        "temperature": 0})
    assert status == 200, text
    choice = json.loads(text)["choices"][0]
    want = reference.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=3,
                                                       prompt_logprobs=1), use_tqdm=False)[0]
    n_prompt = len(want.prompt_token_ids)
    assert choice["prompt_logprobs"] == api.vllm_prompt_logprobs(want.prompt_logprobs)
    assert all(len(e) <= 2 for e in choice["prompt_logprobs"][1:])
    tops = choice["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(len(t) <= 2 for t in tops[1:n_prompt])
    assert len(tops[n_prompt]) >= 3  # the generated token still gets logprobs 3
    # Without prompt_logprobs echo scores the prompt at `logprobs`, as before.
    params = api.parse_completion({"prompt": PROMPT, "echo": True, "logprobs": 3}, {}).params
    assert params.prompt_logprobs == 3


# -- prompt_logprobs 0 with a stream -------------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [USER]}),
], ids=["completion", "chat"])
def test_a_stream_takes_prompt_logprobs_zero(server, path, body):
    """vLLM streams prompt_logprobs 0 (its stream chunks have no prompt_logprobs field) and
    refuses 1 and -1 with a stream."""
    base = {**body, "max_tokens": 2, "stream": True}
    status, text = send(server, path, {**base, "prompt_logprobs": 0})
    assert status == 200, text
    chunks = events(text)
    assert chunks and all("prompt_logprobs" not in c and
                          all("prompt_logprobs" not in ch for ch in c["choices"]) for c in chunks)
    for n in (1, -1):
        status, text = send(server, path, {**base, "prompt_logprobs": n})
        assert status == 400 and "prompt_logprobs" in text


# -- which keys of a chat message reach the template ---------------------------------------------

# Renders every key each message holds, sorted: what reaches the template shows.
EVERY_KEY = ("{% for m in messages %}{% for k, v in m|dictsort %}{{ k }}={{ v }};{% endfor %}|"
             "{% endfor %}")
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {}}}
GIVEN = [
    {"role": "system", "content": "s", "name": "ops", "tool_call_id": "x", "reasoning": "r",
     "extra": 1},
    {"role": "developer", "content": "d", "task": "t", "name": 5},
    {"role": "user", "content": "u", "reasoning_content": "rc", "tools": ["t"], "weight": 0},
    {"role": "assistant", "content": "a", "reasoning": "think", "reasoning_content": "old",
     "refusal": "no", "name": "bot", "tool_calls": [CALL]},
    {"role": "assistant", "content": "a2", "reasoning_content": "only", "audio": {"id": "x"}},
    {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather",
     "reasoning": "r"},
    USER]
# What vLLM's _parse_chat_message_content gives the template for GIVEN.
PASSED = [
    {"role": "system", "content": "s", "name": "ops"},
    {"role": "developer", "content": "d", "task": "t", "tools": None},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a", "reasoning": "think", "reasoning_content": "think",
     "name": "bot", "tool_calls": [CALL]},
    {"role": "assistant", "content": "a2"},
    {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"},
    USER]


def test_a_message_reaches_the_template_with_vllms_keys_alone(tok):
    """LLM.chat and the server's chat endpoint render what vLLM's parser passes, against
    transformers' apply_chat_template of that: a key-listing template, and the Qwen3-style one
    (an assistant's reasoning_content alone writes no earlier <think>, as in vLLM)."""
    want = oracle(tok, PASSED, chat_template=EVERY_KEY)
    assert prompts(tok, GIVEN, chat_template=EVERY_KEY)[0]["prompt"] == want
    assert server_prompt(tok, {"messages": GIVEN, "chat_template": EVERY_KEY})["prompt"] == want
    qwen = oracle(tok, PASSED)
    assert "only" not in qwen and "<think>\nthink\n</think>" in qwen
    assert prompts(tok, GIVEN)[0]["prompt"] == qwen
    assert server_prompt(tok, {"messages": GIVEN})["prompt"] == qwen
