"""The OpenAI-compatible server (`minivllm serve`, runtime/server.py) over HTTP on this host:
completions and chat completions, whole and streamed, against the LLM API on the same checkpoint
(greedy, and seeded sampling, which does not depend on the batch); sampling defaults from the
model's generation_config.json; concurrent clients; a client that leaves mid-stream; bad requests
answered 400 / 404 before they reach the engine; the CLI's `serve`; base64 prompt_embeds on
/v1/completions (serve --enable-prompt-embeds) against the same ids' completions, and their
refusals."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from minivllm import SamplingParams
from minivllm.runtime.demo import ensure_demo_model
from minivllm.runtime.server import OpenAIServer

from engine_helpers import make_llm, serving

NAME = "tiny"
PROMPTS = ["The quick brown fox", "Hello, my name is"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The demo checkpoint, its generation_config.json asking for greedy sampling (as a Qwen3
    checkpoint's asks for temperature 0.6): requests that set no temperature take it."""
    path = str(tmp_path_factory.mktemp("serve") / "model")
    shutil.copytree(ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model")), path)
    gen_path = os.path.join(path, "generation_config.json")
    with open(gen_path) as f:
        gen = json.load(f)
    gen["temperature"] = 0.0
    with open(gen_path, "w") as f:
        json.dump(gen, f)
    return path


@pytest.fixture(scope="module")
def reference(model_dir, device):
    """The LLM API on the same checkpoint: what the server must answer."""
    return make_llm(model_dir, device, max_model_len=1024)


@pytest.fixture(scope="module")
def server(model_dir, device):
    srv = OpenAIServer(make_llm(model_dir, device, max_model_len=1024), port=0, model_name=NAME)
    with serving(srv):
        yield srv


def url(server, path):
    host, port = server.address
    return f"http://{host}:{port}{path}"


def post(server, path, body, raw: bytes | None = None):
    """-> (status, parsed JSON body)."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url(server, path), data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream(server, path, body):
    """-> the events' parsed JSON bodies; asserts the stream ends with [DONE]."""
    req = urllib.request.Request(url(server, path), data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        text = r.read().decode()
    events = [e[len("data: "):] for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def joined(events):
    """Each choice index's streamed text, and its finish_reason (on its last chunk only)."""
    texts, reasons = {}, {}
    for ev in events:
        for c in ev["choices"]:
            assert c["index"] not in reasons  # nothing after a choice's finish
            piece = c["text"] if "text" in c else c["delta"].get("content", "")
            texts[c["index"]] = texts.get(c["index"], "") + piece
            if c["finish_reason"] is not None:
                reasons[c["index"]] = c["finish_reason"]
    return texts, reasons


def test_completions_equal_the_llm_api(server, reference):
    tok = reference.get_tokenizer()
    ids = tok.encode(PROMPTS[1])
    status, body = post(server, "/v1/completions", {
        "model": NAME, "prompt": [PROMPTS[0], PROMPTS[1]], "max_tokens": 8, "temperature": 0,
        "logprobs": 2, "ignore_eos": True})
    assert status == 200 and body["object"] == "text_completion" and body["model"] == NAME
    want = reference.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, logprobs=2,
                                                      ignore_eos=True), use_tqdm=False)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice, out in zip(body["choices"], want):
        c = out.outputs[0]
        assert choice["text"] == c.text and choice["finish_reason"] == c.finish_reason == "length"
        lps = choice["logprobs"]
        assert lps["tokens"] == [e[t].decoded_token for t, e in zip(c.token_ids, c.logprobs)]
        assert lps["token_logprobs"] == pytest.approx([e[t].logprob for t, e in zip(c.token_ids, c.logprobs)],
                                                      abs=1e-5)
        for top, entry in zip(lps["top_logprobs"], c.logprobs):
            ranked = sorted((v for v in entry.values() if v.rank <= 2), key=lambda v: v.rank)
            assert list(top.values())[:len(ranked)] == pytest.approx([v.logprob for v in ranked], abs=1e-5)
        offsets = lps["text_offset"]
        assert [b - a for a, b in zip(offsets, offsets[1:])] == [len(t) for t in lps["tokens"][:-1]]
    prompt_tokens = len(tok.encode(PROMPTS[0])) + len(ids)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 16,
                             "total_tokens": prompt_tokens + 16}
    # Token-id prompts are the same prompts.
    status, by_ids = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True})
    assert status == 200 and by_ids["choices"][0]["text"] == want[1].outputs[0].text


