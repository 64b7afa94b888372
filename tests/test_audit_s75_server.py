"""Session 75's audit of the OpenAI-compatible server and `minivllm serve`: bad input that was
taken (and held the engine's thread), answered with a message naming neither the field nor the
cause, or refused only after the model had loaded. Each is refused before any work, and the
server answers a following request as before."""

from __future__ import annotations

import http.client
import json
import socket
import threading

import pytest

from minivllm.runtime.openai_api import RequestError, parse_chat, parse_completion
from minivllm.runtime.sampling_params import MAX_N
from minivllm.runtime.server import OpenAIServer

from engine_helpers import make_llm, serving
from test_server import model_dir  # noqa: F401  (the fixture: the demo checkpoint, greedy)

NAME = "tiny"
MAX_MODEL_LEN = 96
FIXED = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def small_llm(model_dir, device):  # noqa: F811
    return make_llm(model_dir, device, max_model_len=MAX_MODEL_LEN, num_kv_blocks=16)


@pytest.fixture(scope="module")
def server(model_dir, device):  # noqa: F811
    srv = OpenAIServer(small_llm(model_dir, device), port=0, model_name=NAME)
    with serving(srv):
        yield srv


def request(server, path: str, body) -> tuple[int, dict]:
    """-> (status, parsed JSON body); a str body is sent as it is (json.dumps writes a lone
    surrogate as its \\ud800 escape)."""
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def fixed_text(server) -> str:
    status, body = request(server, "/v1/completions", FIXED)
    assert status == 200, body
    return body["choices"][0]["text"]


@pytest.fixture(scope="module")
def baseline(server):
    return fixed_text(server)


def assert_refused(server, baseline, path: str, body, match: str) -> None:
    """A 400 naming `match`, the engine idle after it, and the fixed request's answer unchanged."""
    status, answer = request(server, path, body)
    assert status == 400, answer
    error = answer["error"]
    assert error["code"] == 400 and match in error["message"], error
    engine = server.llm.engine
    assert not engine.requests and not server.loop.owners
    assert fixed_text(server) == baseline


# -- n: vLLM's VLLM_MAX_N_SEQUENCES bound --------------------------------------------------------

@pytest.mark.parametrize("parse, body", [
    (parse_completion, {"prompt": "x"}),
    (parse_chat, {"messages": [{"role": "user", "content": "x"}]}),
])
def test_n_past_vllms_bound_is_refused_when_parsed(parse, body):
    """n=2**40 was taken: the engine's thread then made a sequence per completion before any
    step, forever, and every other request waited on it."""
    with pytest.raises(RequestError, match=rf"n must be an integer in \[1, {MAX_N}\]"):
        parse({**body, "n": 2**40}, {})
    assert parse({**body, "n": MAX_N}, {}).params.n == MAX_N  # vLLM's bound itself is taken


def test_n_past_vllms_bound_is_answered_400_and_the_server_goes_on(server, baseline):
    assert_refused(server, baseline, "/v1/completions",
                   {"prompt": "x", "n": MAX_N + 1, "max_tokens": 1}, f"in [1, {MAX_N}]")


# -- lone surrogates -----------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, where", [
    # the tokenizer's "TextEncodeInput must be Union[...]": neither the field nor the cause
    ("/v1/completions", {"prompt": "a\ud800"}, "'prompt'"),
    ("/v1/completions", {"prompt": ["ok", "\udc00"]}, "'prompt[1]'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"},
                                           {"role": "user", "content": "\ud83d"}]},
     "'messages[1].content'"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["\ud800"]}, "'bad_words[0]'"),
    ("/tokenize", {"prompt": "\ud800"}, "'prompt'"),
    # taken, a stop string or choice that no text can ever be
    ("/v1/completions", {"prompt": "x", "stop": ["\ud800"]}, "'stop[0]'"),
    ("/v1/completions", {"prompt": "x", "guided_choice": ["\ud800", "b"]},
     "'guided_choice[0]'"),
])
def test_a_lone_surrogate_is_named_where_it_is(server, baseline, path, body, where):
    assert_refused(server, baseline, path, body, f"{where} is not valid Unicode text")


def test_a_surrogate_pair_is_text(server):
    """The escape of a character past the BMP (\\ud83d\\ude00, json.dumps' own) is taken."""
    status, body = request(server, "/v1/completions", {"prompt": "hi \U0001F600",
                                                       "max_tokens": 2})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body


# -- the server's address ------------------------------------------------------------------------

def engine_threads() -> int:
    return sum(t.name == "minivllm-engine" for t in threading.enumerate())


@pytest.fixture(scope="module")
def spare_llm(model_dir, device):  # noqa: F811
    return small_llm(model_dir, device)


