"""Session 76's audit of the OpenAI-compatible server against vLLM's: request fields vLLM takes
that were refused (request_id on completions, chat and embeddings; chat's echo; /v1/embeddings'
chat form, messages instead of input; tools: [] with tool_choice "auto"), and the port rule that
`minivllm serve` and OpenAIServer each wrote. Bad values are a 400 naming the field before any
engine work, and the server answers as before after them."""

from __future__ import annotations

import argparse
import http.client
import json
import threading

import pytest
import torch

from minivllm.runtime import server as server_module
from minivllm.runtime.openai_api import RequestError, parse_chat, parse_embedding

from test_audit_s75_pooling import embeddings, hf_model, refused, tok  # noqa: F401
from test_audit_s75_pooling import server as emb_server  # noqa: F401  (an embedding model's)
from test_audit_s75_server import (FIXED, assert_refused, baseline, request,  # noqa: F401
                                   server)
from test_server import model_dir, stream  # noqa: F401

USER = {"role": "user", "content": "Hello, my name is"}
GREEDY = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}


def post(srv, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
    """-> (status, parsed JSON body), with extra request headers."""
    host, port = srv.address
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def chat(srv, body) -> dict:
    status, got = request(srv, "/v1/chat/completions", {**GREEDY, **body})
    assert status == 200, got
    return got


# -- request_id ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, prefix", [
    ("/v1/completions", FIXED, "cmpl"),
    ("/v1/chat/completions", {"messages": [USER], **GREEDY}, "chatcmpl"),
])
def test_request_id_names_the_response_as_vllms(server, path, body, prefix):
    """vLLM's request_id field: the response's id is "{prefix}-{request_id}", and its
    X-Request-Id header wins over the field (vLLM's _base_request_id)."""
    status, got = request(server, path, {**body, "request_id": "my-id-1"})
    assert status == 200 and got["id"] == f"{prefix}-my-id-1", got
    status, got = post(server, path, {**body, "request_id": "my-id-1"}, {"X-Request-Id": "hdr"})
    assert status == 200 and got["id"] == f"{prefix}-hdr", got
    status, got = post(server, path, body, {"X-Request-Id": "hdr2"})
    assert status == 200 and got["id"] == f"{prefix}-hdr2", got
    status, got = request(server, path, body)  # none given: a new one each time
    assert status == 200 and got["id"].startswith(f"{prefix}-") and "my-id" not in got["id"]
    events = stream(server, path, {**body, "request_id": "s-1"})
    assert events and {e["id"] for e in events} == {f"{prefix}-s-1"}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [USER], "max_tokens": 1}),
])
@pytest.mark.parametrize("value", [7, ["a"], True, {"id": "a"}])
def test_a_request_id_that_is_not_a_string_is_a_400(server, baseline, path, body, value):
    assert_refused(server, baseline, path, {**body, "request_id": value},
                   "'request_id' must be a string")