def test_n_and_seed_index_choices_by_prompt(server, reference):
    status, body = post(server, "/v1/completions", {
        "prompt": PROMPTS, "max_tokens": 6, "n": 2, "seed": 11, "temperature": 0.9, "top_k": 50})
    assert status == 200
    want = reference.generate(PROMPTS, SamplingParams(n=2, seed=11, temperature=0.9, top_k=50,
                                                      max_tokens=6), use_tqdm=False)
    got = {c["index"]: c["text"] for c in body["choices"]}
    assert got == {k * 2 + c.index: c.text for k, out in enumerate(want) for c in out.outputs}


def test_unset_sampling_fields_take_the_models_generation_config(server, reference):
    """The checkpoint asks for temperature 0: a request without one is greedy."""
    status, body = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 10})
    greedy = reference.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=10),
                                use_tqdm=False)[0].outputs[0]
    assert status == 200 and body["choices"][0]["text"] == greedy.text


def test_a_stream_carries_the_whole_response(server):
    body = {"prompt": PROMPTS, "max_tokens": 7, "n": 2, "seed": 3, "temperature": 1.0}
    _, whole = post(server, "/v1/completions", body)
    events = stream(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    texts, reasons = joined(events)
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert reasons == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    assert all("usage" not in ev for ev in events[:-1])
    assert len({ev["id"] for ev in events}) == 1


def test_chat_completions_equal_llm_chat(server, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    body = {"model": NAME, "messages": messages, "max_tokens": 9, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    status, whole = post(server, "/v1/chat/completions", body)
    want = reference.chat(messages, SamplingParams(temperature=0.0, max_tokens=9, logprobs=2),
                          use_tqdm=False)[0]
    c = want.outputs[0]
    assert status == 200 and whole["object"] == "chat.completion"
    choice = whole["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": c.text}
    assert choice["finish_reason"] == c.finish_reason
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [e[t].decoded_token for t, e in zip(c.token_ids, c.logprobs)]
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    assert whole["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    # Content parts are the same message; the stream the same text, the role in its first delta.
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    events = stream(server, "/v1/chat/completions", {**body, "messages": parts})
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(len(ev["choices"]) == 1 for ev in events)  # one choice a chunk, as vLLM
    texts, reasons = joined(events)
    assert texts == {0: c.text} and reasons == {0: c.finish_reason}


def test_chat_continues_the_final_message(server, reference):
    """continue_final_message (vLLM's chat field): the last (assistant) message is continued,
    the response holding only the new text, whole and streamed, as LLM.chat gives it; /tokenize
    renders the same prompt."""
    messages = [{"role": "user", "content": "Tell me a story"},
                {"role": "assistant", "content": "Once upon a"}]
    body = {"model": NAME, "messages": messages, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False}
    status, whole = post(server, "/v1/chat/completions", body)
    want = reference.chat(messages, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                          add_generation_prompt=False, continue_final_message=True,
                          use_tqdm=False)[0]
    assert want.prompt.endswith("<|im_start|>assistant\nOnce upon a")
    assert status == 200, whole
    assert whole["choices"][0]["message"] == {"role": "assistant",
                                              "content": want.outputs[0].text}
    assert whole["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    texts, _ = joined(stream(server, "/v1/chat/completions", {**body, "stream": True}))
    assert texts == {0: want.outputs[0].text}
    _, tok = post(server, "/tokenize", {"messages": messages, "continue_final_message": True,
                                        "add_generation_prompt": False})
    assert tok["tokens"] == want.prompt_token_ids


def test_echo_returns_the_prompt_and_its_logprobs(server, reference):
    status, body = post(server, "/v1/completions", {
        "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1})
    want = reference.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=3, logprobs=1,
                                                          prompt_logprobs=1), use_tqdm=False)[0]
    choice = body["choices"][0]
    assert status == 200 and choice["text"] == PROMPTS[0] + want.outputs[0].text
    lps = choice["logprobs"]
    n_prompt = len(want.prompt_token_ids)
    tok = reference.get_tokenizer()
    assert lps["tokens"][0] == tok.decode(want.prompt_token_ids[:1])
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert len(lps["tokens"]) == n_prompt + 3
    assert lps["token_logprobs"][1:n_prompt] == pytest.approx(
        [e[t].logprob for t, e in zip(want.prompt_token_ids[1:], want.prompt_logprobs[1:])], abs=1e-5)
    # Each token's text_offset is where its text starts in the text.
    assert all(choice["text"][o:o + len(t)] == t for o, t in zip(lps["text_offset"], lps["tokens"]))
    # max_tokens 0: the prompt scored, nothing generated in the response (log-likelihood clients).
    status, only = post(server, "/v1/completions", {
        "prompt": PROMPTS[0], "max_tokens": 0, "echo": True, "logprobs": 1})
    assert status == 200 and only["choices"][0]["text"] == PROMPTS[0]
    assert only["choices"][0]["logprobs"]["token_logprobs"] == lps["token_logprobs"][:n_prompt]
    assert only["usage"]["completion_tokens"] == 0


def test_concurrent_clients_each_get_their_own_completion(server, reference):
    prompts = [f"{p} {k}" for k in range(3) for p in PROMPTS]
    want = reference.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12),
                              use_tqdm=False)
    got = [None] * len(prompts)

    def ask(k):
        got[k] = post(server, "/v1/completions", {"prompt": prompts[k], "max_tokens": 12,
                                                  "temperature": 0})[1]["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == [o.outputs[0].text for o in want]


def test_a_client_that_leaves_mid_stream_frees_its_request(server):
    host, port = server.address
    before = server.llm.stats.generation_tokens
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True,
                       "stream": True}).encode()
    with socket.create_connection((host, port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        seen = b""
        while b"data: " not in seen:  # streaming has begun
            chunk = s.recv(4096)
            assert chunk, "the server closed the stream"
            seen += chunk
    engine = server.llm.engine
    deadline = time.time() + 60
    while (server.loop.owners or engine.requests) and time.time() < deadline:
        time.sleep(0.05)
    assert not server.loop.owners and not engine.requests
    assert engine.stats.generation_tokens - before < 1000  # it did not run to its end
    status, _ = post(server, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 2})
    assert status == 200


@pytest.mark.parametrize("path, body, status, match", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, 400, "'n' must be an integer"),
    ("/v1/completions", {"prompt": "x", "max_token": 3}, 400, "unknown fields \\['max_token'\\]"),
    ("/v1/completions", {"prompt": "x", "model": "other"}, 404, "`other` does not exist"),
    ("/v1/completions", {"max_tokens": 3}, 400, "'prompt' is required"),
    ("/v1/completions", {"prompt": []}, 400, "'prompt' must be"),
    ("/v1/completions", {"prompt": [1, 10**6]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "x " * 3000}, 400, "maximum context length is 1024 tokens"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "'suffix' is not supported"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream"),
    ("/v1/chat/completions", {"messages": []}, 400, "'messages' is required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "only text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "needs 'logprobs': true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, r"tools\[0\] must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "yaml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}],
                              "continue_final_message": True, "add_generation_prompt": True},
     400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}],
                              "continue_final_message": True},
     400, "continue_final_message and add_generation_prompt are not compatible"),
    ("/v1/chat/completions", {"messages": [], "continue_final_message": True,
                              "add_generation_prompt": False}, 400, "'messages' is required"),
    ("/v1/embeddings", {"input": "x"}, 404, "no route"),
    ("/v1/completions", {"prompt": "x", "temperature": 10**400}, 400, "too large"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "64 bits"),
    ("/v1/completions", {"prompt": "x", "priority": 1}, 400, "Priority scheduling is not enabled"),
    ("/v1/completions", {"prompt": "x", "priority": "high"}, 400, "'priority' must be an integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400, "'max_tokens' must be an integer"),
    ("/v1/completions", {"prompt": "x", "stream": True, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
])
def test_bad_requests_are_answered_before_the_engine(server, path, body, status, match):
    import re

    before = server.llm.stats.generation_tokens
    got, answer = post(server, path, body)
    error = answer["error"]  # OpenAI's (and vLLM's) error body
    assert got == status and error["code"] == status
    assert re.search(match, error["message"]), error["message"]
    assert server.llm.stats.generation_tokens == before and not server.llm.engine.requests


def test_a_body_that_is_not_json_is_answered_400(server):
    status, answer = post(server, "/v1/completions", None, raw=b"{not json")
    assert status == 400 and "not JSON" in answer["error"]["message"]


def test_models_and_health(server):
    with urllib.request.urlopen(url(server, "/v1/models"), timeout=30) as r:
        models = json.loads(r.read())
    assert [m["id"] for m in models["data"]] == [NAME]
    assert models["data"][0]["max_model_len"] == server.llm.config.max_model_len
    with urllib.request.urlopen(url(server, "/health"), timeout=30) as r:
        assert r.status == 200 and r.read() == b""
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url(server, "/v1/completions"), timeout=30)
    assert e.value.code == 405


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_the_cli_serves_until_interrupted(model_dir, tmp_path, stop):
    """`minivllm serve DIR --port 0` says where it serves, answers, and exits 0 on Ctrl-C or
    SIGTERM."""
    # A CPU engine: the CLI's check, not the GPU's. The fault handler writes every thread's stack
    # on SIGABRT: what a server that does not stop was waiting on.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "minivllm", "serve", model_dir, "--port", "0",
                             "--served-model-name", "cli", "--num-kv-blocks", "32",
                             "--max-model-len", "512", "--api-key", "k",
                             "--attention-backend", "reference", "--device", "cpu"],
                            stderr=subprocess.PIPE, text=True, env=env,
                            # Ctrl-C as a terminal delivers it: a test runner started in the
                            # background (`cmd &`) ignores SIGINT, and its children inherit that.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = ""
        deadline = time.time() + 240
        while "serving" not in line and time.time() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the server exited"
        address = line.split("http://")[1].split("/v1")[0]
        req = urllib.request.Request(f"http://{address}/v1/completions", data=json.dumps(
            {"model": "cli", "prompt": PROMPTS[0], "max_tokens": 3}).encode(),
            headers={"Content-Type": "application/json", "Authorization": "Bearer k"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert len(json.loads(r.read())["choices"]) == 1
        proc.send_signal(stop)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            tail = proc.communicate(timeout=30)[1][-8000:]
            pytest.fail(f"the server did not exit within 60 s of {stop.name}; its threads:\n{tail}")
        assert code == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_echoed_stream_puts_the_prompt_in_each_completions_first_chunk(server):
    body = {"prompt": PROMPTS, "max_tokens": 4, "n": 2, "seed": 5, "temperature": 1.0,
            "echo": True}
    _, whole = post(server, "/v1/completions", body)
    texts, _ = joined(stream(server, "/v1/completions", body))
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert all(t.startswith(PROMPTS[i // 2]) for i, t in texts.items())


def test_a_connection_serves_requests_after_a_refused_one(server):
    """Keep-alive: a refused request's body is read, not taken for the next request's start."""
    host, port = server.address
    bodies = [(b"/v1/embeddings", b'{"input": "hello"}'),
              (b"/v1/completions", json.dumps({"prompt": PROMPTS[0], "max_tokens": 2}).encode())]
    with socket.create_connection((host, port), timeout=60) as s:
        f = s.makefile("rb")
        for path, body in bodies:
            s.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            status = f.readline()
            length = 0
            while (line := f.readline()) != b"\r\n":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            answer = json.loads(f.read(length))
            assert status.split()[1] == (b"404" if path == b"/v1/embeddings" else b"200"), answer


def test_a_streamed_completions_offsets_continue_across_chunks(server):
    events = stream(server, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 6,
                                                "temperature": 0, "logprobs": 0})
    text = "".join(ev["choices"][0]["text"] for ev in events)
    offsets = [o for ev in events for o in ev["choices"][0]["logprobs"]["text_offset"]]
    tokens = [t for ev in events for t in ev["choices"][0]["logprobs"]["tokens"]]
    assert offsets == [sum(map(len, tokens[:k])) for k in range(len(tokens))]
    assert "".join(tokens).startswith(text)


def test_continuous_usage_counts_each_chunk(server):
    events = stream(server, "/v1/completions", {
        "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0,
        "stream_options": {"continuous_usage_stats": True}})  # include_usage: true by default
    counts = [ev["usage"]["completion_tokens"] for ev in events]
    assert counts == sorted(counts) and counts[-1] == 5 and events[-1]["choices"] == []


def test_prompt_logprobs_are_vllms_field(server, reference):
    want = reference.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2,
                                                          prompt_logprobs=1), use_tqdm=False)[0]
    expect = [None] + [{str(i): pytest.approx(v.logprob, abs=1e-5) for i, v in e.items()}
                       for e in want.prompt_logprobs[1:]]
    _, body = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2,
                                               "temperature": 0, "prompt_logprobs": 1})
    got = body["choices"][0]["prompt_logprobs"]
    assert [None if e is None else {i: v["logprob"] for i, v in e.items()} for e in got] == expect
    _, chat = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == \
        chat["usage"]["prompt_tokens"]


