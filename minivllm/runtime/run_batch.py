"""`minivllm run-batch`: vLLM's offline batch runner (`vllm run-batch`, its
entrypoints/openai/run_batch.py) over the OpenAI batch file format.

The input holds one BatchRequestInput a line, {"custom_id", "method", "url", "body"}; blank lines
are skipped, and neither the method nor the uniqueness of custom_id is checked (nor by vLLM).
The output holds one BatchRequestOutput a line, in the input's order:

    {"id": "vllm-<hex>", "custom_id": ..., "response": {"status_code": 200,
     "request_id": "vllm-batch-<hex>", "body": <the response>}, "error": null}

and for a request answered with an error, "response" {"status_code": <its status>, "request_id",
"body": null} and "error" the server's error body ({"error": {"message", "type", "param",
"code"}}, vLLM's ErrorResponse), or vLLM's plain message for a url it does not serve, a route
the model does not serve and a request that asks to stream (status 400 each). vLLM's routes are
taken: /v1/chat/completions, /v1/embeddings, any url ending /score and any ending /rerank; and
/v1/completions too, which vLLM's batch runner does not take (its docs: "completions coming
soon"). Each body is answered exactly as `minivllm serve` answers the same POST: its request
handler runs here over an in-memory connection, so that its checks (the body's fields, the
model's name, the context length, ...) and its response bodies are the server's own.

As vLLM's, the whole input is read before anything runs, and a line that is not a batch request
(not JSON, a field missing or of the wrong type, a body that is not an object) ends the run
with an error naming the line: here before the model loads, and with nothing written. vLLM reads
and writes http(s) URLs too; here they are refused (local files, or - for stdin / stdout).
Requests run concurrently (the engine batches them), each on a thread of its own, as many at
once as twice the engine's max_num_seqs (the bound vLLM's streaming runner kept).
"""

from __future__ import annotations

import io
import json
import logging
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass

from .openai_api import error_body
from .server import OpenAIServer, _Handler

log = logging.getLogger("minivllm")

# A batch request's fields (vLLM's BatchRequestInput); others are ignored with a warning, as its
# OpenAIBaseModel ignores them.
FIELDS = ("custom_id", "method", "url", "body")
# The urls answered, the server route of each, by vLLM's matching: the first three exactly, then
# any url ending in /score or /rerank.
EXACT_URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
SUFFIX_URLS = (("/score", "/v1/score"), ("/rerank", "/v1/rerank"))
SUPPORTED = "/v1/completions, /v1/chat/completions, /v1/embeddings, /score, /rerank"
STREAM_REFUSAL = "Request must not be sent in stream mode"  # vLLM's words


@dataclass(frozen=True)
class BatchRequest:
    """One line of the input: `line` its number in the file (from 1)."""

    line: int
    custom_id: str
    method: str
    url: str
    body: dict


def check_location(path: str, flag: str) -> str:
    """A local path or "-"; vLLM's http(s) URLs are refused before any work."""
    if path.lower().startswith(("http://", "https://")):
        raise ValueError(f"{flag} {path!r}: minivllm run-batch reads and writes local files only "
                         f"(or - for stdin / stdout); it does not fetch or upload URLs as vLLM's "
                         f"does")
    if not path:
        raise ValueError(f"{flag} is empty: give a path, or - for stdin / stdout")
    return path


def read_input(path: str) -> list[BatchRequest]:
    """--input-file's requests ("-": stdin's), every line checked before any work."""
    check_location(path, "--input-file")
    source = "stdin" if path == "-" else path
    try:
        if path == "-":
            stdin = getattr(sys.stdin, "buffer", None)
            text = stdin.read().decode("utf-8") if stdin is not None else sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--input-file {source}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise ValueError(f"--input-file {source}: {e.strerror or e}") from None
    return parse_requests(text, source)