def test_requests_sharing_a_request_id_do_not_collide(server):
    """The id names responses only: the engine numbers its requests itself, so concurrent
    requests with one request_id each get their own completion."""
    prompts = ["The quick brown fox", "Hello, my name is", "The capital of", "Once upon"]
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    alone = {}
    for p in prompts:
        status, got = request(server, "/v1/completions", {**body, "prompt": p})
        assert status == 200, got
        alone[p] = got["choices"][0]["text"]
    results: dict = {}
    start = threading.Barrier(2 * len(prompts))

    def ask(k, p):
        start.wait()
        results[k] = request(server, "/v1/completions", {**body, "prompt": p,
                                                         "request_id": "same"})

    threads = [threading.Thread(target=ask, args=(k, p))
               for k, p in enumerate(prompts + prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, p in enumerate(prompts + prompts):
        status, got = results[k]
        assert status == 200 and got["id"] == "cmpl-same", got
        assert got["choices"][0]["text"] == alone[p]
    assert not server.llm.engine.requests and not server.loop.owners


# -- chat's echo ---------------------------------------------------------------------------------

PREFILL = [USER, {"role": "assistant", "content": "Bob and"}]
CONTINUE = {"messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True}


def test_echo_prepends_the_last_message_of_the_responses_role(server):
    """vLLM's echo: the content starts with the last message's where that message has the
    response's role (the assistant's, or the last message's without add_generation_prompt)."""
    plain = chat(server, CONTINUE)["choices"][0]["message"]
    echoed = chat(server, {**CONTINUE, "echo": True})["choices"][0]["message"]
    assert echoed == {**plain, "content": "Bob and" + plain["content"]}
    # The last message is the user's, the response the assistant's: nothing is echoed.
    plain = chat(server, {"messages": [USER]})
    echoed = chat(server, {"messages": [USER], "echo": True})
    assert echoed["choices"] == plain["choices"]
    # Without add_generation_prompt the response takes the last message's role (vLLM's).
    got = chat(server, {"messages": [USER], "add_generation_prompt": False, "echo": True})
    message = got["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith(USER["content"])
    assert len(message["content"]) > len(USER["content"])


def test_echo_streams_the_last_message_after_the_role(server):
    whole = chat(server, {**CONTINUE, "echo": True})["choices"][0]["message"]["content"]
    events = stream(server, "/v1/chat/completions", {**GREEDY, **CONTINUE, "echo": True})
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": "Bob and"}
    assert "".join(d.get("content") or "" for d in deltas) == whole
    # n choices: each its own role chunk, then its echo.
    events = stream(server, "/v1/chat/completions",
                    {**CONTINUE, "echo": True, "n": 2, "max_tokens": 3, "temperature": 1.0,
                     "seed": 1})
    for index in (0, 1):
        deltas = [c["delta"] for e in events for c in e["choices"] if c["index"] == index]
        assert deltas[:2] == [{"role": "assistant", "content": ""}, {"content": "Bob and"}]


def test_echo_must_be_a_boolean(server, baseline):
    assert_refused(server, baseline, "/v1/chat/completions",
                   {"messages": [USER], "echo": "yes"}, "'echo' must be true or false")


# -- tools: [] ------------------------------------------------------------------------------------

def test_an_empty_tools_list_is_no_tools():
    """vLLM reads an empty list as no tools: tool_choice "required" becomes "none" (its
    check_tool_usage), and "auto" parses no calls (its parser runs only where tools are)."""
    for choice in (None, "none", "auto", "required"):
        req = parse_chat({"messages": [USER], "tools": [], "tool_choice": choice}, {})
        assert req.tool_mode == "none" and req.params.structured_outputs is None
    with pytest.raises(RequestError, match="tools"):  # a named one still needs its tool
        parse_chat({"messages": [USER], "tools": [],
                    "tool_choice": {"type": "function", "function": {"name": "f"}}}, {})
    with pytest.raises(RequestError, match="`tools` must be set"):  # no tools at all
        parse_chat({"messages": [USER], "tool_choice": "auto"}, {})


def test_an_empty_tools_list_with_auto_answers_as_without_tools(server):
    """It was a 400 ("When using `tool_choice`, `tools` must be set."), though tools was set."""
    plain = chat(server, {"messages": [USER]})["choices"]
    for choice in ("auto", "required"):
        got = chat(server, {"messages": [USER], "tools": [], "tool_choice": choice})
        assert got["choices"] == plain


# -- /v1/embeddings' chat form ---------------------------------------------------------------------

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def rendered(emb_server, **kw) -> str:  # noqa: F811
    return emb_server.llm.get_tokenizer().apply_chat_template(CONVERSATION, tokenize=False, **kw)


def same_embeddings(srv, body, want_body) -> None:
    """The two requests' embeddings, equal but for float rounding (a prefix-cache hit)."""
    torch.testing.assert_close(torch.tensor(embeddings(srv, body)),
                               torch.tensor(embeddings(srv, want_body)), atol=1e-6, rtol=1e-5)


def test_embeddings_take_messages_through_the_chat_template(emb_server):  # noqa: F811
    """vLLM's EmbeddingChatRequest: the conversation rendered without a generation prompt, its
    text tokenized without the tokenizer's special tokens unless add_special_tokens is true."""
    text = rendered(emb_server, add_generation_prompt=False)
    same_embeddings(emb_server, {"messages": CONVERSATION},
                    {"input": text, "add_special_tokens": False})
    same_embeddings(emb_server, {"messages": CONVERSATION, "add_special_tokens": True},
                    {"input": text})
    prompted = rendered(emb_server, add_generation_prompt=True)
    assert prompted != text
    same_embeddings(emb_server, {"messages": CONVERSATION, "add_generation_prompt": True},
                    {"input": prompted, "add_special_tokens": False})
    status, got = post(emb_server, "/v1/embeddings",
                       {"messages": CONVERSATION, "request_id": "e-1"})
    assert status == 200 and got["id"] == "embd-e-1", got
    assert got["usage"]["prompt_tokens"] == len(
        emb_server.llm.get_tokenizer().encode(text, add_special_tokens=False))


@pytest.mark.parametrize("body, match", [
    ({}, "give 'input' or 'messages'"),
    ({"input": "Hello", "messages": CONVERSATION}, "give 'input' or 'messages'"),
    ({"messages": []}, "'messages' must not be empty"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"input": "Hello", "chat_template": "{{ 1 }}"}, "['chat_template'] need 'messages'"),
    ({"messages": CONVERSATION, "add_generation_prompt": True, "continue_final_message": True},
     "Cannot set both `continue_final_message` and `add_generation_prompt`"),
    ({"messages": CONVERSATION, "add_generation_prompt": "no"},
     "'add_generation_prompt' must be true or false"),
    ({"input": "Hello", "request_id": 5}, "'request_id' must be a string"),
])
def test_bad_chat_embeddings_are_a_400(emb_server, body, match):  # noqa: F811
    before = embeddings(emb_server, {"input": "Hello"})
    refused(emb_server, "/v1/embeddings", body, match)
    assert embeddings(emb_server, {"input": "Hello"}) == before


def test_a_chat_embedding_parses_to_its_conversation():
    req = parse_embedding({"messages": CONVERSATION, "chat_template_kwargs": {"k": 1}})
    assert req.prompts is None and req.messages == CONVERSATION
    assert req.add_special_tokens is False  # vLLM's default for the chat form
    assert req.chat_options["add_generation_prompt"] is False
    assert req.chat_options["chat_template_kwargs"] == {"k": 1}


# -- the port: one rule --------------------------------------------------------------------------

def test_the_cli_checks_the_port_by_the_servers_rule(monkeypatch):
    """`minivllm serve --port` and OpenAIServer each wrote the [0, 65535] rule: the CLI now asks
    the server's check_port (argparse's error, before the model loads)."""
    from minivllm import cli

    with pytest.raises(ValueError) as server_error:
        server_module.check_port(70000)
    with pytest.raises(argparse.ArgumentTypeError) as cli_error:
        cli._port("70000")
    assert str(cli_error.value) == str(server_error.value)
    assert cli._port("0") == 0 and cli._port("65535") == 65535

    def check_port(port):
        raise ValueError(f"the server's rule refused {port}")

    monkeypatch.setattr(server_module, "check_port", check_port)
    with pytest.raises(argparse.ArgumentTypeError, match="the server's rule refused 8000"):
        cli._port("8000")