def test_fields_read_as_vllm_reads_them(server, reference):
    """max_completion_tokens wins over max_tokens; an integral number is an integer; top_logprobs
    0 without logprobs asks for nothing; chat_template_kwargs may repeat the request's fields."""
    messages = [{"role": "user", "content": "Hi"}]
    _, body = post(server, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 9, "max_completion_tokens": 3.0, "temperature": 0,
        "top_logprobs": 0, "chat_template_kwargs": {"add_generation_prompt": False}})
    want = reference.chat(messages, SamplingParams(temperature=0.0, max_tokens=3),
                          use_tqdm=False)[0].outputs[0]
    assert body["choices"][0]["message"]["content"] == want.text
    assert body["usage"]["completion_tokens"] == 3


def test_whole_and_chat_logprobs_of_the_whole_vocabulary():
    """-1 top logprobs (allowed where max_logprobs admits the vocabulary) lists every id the
    engine gave, by rank."""
    from minivllm.runtime.openai_api import chat_logprobs, completion_logprobs
    from minivllm.runtime.outputs import Logprob

    entry = {7: Logprob(-2.0, 3, "c"), 5: Logprob(-0.5, 1, "a"), 6: Logprob(-1.0, 2, "b")}
    assert list(completion_logprobs([7], [entry], -1, 0)["top_logprobs"][0]) == ["a", "b", "c"]
    assert [e["token"] for e in chat_logprobs([7], [entry], -1)["content"][0]["top_logprobs"]] == \
        ["a", "b", "c"]
    assert list(completion_logprobs([7], [entry], 1, 0)["top_logprobs"][0]) == ["a", "c"]