@pytest.mark.parametrize("port", [70000, -1, True, "8000"])
def test_a_port_out_of_range_is_a_value_error(spare_llm, port):
    """bind refused 70000 with an OverflowError, after the engine's thread had started."""
    before = engine_threads()
    with pytest.raises(ValueError, match=r"port must be an integer in \[0, 65535\]"):
        OpenAIServer(spare_llm, port=port)
    assert engine_threads() == before


def test_an_address_taken_starts_no_engine_thread(spare_llm):
    """A port in use: the bind's OSError, and no engine thread left running with nothing to
    stop it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        before = engine_threads()
        with pytest.raises(OSError):
            OpenAIServer(spare_llm, port=taken.getsockname()[1])
        assert engine_threads() == before


# -- `minivllm serve`'s address, before the model loads -----------------------------------------

class _Loaded(Exception):
    """The CLI got past its checks to the model."""


@pytest.fixture
def cli(monkeypatch):
    from minivllm import cli

    def load(args):
        raise _Loaded

    monkeypatch.setattr(cli, "_resolve_model", load)
    return cli


@pytest.mark.parametrize("port", ["70000", "-5"])
def test_the_cli_refuses_a_port_out_of_range(cli, capsys, port):
    """Taken by argparse, then refused by bind with an OverflowError's traceback once the
    model had loaded."""
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "m", "--port", port])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --port" in err and f"in [0, 65535] (0: any free one), got {port}" in err, err


def test_the_cli_names_an_address_it_cannot_serve_before_the_model_loads(cli):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = cli.build_parser().parse_args(["serve", "m", "--port", str(port)])
        with pytest.raises(SystemExit, match=f"cannot serve at 127.0.0.1:{port}"):
            cli.cmd_serve(args)
    args = cli.build_parser().parse_args(["serve", "m", "--host", "no-such-host.invalid"])
    with pytest.raises(SystemExit, match="cannot serve at no-such-host.invalid:8000"):
        cli.cmd_serve(args)
    # A free address gets past the check, to the model.
    with pytest.raises(_Loaded):
        cli.cmd_serve(cli.build_parser().parse_args(["serve", "m", "--port", "0"]))


# -- methods -------------------------------------------------------------------------------------

def call(server, method: str, path: str, body: bytes | None = None):
    """-> (status, content type, raw body)."""
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type"), r.read()
    finally:
        conn.close()


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH", "OPTIONS"])
@pytest.mark.parametrize("path, status, match", [
    ("/v1/completions", 405, "/v1/completions takes POST"),
    ("/tokenize", 405, "/tokenize takes POST"),
    ("/v1/models", 405, "/v1/models takes GET"),
    ("/v1/nothing", 404, "no route /v1/nothing"),
])
def test_other_methods_are_answered_with_openais_error_body(server, baseline, method, path,
                                                            status, match):
    """They were http.server's 501 with an HTML page, which an OpenAI client cannot read."""
    got, ctype, raw = call(server, method, path, b'{"prompt": "x"}')
    assert (got, ctype) == (status, "application/json"), raw[:200]
    error = json.loads(raw)["error"]
    assert error["code"] == status and error["message"] == match
    assert fixed_text(server) == baseline


def test_a_post_to_a_get_route_is_a_405(server, baseline):
    """POST /health was a 404 'no route /health', as if the route did not exist."""
    status, ctype, raw = call(server, "POST", "/health", b"{}")
    assert status == 405 and json.loads(raw)["error"]["message"] == "/health takes GET"
    status, ctype, raw = call(server, "GET", "/tokenize")  # the other way round, as vLLM's
    assert status == 405 and json.loads(raw)["error"]["message"] == "/tokenize takes POST"
    assert fixed_text(server) == baseline


@pytest.mark.parametrize("path, ctype", [("/health", None), ("/v1/models", "application/json")])
def test_head_is_gets_answer_without_its_body(server, path, ctype):
    """vLLM (Starlette) answers HEAD on its GET routes: a load balancer's health probe."""
    status, got, raw = call(server, "HEAD", path)
    assert (status, got, raw) == (200, ctype, b"")


# -- vLLM's extra fields at their defaults -------------------------------------------------------

@pytest.mark.parametrize("parse, body", [
    (parse_completion, {"prompt": "x"}),
    (parse_chat, {"messages": [{"role": "user", "content": "x"}]}),
])
def test_vllms_extra_fields_are_taken_at_their_defaults_only(parse, body):
    """A client sending vLLM's defaults (use_beam_search false, ...) was refused as sending
    unknown fields; another value still asks for what this server does not do."""
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "length_penalty_int": 1,
                "return_tokens_as_token_ids": False}
    for name, value in defaults.items():
        name = name.removesuffix("_int")
        assert parse({**body, name: value}, {}).params.n == 1
    for name, value in {"use_beam_search": True, "length_penalty": 0.5,
                        "return_tokens_as_token_ids": True}.items():
        with pytest.raises(RequestError, match=f"'{name}' is not supported"):
            parse({**body, name: value}, {})
