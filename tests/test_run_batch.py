"""`minivllm run-batch` (runtime/run_batch.py), vLLM's offline batch runner, on the demo model:
each line of a JSONL batch is answered as `minivllm serve` answers the same body over HTTP (the
server in-process, greedy: the reference), in vLLM's BatchRequestOutput lines, in the input's
order; vLLM's error lines (a url it does not take, a route the model does not serve, a stream);
and, as vLLM's, a line that is no batch request (or a URL for a file) ends the run before the
model loads. Run in-process (cli.main) and once as a subprocess over stdin / stdout."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from engine_helpers import make_llm, serving
from test_server import post
from minivllm import cli
from minivllm.cli import build_parser, main
from minivllm.runtime import run_batch
from minivllm.runtime.demo import ensure_demo_model
from minivllm.runtime.server import OpenAIServer

NAME = "minivllm-demo"  # the name serve and run-batch give the demo model
ID = re.compile(r"vllm-[0-9a-f]{32}")
REQUEST_ID = re.compile(r"vllm-batch-[0-9a-f]{32}")


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory):
    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))


@pytest.fixture(autouse=True)
def demo_env(demo_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_DEMO_DIR", demo_path)


def engine_flags(device) -> list[str]:
    """The CLI's engine as make_llm's below (the server's): the same sizes, so that greedy
    tokens are the same; eager on CUDA (no graphs to capture), the reference attention on CPU."""
    flags = ["--device", device.type, "--max-model-len", "512", "--num-kv-blocks", "64",
             "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--enforce-eager"]
    return flags + (["--attention-backend", "reference"] if device.type == "cpu" else [])


def server_llm(path, device, **kw):
    return make_llm(path, device, max_model_len=512, num_kv_blocks=64, max_num_seqs=16,
                    max_num_batched_tokens=512, enforce_eager=True, **kw)


@pytest.fixture(scope="module")
def server(demo_path, device):
    with serving(OpenAIServer(server_llm(demo_path, device), port=0, model_name=NAME)) as srv:
        yield srv


def line(custom_id, url, body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


CHAT = [{"role": "user", "content": "Hi there"}]
# Served by the demo model: checked against the server's answer to the same body.
SERVED = [
    line("cmpl", "/v1/completions", {"model": NAME, "prompt": ["Hello, my name is", "The sky"],
                                     "max_tokens": 5, "temperature": 0, "request_id": "b1"}),
    line("chat", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "temperature": 0,
                                          "request_id": "b2"}),
    line("unnamed", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4,
                                        "temperature": 0, "ignore_eos": True, "request_id": "b3"}),
    # The server's refusals: vLLM's NonExistModel line (404) and a field it does not know (400).
    line("no-model", "/v1/chat/completions", {"model": "NonExistModel", "messages": CHAT}),
    line("typo", "/v1/completions", {"prompt": "x", "max_token": 3}),
]
# vLLM's error lines, with its messages (status 400).
REFUSED = [
    (line("embed", "/v1/embeddings", {"input": "Hi"}),
     "Model does not support endpoint: /v1/embeddings"),
    (line("bad-url", "/bad_url", {"messages": CHAT}),
     f"URL /bad_url was used. Supported endpoints: {run_batch.SUPPORTED}."),
    (line("stream", "/v1/chat/completions", {"messages": CHAT, "stream": True, "max_tokens": 4}),
     "Request must not be sent in stream mode"),
]


def batch_text(lines) -> str:
    """The JSONL, a blank line among them (skipped, as vLLM skips it)."""
    rows = [json.dumps(x) for x in lines]
    return "\n".join(rows[:2] + ["   "] + rows[2:]) + "\n"


def unstamped(body: dict) -> dict:
    """A response body without its creation time (the second it was answered)."""
    return {k: v for k, v in body.items() if k != "created"}


def check_output_lines(rows: list[dict], srv, lines, refused) -> None:
    """rows, run-batch's output for lines + refused, against the server and vLLM's format."""
    assert [r["custom_id"] for r in rows] == [x["custom_id"] for x in lines] + \
        [x["custom_id"] for x, _ in refused]
    for r in rows:  # vLLM's BatchRequestOutput, its fields in its order
        assert list(r) == ["id", "custom_id", "response", "error"]
        assert ID.fullmatch(r["id"])
        assert list(r["response"]) == ["status_code", "request_id", "body"]
        assert REQUEST_ID.fullmatch(r["response"]["request_id"])
    assert len({r["id"] for r in rows}) == len(rows)
    for r, x in zip(rows, lines):
        status, want = post(srv, x["url"], x["body"])
        assert r["response"]["status_code"] == status, (x, r)
        if status == 200:
            assert r["error"] is None
            assert unstamped(r["response"]["body"]) == unstamped(want)
        else:
            assert r["response"]["body"] is None and r["error"] == want
    assert rows[0]["response"]["body"]["id"] == "cmpl-b1"  # the body's request_id (vLLM's)
    for r, (_, message) in zip(rows[len(lines):], refused):
        assert r["response"]["status_code"] == 400 and r["response"]["body"] is None
        assert r["error"] == message


def test_each_line_is_answered_as_the_server_answers_its_body(server, device, tmp_path, capsys):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(batch_text(SERVED + [x for x, _ in REFUSED]))
    assert main(["run-batch", "--demo", "-i", str(source), "-o", str(out),
                 *engine_flags(device)]) == 0
    rows = [json.loads(r) for r in out.read_text().splitlines()]
    check_output_lines(rows, server, SERVED, REFUSED)
    assert [r["response"]["status_code"] for r in rows[:5]] == [200, 200, 200, 404, 400]
    assert len(rows[0]["response"]["body"]["choices"]) == 2  # a choice a prompt
    assert f"{len(rows)} requests ({len(rows) - 3} answered with an error)" in \
        capsys.readouterr().err


def test_a_subprocess_reads_stdin_and_writes_stdout(server, demo_path, device):
    """`-` for both files; stdout holds the output lines only (the notices go to stderr)."""
    env = {**os.environ, "MINIVLLM_DEMO_DIR": demo_path}
    done = subprocess.run([sys.executable, "-m", "minivllm", "run-batch", "--demo", "-i", "-",
                           "-o", "-", *engine_flags(device)],
                          input=batch_text(SERVED[:2] + [REFUSED[2][0]]), capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(r) for r in done.stdout.splitlines()]
    check_output_lines(rows, server, SERVED[:2], REFUSED[2:])
    assert "RANDOM weights" in done.stderr


def test_an_empty_input_writes_an_empty_output(device, tmp_path):
    """vLLM's test_empty_file: exit 0, nothing written."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n  \n")
    assert main(["run-batch", "--demo", "-i", str(source), "-o", str(out),
                 *engine_flags(device)]) == 0
    assert out.read_text() == ""


GOOD = json.dumps(SERVED[0])


@pytest.mark.parametrize("bad,match", [
    ("{not json", r"line 3: not JSON"),
    # vLLM's INVALID_INPUT_BATCH: custom_id missing (given as another field)
    (json.dumps({"invalid_field": "r1", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": CHAT}}), r"line 3: missing \['custom_id'\]"),
    (json.dumps({**SERVED[0], "custom_id": 7}), r"line 3: 'custom_id' must be a string"),
    (json.dumps({**SERVED[0], "body": "prompt"}), r"line 3: 'body' must be a JSON object"),
    ("[1, 2]", r"line 3: a batch request is a JSON object"),
], ids=["not_json", "no_custom_id", "custom_id_not_a_string", "body_not_an_object", "array"])
def test_a_line_that_is_no_batch_request_ends_the_run_before_the_model_loads(
        bad, match, tmp_path, monkeypatch, capsys):
    """As vLLM's (its process exits non-zero): here exit 2 naming the line, before the model
    loads, and no output file."""
    def no_model(*a, **kw):
        raise AssertionError("the model loaded")
    monkeypatch.setattr(cli, "_make_llm", no_model)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(f"{GOOD}\n\n{bad}\n{GOOD}\n")
    assert main(["run-batch", "--demo", "-i", str(source), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"minivllm: error: {re.escape(str(source))} {match}", err), err
    assert not out.exists()


@pytest.mark.parametrize("flags,match", [
    (["-i", "http://example.com/in.jsonl", "-o", "OUT"], "--input-file 'http://example.com"),
    (["-i", "IN", "-o", "https://example.com/out.jsonl"], "--output-file 'https://example.com"),
    (["-i", "IN", "-o", "TMP/no/such/dir/out.jsonl"], "no directory"),
    (["-i", "TMP/missing.jsonl", "-o", "OUT"], "No such file"),
], ids=["url_in", "url_out", "no_output_dir", "no_input"])
def test_urls_and_unusable_paths_are_refused_before_the_model_loads(flags, match, tmp_path,
                                                                     monkeypatch, capsys):
    """vLLM fetches and uploads http(s) files; run-batch refuses them, clearly."""
    monkeypatch.setattr(cli, "_make_llm", lambda *a, **kw: pytest.fail("the model loaded"))
    (tmp_path / "in.jsonl").write_text(GOOD + "\n")
    names = {"IN": str(tmp_path / "in.jsonl"), "OUT": str(tmp_path / "out.jsonl")}
    flags = [names.get(f, f.replace("TMP", str(tmp_path))) for f in flags]
    assert main(["run-batch", "--demo", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minivllm: error: ") and match in err, err
    assert ("local files only" in err) == ("http" in match)


def test_urls_are_routed_as_vllms_runner_routes_them():
    """Its two exact routes and any url ending /score or /rerank (vLLM's matching), and
    /v1/completions; each only where the model's server has the route."""
    generate = {"/v1/completions": 0, "/v1/chat/completions": 0}
    pooling = {"/v1/embeddings": 0, "/score": 0, "/v1/score": 0, "/rerank": 0, "/v1/rerank": 0,
               "/v2/rerank": 0}
    assert run_batch.route("/v1/completions", generate) == ("/v1/completions", None)
    assert run_batch.route("/v2/rerank", pooling) == ("/v1/rerank", None)
    assert run_batch.route("/score", pooling) == ("/v1/score", None)
    assert run_batch.route("/v1/score", generate) == \
        (None, "Model does not support endpoint: /v1/score")
    for url in ("/v1/chat/completions/", "/classify", "/tokenize", "v1/completions"):
        assert run_batch.route(url, {**generate, **pooling})[1].startswith(f"URL {url} was used")


def test_a_stream_is_refused_after_the_servers_checks_and_runs_nothing(demo_path, device,
                                                                        tmp_path):
    """A stream is refused once the server would begin it: a stream naming an unknown model is
    the server's 404 (vLLM checks the model before it returns a stream), and the refused stream
    leaves no request in the engine."""
    llm = server_llm(demo_path, device)
    out = tmp_path / "out.jsonl"
    requests = run_batch.parse_requests(batch_text([
        line("s404", "/v1/chat/completions", {"model": "nope", "messages": CHAT,
                                              "stream": True}),
        line("s", "/v1/completions", {"prompt": "Hello", "stream": True, "max_tokens": 400,
                                      "ignore_eos": True}),
        line("c", "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0})]))
    assert run_batch.run_batch(llm, requests, str(out), model_name=NAME) == (3, 2)
    rows = [json.loads(r) for r in out.read_text().splitlines()]
    assert rows[0]["response"]["status_code"] == 404
    assert rows[0]["error"]["error"]["message"] == "The model `nope` does not exist."
    assert rows[1]["error"] == run_batch.STREAM_REFUSAL
    assert rows[2]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests


def close(a, b) -> bool:
    """JSON values equal, their floats to 1e-5 (a pooling model's vectors, batched otherwise)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b


def test_a_pooling_model_answers_embeddings_scores_and_reranks(demo_path, device, tmp_path):
    """--runner pooling: /v1/embeddings, /score and /rerank lines as its server answers them,
    and a chat line refused (the model does not serve the route)."""
    lines = [line("e", "/v1/embeddings", {"input": ["Hi", "The quick brown fox"],
                                          "request_id": "e1"}),
             line("s", "/score", {"queries": "Hi", "documents": ["a b", "c"]}),
             line("r", "/v2/rerank", {"query": "Hi", "documents": ["a b", "c"]}),
             line("bad", "/v1/embeddings", {"input": []})]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    refused = [(line("chat", "/v1/chat/completions", {"messages": CHAT}),
                "Model does not support endpoint: /v1/chat/completions")]
    source.write_text(batch_text(lines + [x for x, _ in refused]))
    assert main(["run-batch", "--demo", "--runner", "pooling", "-i", str(source), "-o",
                 str(out), *engine_flags(device)]) == 0
    rows = [json.loads(r) for r in out.read_text().splitlines()]
    with serving(OpenAIServer(server_llm(demo_path, device, runner="pooling"), port=0,
                              model_name=NAME)) as srv:
        for r, x in zip(rows, lines):
            status, want = post(srv, x["url"], x["body"])
            assert r["response"]["status_code"] == status
            got = r["response"]["body"] if status == 200 else r["error"]
            assert close({**got, "id": None, "created": None},
                         {**want, "id": None, "created": None}), (x, got, want)
    assert [r["response"]["status_code"] for r in rows] == [200, 200, 200, 400, 400]
    assert rows[0]["response"]["body"]["id"] == "embd-e1"
    assert len(rows[0]["response"]["body"]["data"]) == 2
    assert rows[4]["error"] == refused[0][1]


def test_the_readmes_command_and_line_are_read():
    """README.md's run-batch example parses (the README audit parses it too, with every other
    command line) and its input line is a batch request."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    section = readme[readme.index("### OpenAI batch files: `minivllm run-batch`"):]
    blocks = re.findall(r"^```(?:bash)?\n(.*?)^```", section, re.S | re.M)[:2]
    command, request = blocks[0].split(), blocks[1].strip()
    assert command[:2] == ["minivllm", "run-batch"]
    args = build_parser().parse_args(command[1:])
    assert (args.input_file, args.output_file) == ("requests.jsonl", "results.jsonl")
    req, = run_batch.parse_requests(request)
    assert req.url == "/v1/chat/completions" and req.method == "POST"
    assert run_batch.route(req.url, {req.url: 0}) == (req.url, None)


def test_the_override_generation_configs_max_new_tokens_caps_each_line(device, tmp_path):
    """--override-generation-config's max_new_tokens caps a line's own max_tokens, as serve's
    (vLLM's override_max_tokens): a completion asking for 8 tokens gets 3."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"model": "minivllm-demo", "prompt": "Hello", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    source.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                  "body": body}) + "\n")
    assert main(["run-batch", "--demo", "-i", str(source), "-o", str(out), *engine_flags(device),
                 "--override-generation-config", '{"max_new_tokens": 3}']) == 0
    line = json.loads(out.read_text())
    assert line["error"] is None
    assert line["response"]["body"]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("flag", [True, False])
def test_enable_prompt_tokens_details_reports_the_prefix_cache_hits(flag, device, tmp_path):
    """--enable-prompt-tokens-details (vLLM's run-batch and serve flag): each line's usage gives
    prompt_tokens_details.cached_tokens, the prompt tokens the prefix cache served. One sequence
    at a time, so the second line of the same prompt finds every full block of it but the one
    holding its last token (vLLM recomputes that token); without the flag the key is absent."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"model": NAME, "prompt": "a b c d e f g " * 8, "max_tokens": 2, "temperature": 0}
    source.write_text("".join(json.dumps(line(k, "/v1/completions", body)) + "\n"
                              for k in ("first", "second")))
    flags = engine_flags(device)
    flags[flags.index("--max-num-seqs") + 1] = "1"
    extra = ["--enable-prompt-tokens-details"] if flag else []
    assert main(["run-batch", "--demo", "-i", str(source), "-o", str(out), *flags,
                 "--block-size", "16", "--enable-prefix-caching", *extra]) == 0
    first, second = (json.loads(s)["response"]["body"]["usage"]
                     for s in out.read_text().splitlines())
    if not flag:
        assert "prompt_tokens_details" not in first and "prompt_tokens_details" not in second
        return
    prompt = second["prompt_tokens"]
    assert prompt > 32 and first["prompt_tokens"] == prompt
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens_details"] == {"cached_tokens": (prompt - 1) // 16 * 16}
