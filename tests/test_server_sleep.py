"""The server's side of sleep mode (serve --enable-sleep-mode with VLLM_SERVER_DEV_MODE=1, as
vLLM's): POST /sleep, POST /wake_up, GET /is_sleeping and POST /reset_prefix_cache over HTTP on
this host; a completion while asleep is a 503, and the same greedy completion after wake_up;
the routes' 400s, their 404s without dev mode and their error without the flag. And the request
body's cap: a Content-Length over it is a 413 before the body is read, a bad one a 400, and the
server serves on after each."""

from __future__ import annotations

import json
import os
import socket
import threading
import urllib.error
import urllib.request

import pytest
from safetensors.torch import load_file

from minivllm.runtime.server import DEFAULT_MAX_BODY_BYTES, OpenAIServer

from engine_helpers import make_llm
from test_server import (NAME, PROMPTS, model_dir,  # noqa: F401 (model_dir: a fixture)
                         serve_flag_reaches_llm, url)

GREEDY = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
          "ignore_eos": True}


def start(llm, monkeypatch, dev: bool = True, **kw) -> OpenAIServer:
    if dev:
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    else:
        monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
        monkeypatch.delenv("MINIVLLM_SERVER_DEV_MODE", raising=False)
    srv = OpenAIServer(llm, port=0, model_name=NAME, **kw)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture(scope="module")
def sleepy_llm(model_dir, device):  # noqa: F811
    return make_llm(model_dir, device, max_model_len=512, enable_sleep_mode=True)


@pytest.fixture
def server(sleepy_llm, monkeypatch):
    srv = start(sleepy_llm, monkeypatch)
    yield srv
    if sleepy_llm.is_sleeping():
        sleepy_llm.wake_up()
    srv.shutdown()