def test_a_client_that_leaves_a_whole_request_frees_it(server):
    host, port = server.address
    before = server.llm.stats.generation_tokens
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True}).encode()
    with socket.create_connection((host, port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.time() + 60
        while not server.llm.engine.requests and time.time() < deadline:
            time.sleep(0.01)  # it is running
    engine = server.llm.engine
    deadline = time.time() + 60
    while (server.loop.owners or engine.requests) and time.time() < deadline:
        time.sleep(0.05)
    assert not server.loop.owners and not engine.requests
    assert engine.stats.generation_tokens - before < 1000


def test_an_engine_failure_mid_stream_is_an_error_event(server, monkeypatch):
    """The openai client raises on an event holding "error" (vLLM's form)."""
    engine = server.llm.engine
    real, calls = engine.step, []

    def failing(**kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real(**kw)

    monkeypatch.setattr(engine, "step", failing)
    events = stream(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 50,
                                                "ignore_eos": True})
    assert "boom" in events[-1]["error"]["message"] and events[-1]["error"]["code"] == 500
    monkeypatch.undo()
    assert not engine.requests and not server.loop.owners
    assert post(server, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 2})[0] == 200


def test_an_api_key_guards_the_v1_routes(model_dir, device):
    srv = OpenAIServer(make_llm(model_dir, device, max_model_len=1024), port=0, api_key="sesame")
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        status, answer = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert status == 401 and answer["error"]["type"] == "AuthenticationError"
        req = urllib.request.Request(url(srv, "/v1/completions"), data=json.dumps(
            {"prompt": "x", "max_tokens": 1}).encode(), headers={"Authorization": "Bearer sesame"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        with urllib.request.urlopen(url(srv, "/health"), timeout=30) as r:
            assert r.status == 200  # not under /v1
    finally:
        srv.shutdown()


def test_a_cache_smaller_than_max_model_len_is_refused_at_start(model_dir, device):
    """As vLLM: a request without max_tokens (every default chat) could never fit."""
    with pytest.raises(ValueError, match="KV cache holds 1024 tokens, less than max_model_len=2048"):
        OpenAIServer(make_llm(model_dir, device, max_model_len=2048), port=0)


@pytest.mark.parametrize("path, fields, pattern", [
    ("/v1/completions", {"structured_outputs": {"choice": ["red", "green"]}}, "red|green"),
    ("/v1/completions", {"guided_regex": "[0-9]{2,4}"}, "[0-9]{2,4}"),
    ("/v1/completions", {"guided_choice": ["a b", "c"]}, "a b|c"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}}}}},
     r'\{[ ]?"n"[ ]?:[ ]?-?(?:0|[1-9][0-9]*)[ ]?\}'),
])
def test_structured_outputs_through_the_api(server, path, fields, pattern):
    import re

    body = {"max_tokens": 40, "temperature": 1.0, "n": 3, "seed": 4, **fields}
    body.update({"prompt": PROMPTS[0]} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "Hi"}]})
    status, answer = post(server, path, body)
    assert status == 200, answer
    from minivllm.runtime.regex_fsm import RegexDFA

    fsm = RegexDFA(pattern)
    for c in answer["choices"]:
        text = c["text"] if "text" in c else c["message"]["content"]
        if c["finish_reason"] == "length":  # cut short: a prefix of an accepted text
            assert fsm.walk(fsm.start, text) != fsm.DEAD, text
        else:
            assert c["finish_reason"] == "stop" and re.fullmatch(pattern, text), text
    status, answer = post(server, path, {**body, "guided_regex": "a", "guided_choice": ["b"]})
    assert status == 400 and "one constraint" in answer["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_response_format_json_object(server, path):
    """As vLLM's: the content is a JSON object (json_automaton.py), for chat and completions;
    json_object with another constraint is a 400."""
    from minivllm.runtime.json_automaton import JsonObjectAutomaton

    body = {"max_tokens": 60, "temperature": 1.0, "n": 4, "seed": 4,
            "response_format": {"type": "json_object"}}
    body.update({"prompt": PROMPTS[0]} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "Hi"}]})
    status, answer = post(server, path, body)
    assert status == 200, answer
    fsm, done = JsonObjectAutomaton(), 0
    for c in answer["choices"]:
        text = c["text"] if "text" in c else c["message"]["content"]
        if c["finish_reason"] == "length":  # cut short: a prefix of a JSON object
            assert fsm.walk(fsm.start, text) != fsm.DEAD, text
        else:
            assert c["finish_reason"] == "stop" and isinstance(json.loads(text), dict), text
            done += 1
    assert done > 0
    status, answer = post(server, path, {**body, "guided_regex": "a"})
    assert status == 400 and "one constraint" in answer["error"]["message"]
    plain = {k: v for k, v in body.items() if k != "response_format"}
    status, answer = post(server, path, {**plain, "structured_outputs": {"json_object": True,
                                                                         "regex": "a"}})
    assert status == 400 and "exactly one" in answer["error"]["message"]


