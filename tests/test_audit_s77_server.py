"""Session 77's second audit of the OpenAI server against current vLLM (vllm-project/vllm).

A completion's "max_tokens": null: vLLM's CompletionRequest types it `int | None = 16`, so null
is None (absent is OpenAI's 16), and get_max_tokens (entrypoints/serve/utils/api_utils.py) gives
the request the room its prompt leaves, or generation_config's max_new_tokens where that is less;
minivllm read null as absent: 16 tokens.

tool_calls on a message whose role is not "assistant": vLLM's _parse_chat_message_content
(renderers/chat_utils.py) copies them into the conversation for an assistant alone, and
_postprocess_messages reads an assistant's alone, so another role's never reach the template and
nothing in them is refused; minivllm read and rendered them for any role (LLM.chat too).

A prompt that leaves no room for output: vLLM's server answers it 400 in its own words,
OpenAIServing._validate_input's (entrypoints/openai/engine/serving.py) where the request asks for
no output tokens ("This model's maximum context length is L tokens. However, your request has N
input tokens. ...", param input_tokens), TokenizeParams' where it asks for some; minivllm's
server gave the engine's own message. vLLM's LLM says it in its engine's words (v1
InputProcessor._validate_prompt_len: "The decoder prompt (length N) ...").

--override-generation-config: vLLM's serve flag (ModelConfig.override_generation_config), whose
max_new_tokens its server also takes as override_max_tokens, the least of which get_max_tokens
gives a request even when its own max_tokens asks for more (with --generation-config a directory,
that directory's max_new_tokens); minivllm's serve had no such flag."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minivllm import SamplingParams
from minivllm.runtime.server import OpenAIServer

from engine_helpers import make_llm, serving
from test_server import post as call
from test_audit_s76_chat import USER, oracle, prompts, server_prompt, tok  # noqa: F401
# model_dir: the demo checkpoint whose generation_config asks for DEFAULT_MAX_TOKENS (a fixture)
from test_audit_s77_chat import DEFAULT_MAX_TOKENS, MAX_LEN, model_dir  # noqa: F401

ROOM_OF_40 = MAX_LEN - 40


@pytest.fixture(scope="module")
def server(model_dir, device):
    srv = OpenAIServer(make_llm(model_dir, device, max_model_len=MAX_LEN, num_kv_blocks=16),
                       port=0, model_name="tiny")
    with serving(srv):
        yield srv


def generated(server, path: str, body: dict) -> int:
    status, answer = call(server, path, {"ignore_eos": True, **body})
    assert status == 200, answer
    return answer["usage"]["completion_tokens"]


PROMPT = list(range(10, 50))  # 40 token ids


# -- max_tokens: null ----------------------------------------------------------------------------


def test_a_null_max_tokens_gets_the_room_left(server):
    """A completion's null max_tokens: min(room, max_new_tokens 500) = the room (was OpenAI's
    16, which an absent one still gets); a chat's null max_tokens and max_completion_tokens are
    its default, as absent ones."""
    assert generated(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": None}) \
        == ROOM_OF_40
    assert generated(server, "/v1/completions", {"prompt": PROMPT}) == 16
    _, tokens = call(server, "/tokenize", {"messages": [USER]})
    room = MAX_LEN - tokens["count"]
    for nulls in ({"max_tokens": None}, {"max_completion_tokens": None},
                  {"max_tokens": None, "max_completion_tokens": None}):
        assert generated(server, "/v1/chat/completions", {"messages": [USER], **nulls}) == room


def test_a_null_max_tokens_takes_a_default_below_the_room(model_dir, device):
    """generation_config's max_new_tokens where it is less than the room (get_max_tokens)."""
    llm = make_llm(model_dir, device, max_model_len=MAX_LEN, num_kv_blocks=16,
                   override_generation_config={"max_new_tokens": 5})
    with serving(OpenAIServer(llm, port=0, model_name="tiny")) as srv:
        assert generated(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": None}) == 5
        assert generated(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 9}) == 9


# -- tool_calls on other roles than the assistant's ---------------------------------------------

# A template that renders any message's tool_calls: what reaches it shows.
ANY_ROLE_CALLS = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.tool_calls %}"
                  "{% for c in m.tool_calls %}[{{ c.function.name }} {{ c.function.arguments }}]"
                  "{% endfor %}{% endif %}{% endfor %}")
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}


@pytest.mark.parametrize("calls", [[CALL], "not calls", [{"function": 5}], {"x": 1},
                                   [{**CALL, "type": "custom"}]], ids=repr)