def check_output(path: str) -> str:
    """--output-file checked before the model loads (a run must not end unable to write): a
    writable file in an existing directory, or "-"."""
    check_location(path, "--output-file")
    if path == "-":
        return path
    if os.path.isdir(path):
        raise ValueError(f"--output-file {path!r} is a directory")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--output-file {path!r}: no directory {folder!r}")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise ValueError(f"--output-file {path!r} cannot be written")
    return path


def parse_requests(text: str, source: str = "the input") -> list[BatchRequest]:
    """The batch requests of a JSONL text, or ValueError naming the first line that is none.
    Split at "\\n" only: JSON strings may hold U+2028 and other breaks str.splitlines takes."""
    requests = []
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.strip()
        if line:
            requests.append(parse_request(line, number, source))
    return requests


def parse_request(line: str, number: int, source: str = "the input") -> BatchRequest:
    where = f"{source} line {number}"
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{where}: its JSON nests too deep") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: a batch request is a JSON object {{\"custom_id\", "
                         f"\"method\", \"url\", \"body\"}}, got {type(value).__name__}")
    missing = [name for name in FIELDS if name not in value]
    if missing:
        raise ValueError(f"{where}: missing {missing} (a batch request has \"custom_id\", "
                         f"\"method\", \"url\" and \"body\")")
    for name in FIELDS[:3]:
        if not isinstance(value[name], str):
            raise ValueError(f"{where}: {name!r} must be a string, got {value[name]!r:.80}")
    if not isinstance(value["body"], dict):
        raise ValueError(f"{where}: 'body' must be a JSON object (the request's body), got "
                         f"{value['body']!r:.80}")
    extra = sorted(set(value) - set(FIELDS))
    if extra:
        log.warning("minivllm run-batch: %s: fields %s are ignored", where, extra)
    return BatchRequest(number, value["custom_id"], value["method"], value["url"], value["body"])


def route(url: str, routes) -> tuple[str | None, str | None]:
    """(the server route answering `url`, None), or (None, vLLM's message refusing it) for a
    url run-batch does not take or one whose route the model does not serve (`routes`: the
    server's, OpenAIServer.routes)."""
    path = url if url in EXACT_URLS else next(
        (p for suffix, p in SUFFIX_URLS if url.endswith(suffix)), None)
    if path is None:
        return None, f"URL {url} was used. Supported endpoints: {SUPPORTED}."
    if path not in routes:
        return None, f"Model does not support endpoint: {url}"
    return path, None


def batch_output(custom_id: str, status: int, body=None, error=None) -> dict:
    """vLLM's BatchRequestOutput: a new id and request_id (random_uuid()'s hex) each."""
    return {"id": f"vllm-{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"vllm-batch-{uuid.uuid4().hex}",
                         "body": body},
            "error": error}


def error_output(custom_id: str, message: str) -> dict:
    """vLLM's make_error_request_output: status 400, the message as the error."""
    return batch_output(custom_id, 400, error=message)


_EVENT_STREAM = b"\r\ncontent-type: text/event-stream"


class _Reply(io.BytesIO):
    """The write side of an in-memory connection: the handler's response. A streamed answer's
    headers end the exchange as a client that left ends it (BrokenPipeError: the handler aborts
    the request), so that a stream is refused once the server would have begun it, after all
    of its checks."""

    streamed = False

    def write(self, data) -> int:
        data = bytes(data)
        if not self.tell() and _EVENT_STREAM in data.split(b"\r\n\r\n", 1)[0].lower():
            self.streamed = True
            raise BrokenPipeError("a batch request does not stream")
        return super().write(data)


class _Exchange(_Handler):
    """The server's request handler over one in-memory request: bytes in, _Reply out."""

    def setup(self) -> None:
        self.connection = None
        self.rfile = io.BytesIO(self.request)
        self.wfile = _Reply()

    def finish(self) -> None:
        pass  # the reply is read afterwards

    def _client_gone(self) -> bool:
        return False  # no client to leave

    def log_message(self, fmt, *args) -> None:
        pass  # a line each request is the server's log, not a batch's