def test_tokenize_and_detokenize_are_vllms(server, reference):
    tok = reference.get_tokenizer()
    status, body = post(server, "/tokenize", {"prompt": PROMPTS[0], "return_token_strs": True})
    ids = tok.encode(PROMPTS[0])
    assert status == 200 and body["tokens"] == ids and body["count"] == len(ids)
    assert body["token_strs"] == tok.convert_ids_to_tokens(ids) and body["max_model_len"] == 1024
    messages = [{"role": "user", "content": "Hi"}]
    _, chat = post(server, "/tokenize", {"messages": messages})
    assert chat["tokens"] == reference.chat_prompts(messages)[0]["prompt_token_ids"]
    status, back = post(server, "/detokenize", {"tokens": ids})
    assert status == 200 and back == {"prompt": tok.decode(ids)}
    for path, bad, match in (("/detokenize", {"tokens": [1, 10**6]}, "outside the vocabulary"),
                             ("/detokenize", {"tokens": ["a"]}, "token ids"),
                             ("/tokenize", {"prompt": "x", "messages": messages}, "'prompt' or"),
                             ("/tokenize", {"prompt": "x", "model": "other"}, "does not exist")):
        status, answer = post(server, path, bad)
        assert status in (400, 404) and match in answer["error"]["message"]