def call(server, method, path, body=None):
    """-> (status, body: parsed JSON, or the raw bytes when it is not JSON)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url(server, path), data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def sleeping(server) -> bool:
    status, body = call(server, "GET", "/is_sleeping")
    assert status == 200
    return body["is_sleeping"]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_refuses_completions_and_wake_up_serves_them_again(server, level):
    status, before = call(server, "POST", "/v1/completions", GREEDY)
    assert status == 200
    assert sleeping(server) is False
    assert call(server, "POST", f"/sleep?level={level}") == (200, b"")  # vLLM's empty 200
    assert sleeping(server) is True and server.llm.is_sleeping()
    for path, body in (("/v1/completions", GREEDY),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2})):
        status, answer = call(server, "POST", path, body)
        assert status == 503, answer
        assert "sleeping" in answer["error"]["message"]
        assert "/wake_up" in answer["error"]["message"]
    # What needs no weights still answers, as vLLM's.
    assert call(server, "POST", "/tokenize", {"prompt": "hi"})[0] == 200
    assert call(server, "POST", "/sleep?level=1") == (200, b"")  # asleep already: a warning only
    if level == 1:
        assert call(server, "POST", "/wake_up") == (200, b"")
    else:  # the weights were discarded: an RL loop's order, the trainer's weights loaded between
        assert call(server, "POST", "/wake_up?tags=weights") == (200, b"")
        weights = load_file(os.path.join(server.llm.config.model, "model.safetensors"))
        server.loop.call(lambda: server.llm.load_weights(weights.items()))
        assert sleeping(server) is True
        assert call(server, "POST", "/wake_up?tags=kv_cache") == (200, b"")
    assert sleeping(server) is False
    status, after = call(server, "POST", "/v1/completions", GREEDY)
    assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]


def test_wake_up_by_tags(server):
    status, before = call(server, "POST", "/v1/completions", GREEDY)
    assert call(server, "POST", "/sleep") == (200, b"")  # level 1 by default
    assert call(server, "POST", "/wake_up?tags=weights") == (200, b"")
    assert sleeping(server) is True and server.llm.engine.sleeping == {"kv_cache"}
    status, answer = call(server, "POST", "/v1/completions", GREEDY)
    assert status == 503 and "kv_cache" in answer["error"]["message"]
    assert call(server, "POST", "/wake_up?tags=kv_cache") == (200, b"")
    assert sleeping(server) is False
    assert call(server, "POST", "/v1/completions", GREEDY)[1]["choices"] == before["choices"]
    assert call(server, "POST", "/sleep?level=1") == (200, b"")
    assert call(server, "POST", "/wake_up?tags=kv_cache&tags=weights") == (200, b"")  # repeated
    assert sleeping(server) is False
    assert call(server, "POST", "/v1/completions", GREEDY)[1]["choices"] == before["choices"]


@pytest.mark.parametrize("query, param", [
    ("/sleep?level=0", "level"), ("/sleep?level=3", "level"), ("/sleep?level=one", "level"),
    ("/sleep?level=", "level"), ("/sleep?mode=keep", "mode"), ("/sleep?mode=x", "mode"),
    ("/wake_up?tags=weight", "tags"), ("/wake_up?tags=", "tags"),
    ("/wake_up?tags=weights&tags=gpu", "tags")])
def test_bad_parameters_are_400s_naming_them(server, query, param):
    status, answer = call(server, "POST", query)
    assert status == 400, answer
    assert f"'{param}'" in answer["error"]["message"]
    assert sleeping(server) is False
    assert call(server, "POST", "/v1/completions", GREEDY)[0] == 200


def test_sleep_aborts_the_running_requests_or_waits_for_them(server):
    """mode=abort (vLLM's default): a request running is answered 503 naming the sleep;
    mode=wait: it finishes, and the sleep answers after it."""
    long = {**GREEDY, "max_tokens": 400}
    for mode in ("abort", "wait"):
        got = {}
        client = threading.Thread(target=lambda: got.update(
            answer=call(server, "POST", "/v1/completions", long)))
        client.start()
        while not server.llm.engine.requests:  # until it runs
            client.join(0.01)
            assert client.is_alive()
        assert call(server, "POST", f"/sleep?mode={mode}") == (200, b"")
        client.join(120)
        status, answer = got["answer"]
        if mode == "abort":
            assert status == 503 and "sleep" in answer["error"]["message"], answer
        else:
            assert status == 200 and answer["usage"]["completion_tokens"] == 400
        assert sleeping(server) is True and not server.llm.engine.requests
        assert call(server, "POST", "/wake_up") == (200, b"")


def test_reset_prefix_cache(server):
    """The cached blocks are forgotten (vLLM's dev route), and the server serves on."""
    status, _ = call(server, "POST", "/v1/completions", {**GREEDY, "prompt": PROMPTS[1] * 20})
    assert status == 200 and server.llm.engine.block_manager.registered_blocks()
    assert call(server, "POST", "/reset_prefix_cache") == (200, b"")
    assert not server.llm.engine.block_manager.registered_blocks()
    assert call(server, "POST", "/v1/completions", GREEDY)[0] == 200


def test_methods(server):
    assert call(server, "GET", "/sleep")[0] == 405
    assert call(server, "POST", "/is_sleeping")[0] == 405


def test_without_dev_mode_the_routes_are_404s(sleepy_llm, monkeypatch):
    srv = start(sleepy_llm, monkeypatch, dev=False)
    try:
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"),
                             ("GET", "/is_sleeping"), ("POST", "/reset_prefix_cache")):
            status, answer = call(srv, method, path)
            assert status == 404, (path, answer)
        assert not sleepy_llm.is_sleeping()
    finally:
        srv.shutdown()


def test_the_minivllm_name_of_dev_mode(sleepy_llm, monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    monkeypatch.setenv("MINIVLLM_SERVER_DEV_MODE", "true")
    srv = OpenAIServer(sleepy_llm, port=0, model_name=NAME)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert call(srv, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    finally:
        srv.shutdown()


def test_without_the_flag_sleep_names_it(model_dir, device, monkeypatch):  # noqa: F811
    srv = start(make_llm(model_dir, device, max_model_len=512), monkeypatch)
    try:
        for path in ("/sleep?level=1", "/wake_up"):
            status, answer = call(srv, "POST", path)
            assert status == 400 and "--enable-sleep-mode" in answer["error"]["message"]
        assert call(srv, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
        assert call(srv, "POST", "/reset_prefix_cache") == (200, b"")
        assert call(srv, "POST", "/v1/completions", GREEDY)[0] == 200
    finally:
        srv.shutdown()


# -- the request body's cap ----------------------------------------------------------------------

def raw_request(server, head: bytes, body: bytes = b"") -> tuple[int, dict, bool]:
    """Send one request as given on a new connection -> (status, JSON body, whether the server
    closed the connection after it)."""
    host, port = server.address
    with socket.create_connection((host, port), timeout=60) as s:
        s.sendall(head + b"\r\n" + body)
        f = s.makefile("rb")
        status = int(f.readline().split()[1])
        length, closed = 0, False
        while (line := f.readline()) != b"\r\n":
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
            closed |= name.lower() == "connection" and value.strip().lower() == "close"
        return status, json.loads(f.read(length)), closed


def head(length: str | None, path: str = "/v1/completions") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n").encode()


def test_a_body_over_the_cap_is_413_unread(sleepy_llm, monkeypatch):
    srv = start(sleepy_llm, monkeypatch, max_request_body_bytes=1000)
    try:
        # Only the headers are sent: the answer comes without the body being read.
        status, answer, closed = raw_request(srv, head(str(10 ** 12)))
        assert status == 413 and closed, answer
        assert "1000" in answer["error"]["message"] and answer["error"]["code"] == 413
        assert "--max-request-body-bytes" in answer["error"]["message"]
        body = json.dumps({**GREEDY, "prompt": "x" * 1000}).encode()
        assert raw_request(srv, head(str(len(body))), body)[0] == 413
        body = json.dumps(GREEDY).encode()
        status, answer, closed = raw_request(srv, head(str(len(body))), body)
        assert status == 200 and not closed, answer
    finally:
        srv.shutdown()


@pytest.mark.parametrize("length", ["-1", "abc", "1_0", "+5", "0x10", "5, 6"])
def test_a_bad_content_length_is_400(server, length):
    status, answer, closed = raw_request(server, head(length))
    assert status == 400 and closed, answer
    assert "Content-Length" in answer["error"]["message"]
    assert call(server, "POST", "/v1/completions", GREEDY)[0] == 200


def test_no_body_is_a_400_on_a_json_route_and_nothing_on_a_dev_route(server):
    status, answer, _ = raw_request(server, head(None))
    assert status == 400 and "no body" in answer["error"]["message"], answer
    host, port = server.address
    with socket.create_connection((host, port), timeout=60) as s:  # as `curl -X POST` sends it
        s.sendall(head(None, "/reset_prefix_cache") + b"\r\n")
        assert s.makefile("rb").readline().split()[1] == b"200"
    assert call(server, "POST", "/v1/completions", GREEDY)[0] == 200


def test_the_default_cap(model_dir, device, monkeypatch):  # noqa: F811
    srv = start(make_llm(model_dir, device, max_model_len=512), monkeypatch)
    try:
        assert srv.max_request_body_bytes == DEFAULT_MAX_BODY_BYTES
    finally:
        srv.shutdown()
    with pytest.raises(ValueError, match="max_request_body_bytes"):
        OpenAIServer(make_llm(model_dir, device, max_model_len=512), port=0,
                     max_request_body_bytes=0)


def test_the_cli_flags(model_dir, monkeypatch):  # noqa: F811
    """serve --enable-sleep-mode reaches LLM(enable_sleep_mode=True), off without it;
    --max-request-body-bytes the server."""
    from minivllm import cli

    assert serve_flag_reaches_llm(model_dir, monkeypatch, "enable-sleep-mode") == [True, False]
    args = cli.build_parser().parse_args(["serve", model_dir, "--max-request-body-bytes", "9"])
    assert args.max_request_body_bytes == 9


def test_a_waiting_sleep_refuses_new_requests_and_wake_up(server):
    """While mode=wait waits, a new completion is a 503 saying so, and a wake_up (or a second
    sleep) a 409: the sleep would follow it."""
    got = {}
    client = threading.Thread(target=lambda: got.update(
        answer=call(server, "POST", "/v1/completions", {**GREEDY, "max_tokens": 400})))
    client.start()
    while not server.llm.engine.requests:
        client.join(0.01)
    sleeper = threading.Thread(target=lambda: got.update(
        sleep=call(server, "POST", "/sleep?mode=wait")))
    sleeper.start()
    answers = []
    while client.is_alive():
        answers.append(call(server, "POST", "/v1/completions", GREEDY))
        if server.loop.pending_sleep is not None and server.llm.engine.requests:
            answers.append(call(server, "POST", "/wake_up"))
            break
    client.join(120)
    sleeper.join(120)
    assert got["answer"][0] == 200 and got["sleep"] == (200, b"")
    refused = [a for status, a in answers if status in (409, 503)]
    assert refused and all("mode=wait" in a["error"]["message"] for a in refused)
    assert sleeping(server) is True
    assert call(server, "POST", "/wake_up") == (200, b"")