def answer(http, request: BatchRequest) -> dict:
    """The output line of one request: the server's answer to its body at its url's route.
    http: the OpenAIServer's http server (the handler reads its .app)."""
    path, refusal = route(request.url, http.app.routes)
    if refusal is not None:
        return error_output(request.custom_id, refusal)
    data = json.dumps(request.body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: run-batch\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    reply = _Exchange(head + data, ("run-batch", 0), http).wfile
    if reply.streamed:
        return error_output(request.custom_id, STREAM_REFUSAL)
    head, _, payload = reply.getvalue().partition(b"\r\n\r\n")
    if not head:  # the handler answers every request; never silently lose one
        return batch_output(request.custom_id, 500, error=error_body(
            "the server gave no answer", 500, "InternalServerError"))
    status = int(head.split(b" ", 2)[1])  # "HTTP/1.1 200 OK\r\n..."
    body = json.loads(payload) if payload else None
    if status == 200:
        return batch_output(request.custom_id, status, body=body)
    return batch_output(request.custom_id, status, error=body)


def _answers(http, requests: list[BatchRequest], workers: int):
    """Each request's output line, in input order, as they finish: `workers` threads answer
    them, the engine batching what they submit. Daemon threads: an interrupted run leaves none
    that would keep the process alive."""
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for k, request in enumerate(requests):
        todo.put((k, request))
    done: dict[int, dict] = {}
    ready = threading.Condition()
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            try:
                k, request = todo.get_nowait()
            except queue.Empty:
                return
            try:
                out = answer(http, request)
            except Exception as e:  # a bug here must not leave the writer waiting forever
                log.exception("minivllm run-batch: line %d failed", request.line)
                out = batch_output(request.custom_id, 500, error=error_body(
                    f"{type(e).__name__}: {e}", 500, "InternalServerError"))
            with ready:
                done[k] = out
                ready.notify_all()

    for n in range(min(workers, len(requests))):
        threading.Thread(target=work, name=f"minivllm-batch-{n}", daemon=True).start()
    try:
        for k in range(len(requests)):
            with ready:
                ready.wait_for(lambda: k in done)
                out = done.pop(k)
            yield out
    finally:
        stop.set()


def run_batch(llm, requests: list[BatchRequest], output: str, *, model_name: str,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              lora_modules=None, override_max_tokens: int | None = None,
              enable_prompt_tokens_details: bool = False,
              workers: int | None = None) -> tuple[int, int]:
    """Answer `requests` with `llm` as `minivllm serve` would (its options as OpenAIServer's)
    and write their output lines to `output` ("-": stdout) in input order, each once its turn
    comes. Returns (lines written, lines answered with an error)."""
    server = OpenAIServer(llm, host="127.0.0.1", port=0, model_name=model_name,
                          enable_auto_tool_choice=enable_auto_tool_choice,
                          tool_call_parser=tool_call_parser, lora_modules=lora_modules,
                          max_request_body_bytes=sys.maxsize,  # vLLM's batch has no cap
                          override_max_tokens=override_max_tokens,
                          enable_prompt_tokens_details=enable_prompt_tokens_details,
                          listen=False)  # the handler runs in memory: no address is bound
    server.http.server_close()  # its socket, never bound
    workers = workers or 2 * llm.config.max_num_seqs
    written = failed = 0
    start = time.perf_counter()
    out = sys.stdout if output == "-" else open(output, "w", encoding="utf-8")
    try:
        from tqdm import tqdm

        with tqdm(total=len(requests), unit="req", desc="Running batch",
                  disable=not sys.stderr.isatty()) as bar:
            for line in _answers(server.http, requests, workers):
                out.write(json.dumps(line, separators=(",", ":")) + "\n")
                written += 1
                failed += line["error"] is not None
                bar.update()
        out.flush()
    finally:
        if out is not sys.stdout:
            out.close()
        server.loop.stop()  # ends what still runs (an interrupted run) and the engine's thread
    where = "stdout" if output == "-" else output
    print(f"minivllm run-batch: {written} requests ({failed} answered with an error) in "
          f"{time.perf_counter() - start:.2f} s, written to {where}", file=sys.stderr)
    return written, failed