# -- prompt_embeds (serve --enable-prompt-embeds) ---------------------------------------------


def b64_tensor(obj, **save_kw) -> str:
    """A torch.save'd object as base64, as a client sends prompt_embeds (vLLM's docs)."""
    import base64
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf, **save_kw)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def embeds_server(model_dir, device):
    srv = OpenAIServer(make_llm(model_dir, device, max_model_len=1024, enable_prompt_embeds=True),
                       port=0, model_name=NAME)
    with serving(srv):
        yield srv


@pytest.fixture(scope="module")
def embed_rows(model_dir, embeds_server):
    """ids -> the checkpoint's embedding rows of them [len(ids), hidden] in the engine's dtype."""
    import glob

    import torch
    from safetensors.torch import load_file

    table = {}
    for f in glob.glob(os.path.join(model_dir, "*.safetensors")):
        table.update(load_file(f))
    weight = table["model.embed_tokens.weight"].to(embeds_server.llm.config.dtype)
    return lambda ids: weight[torch.tensor(ids)].clone()


def test_prompt_embeds_complete_as_their_ids(embeds_server, reference, embed_rows):
    """A prompt given as the model's own embedding rows of its ids: the token prompt's greedy
    text and tokens (logprobs), and usage counting its T rows as T prompt tokens. An empty
    "prompt" beside them (the openai client's required argument) adds no prompt (vLLM's)."""
    tok = reference.get_tokenizer()
    ids = tok.encode(PROMPTS[1])
    want = reference.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    status, body = post(embeds_server, "/v1/completions", {
        "prompt": "", "prompt_embeds": b64_tensor(embed_rows(ids)), "max_tokens": 8,
        "temperature": 0,
        "logprobs": 0, "ignore_eos": True})
    assert status == 200, body
    choice, = body["choices"]
    assert choice["text"] == want.text and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [e[t].decoded_token
                                            for t, e in zip(want.token_ids, want.logprobs)]
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 8,
                             "total_tokens": len(ids) + 8}