@pytest.mark.parametrize("role", ["user", "system", "tool", "developer"])
def test_tool_calls_of_another_role_never_reach_the_template(tok, role, calls):  # noqa: F811
    """LLM.chat and the server render the conversation as transformers renders it without those
    tool_calls (vLLM's), and refuse none of them (minivllm rendered well-formed ones and
    refused the rest); an assistant's are still read."""
    conv = [{"role": role, "content": "x", "tool_calls": calls}, USER]
    want = oracle(tok, [{"role": role, "content": "x"}, USER], chat_template=ANY_ROLE_CALLS)
    assert "[" not in want
    assert prompts(tok, conv, chat_template=ANY_ROLE_CALLS)[0]["prompt"] == want
    assert server_prompt(tok, {"messages": conv, "chat_template": ANY_ROLE_CALLS})["prompt"] \
        == want
    # the same calls on an assistant's message are read: arguments an object, a bad call refused
    assistant = [{"role": "assistant", "content": "x", "tool_calls": [CALL]}, USER]
    assert "[get_weather {'city': 'Rome'}]" in \
        prompts(tok, assistant, chat_template=ANY_ROLE_CALLS)[0]["prompt"]
    assistant[0]["tool_calls"] = [{"function": 5}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls\[0\] must be"):
        prompts(tok, assistant, chat_template=ANY_ROLE_CALLS)


# -- a prompt that leaves no room -----------------------------------------------------------------


def no_room(n: int) -> str:
    """vLLM's OpenAIServing._validate_input refusal, as its VLLMValidationError prints."""
    return (f"This model's maximum context length is {MAX_LEN} tokens. However, your request has "
            f"{n} input tokens. Please reduce the length of the input messages. "
            f"(parameter=input_tokens, value={n})")


def past_room(n: int, asked: int) -> str:
    """vLLM's TokenizeParams._token_len_check refusal."""
    return (f"This model's maximum context length is {MAX_LEN} tokens. However, you requested "
            f"{asked} output tokens and your prompt contains {n} input tokens, for a total of "
            f"{n + asked} tokens. Please reduce the length of the input prompt or the number of "
            f"requested output tokens. (parameter=input_tokens, value={n})")


def assert_refused(server, path: str, body: dict, message: str) -> None:
    status, answer = call(server, path, body)
    assert status == 400, answer
    assert answer["error"] == {"message": message, "type": "BadRequestError",
                               "param": "input_tokens", "code": 400}, answer
    assert not server.llm.engine.requests and not server.loop.owners


@pytest.mark.parametrize("n", [MAX_LEN, MAX_LEN + 5])
def test_a_prompt_that_fills_the_context_is_refused_in_vllms_words(server, n):
    """Asking for no output tokens (max_tokens null): _validate_input's words; asking for some:
    TokenizeParams'; each with param input_tokens (was the engine's message, param null)."""
    long = [10 + k % 90 for k in range(n)]
    assert_refused(server, "/v1/completions", {"prompt": long, "max_tokens": None}, no_room(n))
    assert_refused(server, "/v1/completions", {"prompt": long, "max_tokens": 4},
                   past_room(n, 4))
    assert_refused(server, "/v1/completions", {"prompt": long}, past_room(n, 16))
    # a text prompt, measured as the engine tokenizes it
    tok_ = server.llm.get_tokenizer()
    text = tok_.decode(long)
    m = len(tok_.encode(text))
    assert m >= MAX_LEN
    assert_refused(server, "/v1/completions", {"prompt": text, "max_tokens": None}, no_room(m))
    # a chat without max_tokens, its prompt the rendered conversation
    msgs = [{"role": "user", "content": text}]
    _, tokens = call(server, "/tokenize", {"messages": msgs})
    assert_refused(server, "/v1/chat/completions", {"messages": msgs}, no_room(tokens["count"]))
    # truncated to max_model_len (-1): it still leaves nothing
    assert_refused(server, "/v1/completions",
                   {"prompt": long + long, "max_tokens": None, "truncate_prompt_tokens": -1},
                   no_room(MAX_LEN))
    # one token shorter than the context: served, its one token generated
    assert generated(server, "/v1/completions",
                     {"prompt": long[:MAX_LEN - 1], "max_tokens": None}) == 1


def test_llm_generate_refuses_it_in_vllms_engine_words(server):
    """LLM.generate's words are vLLM's LLM's (v1 InputProcessor._validate_prompt_len)."""
    llm = server.llm

    def refusal(n: int) -> str:
        with pytest.raises(ValueError) as e:
            server.loop.call(lambda: llm.generate([{"prompt_token_ids": [10] * n}],
                                                  SamplingParams(max_tokens=1), use_tqdm=False))
        return str(e.value)

    assert refusal(MAX_LEN + 3) == (
        f"The decoder prompt (length {MAX_LEN + 3}) is longer than the maximum model length of "
        f"{MAX_LEN}. Make sure that `max_model_len` is no smaller than the number of text "
        f"tokens.")
    assert refusal(MAX_LEN) == (
        f"The decoder prompt (length {MAX_LEN}) plus the number of requested output tokens (at "
        f"least 1) is longer than the maximum model length of {MAX_LEN}. Make sure that "
        f"`max_model_len` is no smaller than the number of text tokens (prompt + requested "
        f"output tokens).")
    assert not llm.engine.requests


# -- --override-generation-config -----------------------------------------------------------------


def test_override_max_tokens_follows_vllms_rule(tmp_path):
    """vLLM's serving override_max_tokens: the override's max_new_tokens under "auto" and
    "vllm", the directory's max_tokens (after the override) under a directory."""
    from minivllm.runtime.generation_config import override_max_tokens, sampling_defaults

    for mode in ("auto", "vllm"):
        assert override_max_tokens(mode, {"max_new_tokens": 7}, {"max_tokens": 7}) == 7
        assert override_max_tokens(mode, {"temperature": 0.5}, {"max_tokens": 300}) is None
        assert override_max_tokens(mode, {"max_new_tokens": None}, {}) is None
        assert override_max_tokens(mode, None, {"max_tokens": 300}) is None
    file = {"max_new_tokens": 300, "temperature": 0.7}
    assert override_max_tokens(str(tmp_path), None, sampling_defaults(file, None, "f")) == 300
    assert override_max_tokens(str(tmp_path), {"max_new_tokens": 9},
                               sampling_defaults(file, {"max_new_tokens": 9}, "f")) == 9
    assert override_max_tokens(str(tmp_path), None, sampling_defaults({}, None, "f")) is None


def test_the_override_caps_even_an_asked_max_tokens(model_dir, device):
    """get_max_tokens: the least of the room, the max_tokens asked for (else the default) and
    override_max_tokens; a max_tokens past the room is still TokenizeParams' 400."""
    llm = make_llm(model_dir, device, max_model_len=MAX_LEN, num_kv_blocks=16,
                   override_generation_config={"max_new_tokens": 6})
    with pytest.raises(ValueError, match="override_max_tokens must be a positive integer"):
        OpenAIServer(llm, port=0, override_max_tokens=0)
    with serving(OpenAIServer(llm, port=0, model_name="tiny", override_max_tokens=6)) as srv:
        for body, want in [({"max_tokens": 50}, 6), ({"max_tokens": 4}, 4), ({}, 6),
                           ({"max_tokens": None}, 6), ({"max_tokens": 6}, 6)]:
            assert generated(srv, "/v1/completions", {"prompt": PROMPT, **body}) == want, body
            assert generated(srv, "/v1/chat/completions", {"messages": [USER], **body}) == want
        assert generated(srv, "/v1/chat/completions",
                         {"messages": [USER], "max_completion_tokens": 80}) == 6
        assert_refused(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": ROOM_OF_40 + 1},
                       past_room(len(PROMPT), ROOM_OF_40 + 1))


class _Served(Exception):
    """Raised by the stub server's serve_forever: what cmd_serve handed the server."""


def test_serve_takes_the_flag(model_dir, monkeypatch):
    """serve --override-generation-config reaches LLM(override_generation_config=...) and the
    server's override_max_tokens; run-batch parses it and hands it to its LLM; a bad one is
    named before the model loads."""
    import minivllm.runtime.llm as llm_module
    import minivllm.runtime.server as server_module
    from minivllm import cli

    made, served = [], []
    monkeypatch.setattr(llm_module, "LLM",
                        lambda model, **kw: made.append(kw) or SimpleNamespace(shutdown=bool))

    def server(llm, **kw):
        served.append(kw)
        return SimpleNamespace(address=("127.0.0.1", 0), http=SimpleNamespace(server_close=bool),
                               serve_forever=lambda: (_ for _ in ()).throw(KeyboardInterrupt))
    monkeypatch.setattr(server_module, "OpenAIServer", server)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)  # SIGTERM's handler left as is
    flag = ["--override-generation-config", '{"max_new_tokens": 5, "temperature": 0.3}']
    assert cli.main(["serve", model_dir, "--port", "0", *flag]) == 0
    assert made[-1]["override_generation_config"] == {"max_new_tokens": 5, "temperature": 0.3}
    assert served[-1]["override_max_tokens"] == 5
    # without the flag: the model's generation_config.json caps nothing (vLLM's "auto")
    assert cli.main(["serve", model_dir, "--port", "0"]) == 0
    assert "override_generation_config" not in made[-1]
    assert served[-1]["override_max_tokens"] is None
    # a directory's max_new_tokens caps (vLLM's rule for --generation-config DIR)
    assert cli.main(["serve", model_dir, "--port", "0", "--generation-config", model_dir]) == 0
    assert served[-1]["override_max_tokens"] == DEFAULT_MAX_TOKENS
    # run-batch: parsed, and its LLM built with it
    args = cli.build_parser().parse_args(["run-batch", "-i", "in", "-o", "out", "--model",
                                          model_dir, *flag])
    cli._make_llm(args, model_dir)
    assert made[-1]["override_generation_config"] == {"max_new_tokens": 5, "temperature": 0.3}
    # a key generation_config does not set: named, nothing loaded
    count = len(made)
    assert cli.main(["serve", model_dir, "--port", "0", "--override-generation-config",
                     '{"temprature": 0.3}']) == 2
    assert len(made) == count
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", model_dir, "--override-generation-config", "[1]"])