def test_a_list_of_prompt_embeds_and_a_prompt_together(embeds_server, reference, embed_rows):
    """Two prompts of embeddings and a text prompt in one request: the embeddings' choices first
    in their order, then the text's (vLLM's), each the completion of the same ids; usage counts
    every prompt's tokens, truncate_prompt_tokens keeping the last rows; streamed too."""
    tok = reference.get_tokenizer()
    a, b = tok.encode(PROMPTS[0]), tok.encode(PROMPTS[1])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            truncate_prompt_tokens=3)
    want = [o.outputs[0].text for o in reference.generate(
        [{"prompt_token_ids": b}, {"prompt_token_ids": a}, PROMPTS[0]], params, use_tqdm=False)]
    request = {"prompt_embeds": [b64_tensor(embed_rows(b)), b64_tensor(embed_rows(a))],
               "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
               "truncate_prompt_tokens": 3}
    status, body = post(embeds_server, "/v1/completions", request)
    assert status == 200, body
    assert [c["text"] for c in body["choices"]] == want
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 18, "total_tokens": 27}
    events = stream(embeds_server, "/v1/completions",
                    {**request, "stream_options": {"include_usage": True}})
    texts, _ = joined(events)
    assert [texts[k] for k in range(3)] == want
    assert events[-1]["usage"] == body["usage"]


def test_prompt_embeds_need_the_flag(server, embed_rows):
    status, answer = post(server, "/v1/completions", {
        "prompt_embeds": b64_tensor(embed_rows([1, 2])), "max_tokens": 2})
    assert status == 400 and "--enable-prompt-embeds" in answer["error"]["message"]
    assert not server.llm.engine.requests


class _Reduces:
    """A pickle that builds a valid [2, 128] tensor by calling torch.zeros on load: only an
    unrestricted torch.load (weights_only=False) would run it."""

    def __reduce__(self):
        import torch

        return torch.zeros, ((2, 128),)


def _bad_embeds(kind: str):
    """A request's prompt_embeds for each refusal (the demo model's hidden_size is 128)."""
    import base64
    import io
    import zipfile

    import torch

    if kind == "compressed":  # a valid tensor's archive, its records deflated
        raw = base64.b64decode(b64_tensor(torch.zeros(2, 128)))
        out = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(raw)) as src, \
                zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                dst.writestr(info.filename, src.read(info))
        return base64.b64encode(out.getvalue()).decode()
    return {
        "not base64": "@@not base64@@",
        "not torch.save": base64.b64encode(b"hello").decode(),
        "pickled code": b64_tensor(_Reduces()),
        "a dict": b64_tensor({"x": torch.zeros(2, 128)}),
        "two tensors": [b64_tensor(torch.zeros(2, 128)), b64_tensor([torch.zeros(2, 128)])],
        "integers": b64_tensor(torch.zeros(2, 128, dtype=torch.int64)),
        "float64": b64_tensor(torch.zeros(2, 128, dtype=torch.float64)),
        "sparse": b64_tensor(torch.zeros(2, 128).to_sparse()),
        "hidden 64": b64_tensor(torch.zeros(2, 64)),
        "3-D": b64_tensor(torch.zeros(1, 2, 128)),
        "1-D": b64_tensor(torch.zeros(128)),
        "no rows": b64_tensor(torch.zeros(0, 128)),
        "nan": b64_tensor(torch.full((2, 128), float("nan"))),
        "too long": b64_tensor(torch.zeros(1024, 128)),
        "too large": base64.b64encode(bytes(700 << 10)).decode(),
        "empty list": [],
        "a number": [3],
    }[kind]


@pytest.mark.parametrize("kind, extra, match", [
    ("not base64", {}, "not valid base64"),
    ("not torch.save", {}, "not a torch.save file"),
    ("compressed", {}, "compressed"),
    ("pickled code", {}, r"weights_only=True"),
    ("a dict", {}, "single tensor, got dict"),
    ("two tensors", {}, r"prompt_embeds\[1\].*single tensor, got list"),
    ("integers", {}, "float32, float16 or bfloat16, got torch.int64"),
    ("float64", {}, "got torch.float64"),
    ("sparse", {}, "dense"),
    ("hidden 64", {}, r"hidden_size=128\], got shape \[2, 64\]"),
    ("3-D", {}, r"got shape \[1, 2, 128\]"),
    ("1-D", {}, r"got shape \[128\]"),
    ("no rows", {}, "empty"),
    ("nan", {}, "non-finite"),
    ("too long", {}, "maximum context length is"),
    ("too large", {}, "too large"),
    ("empty list", {}, "non-empty array"),
    ("a number", {}, "base64 string"),
    ("hidden 64", {"echo": True}, "Echo is unsupported with prompt embeds"),
    ("hidden 64", {"prompt_logprobs": 1}, "prompt_logprobs is not compatible"),
])
def test_bad_prompt_embeds_are_answered_400(embeds_server, kind, extra, match):
    import re

    before = embeds_server.llm.stats.generation_tokens
    status, answer = post(embeds_server, "/v1/completions",
                          {"prompt_embeds": _bad_embeds(kind), "max_tokens": 2, **extra})
    assert status == 400, answer
    assert re.search(match, answer["error"]["message"]), answer["error"]["message"]
    assert embeds_server.llm.stats.generation_tokens == before
    assert not embeds_server.llm.engine.requests


def serve_flag_reaches_llm(model_dir, monkeypatch, flag: str) -> list[bool]:
    """LLM's keyword for `serve --FLAG` (its dashes as underscores) as the CLI passes it, with
    the flag and without (False where not passed), LLM itself stubbed out."""
    import minivllm.runtime.llm as llm_module
    from minivllm import cli

    seen = []
    monkeypatch.setattr(llm_module, "LLM", lambda model, **kw: seen.append(kw))
    for flags in ([f"--{flag}"], []):
        cli._make_llm(cli.build_parser().parse_args(["serve", model_dir, *flags]), model_dir)
    return [kw.get(flag.replace("-", "_"), False) for kw in seen]


def test_the_cli_flag_enables_prompt_embeds(model_dir, monkeypatch):
    """serve --enable-prompt-embeds reaches LLM(enable_prompt_embeds=True); off without it."""
    assert serve_flag_reaches_llm(model_dir, monkeypatch, "enable-prompt-embeds") == [True, False]
