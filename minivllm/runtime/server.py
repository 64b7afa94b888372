"""An OpenAI-compatible HTTP server over one LLM, as `vllm serve` (`minivllm serve`):
POST /v1/completions and /v1/chat/completions (whole responses, or server-sent events with
"stream": true), or for a pooling LLM (runner="pooling") vLLM's routes of its model: an
embedding model's /v1/embeddings (of input, or of messages through the chat template), a
classifier's /classify, and both's /score (/v1/score) and
/rerank (/v1/rerank, /v2/rerank) where LLM.score serves them; vLLM's /tokenize and /detokenize,
GET /v1/models, /health, /version and /metrics (vLLM's Prometheus metrics, runtime/metrics.py).
With LoRA modules (serve --enable-lora --lora-modules
name=path), a completion or chat request whose "model" names a module runs with that adapter,
and /v1/models lists the modules after the base model (each with "parent" the base model's
name), as vLLM's. With MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING), POST /v1/load_lora_adapter and /v1/unload_lora_adapter add
and remove modules while serving (OpenAIServer.load_lora_adapter says how). With sleep mode
(serve --enable-sleep-mode) and VLLM_SERVER_DEV_MODE=1, vLLM's development routes POST /sleep,
POST /wake_up, GET /is_sleeping and POST /reset_prefix_cache (OpenAIServer.dev_route says how).
A request body is read only up to a cap (serve --max-request-body-bytes): a larger one is a 413.

The engine is not thread-safe, so one thread owns it (EngineLoop): it takes new requests from a
queue between steps, steps while any is unfinished, and hands each request's outputs to the
thread serving its HTTP connection. Requests are checked on that thread before they are queued:
a bad one is answered 400 and never touches the engine, one whose prompt leaves no room for the
output it asks for (or for one token) is refused in vLLM's words (openai_api.check_room), and one
that cannot run otherwise (an id outside the vocabulary) is refused there by the engine's own
checks, before any step.
A client that disconnects mid-stream has its request aborted, freeing its blocks.
Only the standard library serves HTTP (http.server, one thread a connection): a small server for
a small engine, not a production front end.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import queue
import re
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

import torch

from . import reasoning, tool_calls
from .chat_output import ChatOutput
from .engine import tokenize_prompts
from .llm import LLM, _delta
from .lora import LoRARequest
from . import metrics as prometheus
from .openai_api import (EmbedsLimits, ParsedRequest, RequestError, chat_body, chat_choice,
                         chat_echo_choice, chat_output, chat_role_choice, check_room, classify_body,
                         completion_body, completion_choice, context_params, detokenize,
                         embedding_body, error_body, fit_context, new_id, now,
                         parse_chat, parse_classify, parse_completion, parse_detokenize,
                         parse_embedding, parse_rerank, parse_score, parse_tokenize, render_chat,
                         reasoning_tokens, rerank_body, score_body, token_usage, tokenize,
                         usage, vllm_prompt_logprobs)
from .pooling import PoolingParams
from .sleep import check_level, check_tags

log = logging.getLogger("minivllm")

_STOP = object()


class _Submission:
    """One HTTP request's engine requests: `replies` gets ("ids", ids) or ("error", exc) once,
    then `outputs` gets ("out", RequestOutput) (each step's with streaming, else the finished
    ones) or ("error", exc). finish: a /score or /rerank request's, which makes its finished
    outputs the pairs' scores (scoring.ScorePlan's)."""

    def __init__(self, req: ParsedRequest):
        self.req = req
        self.arrival = time.monotonic()  # its requests' arrival (metrics: TTFT, e2e latency)
        self.finish = None
        self.ids: list[str] = []
        # request id -> its prompt's tokens, for prompts given as embeddings (usage counts their
        # rows; their outputs carry no prompt_token_ids).
        self.prompt_lens: dict[str, int] = {}
        self.replies: queue.Queue = queue.Queue()
        self.outputs: queue.Queue = queue.Queue()


def _refuse_pooling_priority(engine, priority: int) -> None:
    """ValueError for a pooling request's priority other than 0: vLLM's error where the
    scheduling policy is not "priority", else because the engine queues pooling requests first
    come, first served (they take no priority), which would not honour it."""
    engine.check_priority([priority], 1)
    raise ValueError(f"Got priority {priority}, but pooling requests (embeddings, scores, "
                     f"classes) are served first come, first served: send priority 0")


def _kept_len(prompt, keep: int | None, max_model_len: int) -> int | None:
    """The tokens (or embedding rows) of an engine prompt that truncate_prompt_tokens=keep
    leaves (its last keep; -1: max_model_len), as engine.check_request counts them; None where
    that is not known here (a text without a tokenizer, a malformed prompt, a keep past
    max_model_len): the engine's checks refuse those in their own words."""
    if not isinstance(prompt, dict) or keep is not None and keep > max_model_len:
        return None
    embeds, ids = prompt.get("prompt_embeds"), prompt.get("prompt_token_ids")
    if isinstance(embeds, torch.Tensor) and embeds.ndim:
        n = embeds.shape[0]
    elif isinstance(ids, (list, tuple)) and embeds is None:
        n = len(ids)
    else:
        return None
    return n if keep is None else min(n, max_model_len if keep == -1 else keep)


class EngineLoop:
    """Runs `llm`'s engine on a thread of its own; other threads submit requests and read their
    outputs through queues."""

    def __init__(self, llm: LLM, override_max_tokens: int | None = None):
        self.llm = llm
        self.engine = llm.engine
        self.override_max_tokens = override_max_tokens  # OpenAIServer's: fit_context caps by it
        self.inbox: queue.Queue = queue.Queue()
        self.owners: dict[str, _Submission] = {}  # request id -> its submission
        # A sleep (level, reply) waiting for the running requests to finish (mode "wait"); new
        # requests are refused meanwhile, so that it comes.
        self.pending_sleep: tuple[int, queue.Queue] | None = None
        self.thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self.thread.start()

    def submit(self, req: ParsedRequest) -> _Submission:
        """Queue the request; RequestError if the engine refuses it (nothing is queued then)."""
        sub = _Submission(req)
        self.inbox.put(sub)
        kind, value = sub.replies.get()
        if kind == "error":
            raise value
        sub.ids = value
        return sub

    def abort(self, sub: _Submission) -> None:
        self.inbox.put(("abort", sub))

    def call(self, fn):
        """fn() run on the engine's thread, between steps (what reads the tokenizer or the
        engine); its ValueError / TypeError as a RequestError."""
        reply: queue.Queue = queue.Queue()
        self.inbox.put(("call", fn, reply))
        kind, value = reply.get()
        if kind == "error":
            raise value
        return value

    def sleep(self, level: int, mode: str) -> None:
        """engine.sleep(level) on the engine's thread, between steps, once no request runs:
        mode "abort" aborts the running ones first (each client answered 503), "wait" lets them
        finish, refusing new ones meanwhile. Returns once the engine sleeps."""
        reply: queue.Queue = queue.Queue()
        self.inbox.put(("sleep", level, mode, reply))
        kind, value = reply.get()
        if kind == "error":
            raise value

    def stop(self) -> None:
        self.inbox.put(_STOP)
        self.thread.join()

    # -- the engine's thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                item = self.inbox.get(block=not self.owners)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    self._fail(RuntimeError("the server is shutting down"))
                    if self.pending_sleep is not None:
                        self.pending_sleep[1].put(("error", RequestError(
                            "the server is shutting down", 503, "ServiceUnavailableError")))
                    return
                try:
                    self._take(item)
                except Exception as e:  # never leave a client waiting on a dead loop
                    log.exception("minivllm: the engine loop failed on a request")
                    if isinstance(item, _Submission):
                        item.replies.put(("error", RequestError(f"{type(e).__name__}: {e}", 500,
                                                                "InternalServerError")))
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    item = None
            if self.owners:
                self._step()
            if self.pending_sleep is not None and not self.owners:
                self._sleep(*self.pending_sleep)
                self.pending_sleep = None

    def _take(self, item) -> None:
        if isinstance(item, tuple) and item[0] == "sleep":
            _, level, mode, reply = item
            if self.pending_sleep is not None:
                reply.put(("error", RequestError("a sleep already waits for the running requests "
                                                 "(mode=wait)", 409, "ConflictError")))
            elif mode == "abort":
                self._fail(RequestError("the request was aborted: the engine was put to sleep "
                                        "(POST /sleep)", 503, "ServiceUnavailableError"),
                           reason="abort")
                self._sleep(level, reply)
            else:
                self.pending_sleep = (level, reply)
            return
        if isinstance(item, tuple) and item[0] == "call":
            _, fn, reply = item
            try:
                reply.put(("ok", fn()))
            except (ValueError, TypeError) as e:
                reply.put(("error", e if isinstance(e, RequestError) else RequestError(str(e))))
            except Exception as e:
                reply.put(("error", RequestError(f"{type(e).__name__}: {e}", 500,
                                                 "InternalServerError")))
            return
        if isinstance(item, tuple):  # ("abort", submission)
            for request_id in item[1].ids:
                if self.owners.pop(request_id, None) is not None:
                    self.engine.abort_request(request_id)
            return
        sub, req = item, item.req
        if self.pending_sleep is not None or self.engine.is_sleeping():
            state = (f"is sleeping ({', '.join(sorted(self.engine.sleeping))} freed by POST "
                     f"/sleep)" if self.engine.is_sleeping() else
                     "goes to sleep once the running requests finish (POST /sleep?mode=wait)")
            sub.replies.put(("error", RequestError(f"the engine {state}: POST /wake_up first",
                                                   503, "ServiceUnavailableError")))
            return
        try:
            prompts = req.prompts
            if req.messages is not None:
                prompt = render_chat(self.llm, req.messages, req.chat_options)
                # A chat embedding's text is tokenized as an input's, by its add_special_tokens.
                prompts = [prompt["prompt"] if isinstance(req.params, PoolingParams) else prompt]
            # All checked before any is queued, as LLM.generate does.
            if isinstance(req.params, PoolingParams) and req.priority:
                _refuse_pooling_priority(self.engine, req.priority)
            if req.score_inputs is not None:  # the pairs' prompts, tokenized on this thread
                plan = self.llm.score_plan(*req.score_inputs, req.params)
                ids = self.engine.add_pooling_requests(plan.prompts, plan.params,
                                                       arrival_time=sub.arrival)
                sub.finish = plan.finish
            elif isinstance(req.params, PoolingParams):
                if not req.add_special_tokens:
                    prompts = tokenize_prompts(self.engine.tokenizer, prompts, False)
                ids = self.engine.add_pooling_requests(prompts, [req.params] * len(prompts),
                                                       arrival_time=sub.arrival)
            else:
                priority = self.engine.check_priority([req.priority] * len(prompts), len(prompts))
                # A completion's texts (chat's prompts are rendered, with their ids).
                prompts = tokenize_prompts(self.engine.tokenizer, prompts, req.add_special_tokens)
                if req.cache_salt is not None:  # the engine reads it from each prompt dict
                    prompts = [{**(p if isinstance(p, dict) else {"prompt": p}),
                                "cache_salt": req.cache_salt} for p in prompts]
                lora = req.lora_request
                max_len = self.llm.config.max_model_len
                asked = req.max_tokens_asked
                params = context_params(req.params, asked, req.max_tokens_field, max_len)
                # vLLM's server measures a prompt against the context before the engine sees
                # it: a prompt with no room left is refused in its words, not the engine's.
                for p in prompts:
                    kept = _kept_len(p, params.truncate_prompt_tokens, max_len)
                    if kept is not None:
                        check_room(kept, asked, max_len)
                checked = [self.engine.check_request(p, params, lora) for p in prompts]
                # Each prompt's own: max_tokens is lowered to the room it leaves.
                fitted = [fit_context(params, asked, len(c.ids), max_len,
                                      self.override_max_tokens) for c in checked]
                ids = [self.engine.enqueue(c, pp, pr, lora, arrival_time=sub.arrival)
                       for c, pp, pr in zip(checked, fitted, priority)]
                # The rows the engine keeps (after truncate_prompt_tokens), as it counts them.
                sub.prompt_lens = {rid: len(c.ids) for rid, c in zip(ids, checked)
                                   if isinstance(c.ids, torch.Tensor)}
        except (ValueError, TypeError) as e:
            sub.replies.put(("error", e if isinstance(e, RequestError) else RequestError(str(e))))
            return
        except Exception as e:  # a template that raised, say: answered, and the loop goes on
            sub.replies.put(("error", RequestError(f"{type(e).__name__}: {e}")))
            return
        for request_id in ids:
            self.owners[request_id] = sub
        sub.replies.put(("ids", ids))

    def _step(self) -> None:
        streaming = any(sub.req.stream for sub in self.owners.values())
        try:
            outs = self.engine.step(unfinished=streaming)
        except Exception as e:  # the engine stays usable (a failed step forgets its work)
            log.exception("minivllm: a step failed; its requests are aborted")
            self._fail(e)
            return
        for out in outs:
            sub = self.owners.get(out.request_id)
            if sub is None:
                continue
            if out.finished:
                del self.owners[out.request_id]
            if out.finished or sub.req.stream:
                sub.outputs.put(("out", out))

    def _sleep(self, level: int, reply: queue.Queue) -> None:
        try:
            self.engine.sleep(level)
            reply.put(("ok", None))
        except ValueError as e:
            reply.put(("error", RequestError(str(e))))
        except Exception as e:
            log.exception("minivllm: sleep failed")
            reply.put(("error", RequestError(f"{type(e).__name__}: {e}", 500,
                                             "InternalServerError")))

    def _fail(self, error: Exception, reason: str = "error") -> None:
        """End every request running, each client answered `error` (reason: its metrics')."""
        for request_id, sub in list(self.owners.items()):
            if request_id in self.engine.requests:
                self.engine.abort_request(request_id, reason)
            sub.outputs.put(("error", error))
        self.owners.clear()


# The routes of a generating LLM, and of a pooling one (as vLLM, each serves its own).
_ROUTES = {"/v1/completions": parse_completion, "/v1/chat/completions": parse_chat}
_SCORE_ROUTES = {"/score": parse_score, "/v1/score": parse_score, "/rerank": parse_rerank,
                 "/v1/rerank": parse_rerank, "/v2/rerank": parse_rerank}
_TOKENIZER_ROUTES = ("/tokenize", "/detokenize")
_GET_ROUTES = ("/health", "/ping", "/v1/models", "/version", "/metrics")
# Served only with RUNTIME_LORA_ENV set (elsewhere a 404: no such route, as vLLM's).
_ADAPTER_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
RUNTIME_LORA_ENV = "MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING"
# vLLM's development routes, served only in dev mode (elsewhere a 404, as vLLM's): POST ones, and
# GET /is_sleeping. The variable is vLLM's own name, so that scripts written for vLLM run as they
# are; MINIVLLM_SERVER_DEV_MODE is taken too.
_DEV_ROUTES = ("/sleep", "/wake_up", "/reset_prefix_cache")
DEV_MODE_ENVS = ("VLLM_SERVER_DEV_MODE", "MINIVLLM_SERVER_DEV_MODE")
# The request body's cap unless serve --max-request-body-bytes gives one (uvicorn, under vLLM's
# server, has none; Triton's OpenAI front end takes 64 MiB by default): far more than a 128K-token
# prompt's JSON, as text or ids; with --enable-prompt-embeds raised to what one max_model_len
# prompt of base64 fp32 embeddings needs, where that is more.
DEFAULT_MAX_BODY_BYTES = 64 << 20


def check_port(port) -> int:
    """The port to serve at, or ValueError: bind's own refusal of one out of range is an
    OverflowError. `minivllm serve --port` is checked by this too, before the model loads."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an integer in [0, 65535] (0: any free one), got "
                         f"{port!r}")
    return port


def runtime_lora_updating(environ=None) -> bool:
    """Whether the server takes adapters at runtime: RUNTIME_LORA_ENV is 1 or true (vLLM's
    rule for VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    env = os.environ if environ is None else environ
    return env.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


def server_dev_mode(environ=None) -> bool:
    """Whether vLLM's development routes are served: VLLM_SERVER_DEV_MODE (or
    MINIVLLM_SERVER_DEV_MODE) is 1 or true."""
    env = os.environ if environ is None else environ
    return any(env.get(name, "0").strip().lower() in ("1", "true") for name in DEV_MODE_ENVS)


def pooling_routes(llm: LLM) -> dict:
    """A pooling LLM's routes, as vLLM's: an embedding model's /v1/embeddings, a classifier's
    /classify, and /score and /rerank for both, a classifier's only with one label (its score)."""
    head = llm.config.classifier
    if head is None:
        return {"/v1/embeddings": parse_embedding, **_SCORE_ROUTES}
    return {"/classify": parse_classify, **(_SCORE_ROUTES if head.num_labels == 1 else {})}


def _failure(error: Exception) -> tuple[int, dict]:
    """The status and error body of a request ended by `error`: a RequestError's own (a
    sleep's abort is a 503), else a 500 naming the engine's failure."""
    if isinstance(error, RequestError):
        return error.status, error_body(str(error), error.status, error.kind, error.param)
    return 500, error_body(f"the engine failed: {error}", 500, "InternalServerError")


class _ClientGone(Exception):
    """The client closed its connection."""


class _Handler(BaseHTTPRequestHandler):
    server_version = "minivllm"
    protocol_version = "HTTP/1.1"

    @property
    def app(self) -> "OpenAIServer":
        return self.server.app  # type: ignore[attr-defined]

    def log_message(self, fmt, *args) -> None:
        log.info("minivllm serve: %s %s", self.address_string(), fmt % args)

    # -- plumbing --------------------------------------------------------------------------------

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":  # HEAD: GET's status and headers alone
            self.wfile.write(data)

    def _send_json(self, status: int, body) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send_text(self, status: int, text: str) -> None:
        self._send(status, text.encode(), "text/plain; charset=utf-8")

    def _error(self, status: int, message: str, kind: str = "BadRequestError",
               param: str | None = None) -> None:
        self._send_json(status, error_body(message, status, kind, param))

    def _read_body(self) -> bytes:
        """The request's body, read whole before anything is answered: a body left unread would
        be taken for the next request on this keep-alive connection. A body this server cannot
        delimit closes the connection after the answer."""
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise RequestError("send the body with a Content-Length (chunked bodies are not "
                               "read)", 411, "LengthRequired")
        values = self.headers.get_all("Content-Length") or []
        # None: no body (HTTP/1.1's rule; `curl -X POST .../sleep` sends none), which a JSON
        # route then refuses; else digits only (int() would take "+1", "1_0", " 1").
        if len(set(v.strip() for v in values)) > 1 or \
                values and not re.fullmatch(r"[0-9]+", values[0].strip()):
            self.close_connection = True
            raise RequestError(f"a bad Content-Length header: {', '.join(values)!r} (one "
                               f"non-negative integer)")
        length = int(values[0]) if values else 0
        cap = self.app.max_request_body_bytes
        if length > cap:  # answered before reading: the body is never held
            self.close_connection = True
            raise RequestError(f"the request body is {length} bytes, more than the {cap} this "
                               f"server takes (serve --max-request-body-bytes)", 413,
                               "RequestEntityTooLarge")
        return self.rfile.read(length) if length else b""

    def _authorized(self) -> bool:
        key = self.app.api_key
        if key is None or not self.path.startswith("/v1"):
            return True
        if self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self._error(401, "Unauthorized: a wrong or missing API key", "AuthenticationError")
        return False

    def _client_gone(self) -> bool:
        """Whether the client closed its side (it sends nothing more while it waits)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _next_output(self, sub: _Submission):
        """The next ("out", output) or ("error", exc) of `sub`; _ClientGone if the client leaves
        while it waits (its request is then aborted, freeing its blocks, as vLLM does)."""
        while True:
            try:
                return sub.outputs.get(timeout=0.25)
            except queue.Empty:
                if self._client_gone():
                    raise _ClientGone from None

    # -- routes --------------------------------------------------------------------------------

    def _method(self, path: str) -> str | None:
        """The method `path` takes ("GET" or "POST"), None where it is no route."""
        app = self.app
        if path in _GET_ROUTES or path == "/is_sleeping" and app.dev_mode:
            return "GET"
        if (path in app.routes or path in _TOKENIZER_ROUTES or path in app.adapter_routes
                or path in _DEV_ROUTES and app.dev_mode):
            return "POST"
        return None

    def _other_method(self) -> None:
        """PUT, DELETE, PATCH, OPTIONS: OpenAI's error body, a 405 on a route and a 404
        elsewhere (as vLLM's), not http.server's HTML 501. Their body is not read: the
        connection closes after the answer."""
        self.close_connection = True
        if not self._authorized():
            return
        path = self.path.split("?", 1)[0]
        method = self._method(path)
        if method is None:
            self._error(404, f"no route {path}", "NotFoundError")
        else:
            self._error(405, f"{path} takes {method}", "MethodNotAllowed")

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _other_method

    def do_HEAD(self) -> None:
        """GET's answer without its body (Starlette, under vLLM, serves HEAD so)."""
        self.do_GET()

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if not self._authorized():
            return
        if path in ("/health", "/ping"):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": self.app.model_cards()})
        elif path == "/version":
            from .. import __version__

            self._send_json(200, {"version": __version__})
        elif path == "/metrics":
            self._metrics()
        elif path == "/is_sleeping" and self.app.dev_mode:
            # Read without waiting for a step (as vLLM answers mid-generation): a set's truth.
            self._send_json(200, {"is_sleeping": self.app.llm.engine.is_sleeping()})
        elif self._method(path) == "POST":
            self._error(405, f"{path} takes POST", "MethodNotAllowed")
        else:
            self._error(404, f"no route {path}", "NotFoundError")

    def do_POST(self) -> None:
        sub = None
        try:
            raw = self._read_body()
            if not self._authorized():
                return
            path, _, query = self.path.partition("?")
            if self.app.dev_mode and path in _DEV_ROUTES:  # their body, if any, is not read
                self.app.dev_route(path, parse_qs(query, keep_blank_values=True))
                self._send(200, b"", "text/plain; charset=utf-8")  # vLLM's empty 200
                return
            if self._method(path) == "GET":
                raise RequestError(f"{path} takes GET", 405, "MethodNotAllowed")
            parse = self.app.routes.get(path)
            adapters = path in self.app.adapter_routes
            if parse is None and path not in _TOKENIZER_ROUTES and not adapters:
                raise RequestError(f"no route {path}", 404, "NotFoundError")
            if not raw:
                raise RequestError("the request has no body: send a JSON object, with its "
                                   "Content-Length")
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(f"the request body is not JSON: {e}") from None
            except RecursionError:  # json's decoder recurses per array or object: ~1,000 deep
                raise RequestError("the request body's JSON nests too deep") from None
            if adapters:  # vLLM answers a plain-text line
                load = path == "/v1/load_lora_adapter"
                self._send_text(200, (self.app.load_lora_adapter if load else
                                      self.app.unload_lora_adapter)(body))
                return
            if parse is None:
                self._send_json(200, self._tokenizer_route(path, body))
                return
            req = (parse(body, self.app.defaults, self.app.embeds_limits)
                   if parse is parse_completion else parse(body, self.app.defaults))
            # As vLLM's: the X-Request-Id header wins over the body's request_id. Either names
            # the response alone (the engine numbers its requests itself: no two collide).
            header = self.headers.get("X-Request-Id")
            if header:
                req = dataclasses.replace(req, request_id=header)
            lora = self._check_model(req.model)
            if lora is not None:
                if parse not in (parse_completion, parse_chat):
                    raise RequestError(f"`{req.model}` is a LoRA adapter: it serves completions "
                                       f"and chat completions only")
                req = dataclasses.replace(req, lora_request=lora)
            if req.tool_mode == "auto" and not self.app.tool_call_parser:
                raise RequestError('"auto" tool choice requires --enable-auto-tool-choice and '
                                   '--tool-call-parser to be set')
            sub = self.app.loop.submit(req)
            if parse is parse_embedding:
                self._embeddings(sub)
            elif parse in (parse_score, parse_rerank, parse_classify):
                self._pooled(sub, parse)
            elif req.stream:
                self._stream(sub, parse is parse_chat)
            else:
                self._whole(sub, parse is parse_chat)
        except RequestError as e:
            self._error(e.status, str(e), e.kind, e.param)
        except (_ClientGone, BrokenPipeError, ConnectionResetError):
            if sub is not None:
                self.app.loop.abort(sub)  # the client left: free its blocks
            self.close_connection = True
        except Exception as e:  # never close a connection without an answer
            log.exception("minivllm serve: a request failed")
            if sub is not None:
                self.app.loop.abort(sub)
            self.close_connection = True
            try:
                self._error(500, f"{type(e).__name__}: {e}", "InternalServerError")
            except OSError:
                pass

    def _check_model(self, name: str | None) -> LoRARequest | None:
        """A request may name the served model, a LoRA module (whose LoRARequest this
        returns), or none (as vLLM: any other is a 404)."""
        if name is None or name == self.app.model_name:
            return None
        lora = self.app.lora_modules.get(name)
        if lora is None:
            raise RequestError(f"The model `{name}` does not exist.", 404, "NotFoundError")
        return lora

    def _metrics(self) -> None:
        """vLLM's Prometheus metrics (runtime/metrics.py): a snapshot taken between two steps,
        rendered here."""
        app = self.app
        try:
            snap = app.loop.call(lambda: prometheus.snapshot(app.llm.engine))
        except RequestError as e:
            self._error(e.status, str(e), e.kind)
            return
        self._send(200, prometheus.render(snap, app.model_name).encode(), prometheus.CONTENT_TYPE)

    def _tokenizer_route(self, path: str, body) -> dict:
        """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize."""
        app = self.app
        if app.llm.engine.tokenizer is None:  # get_tokenizer() raises there, as vLLM's
            raise RequestError("this server has no tokenizer")
        if path == "/tokenize":
            req = parse_tokenize(body)
            self._check_model(req.model)
            return app.loop.call(lambda: tokenize(app.llm, req))
        req = parse_detokenize(body)
        self._check_model(req["model"])
        return app.loop.call(lambda: detokenize(app.llm, req["tokens"]))

    def _finished(self, sub: _Submission) -> list | None:
        """The submission's finished outputs in its requests' order; None (answered 500) if
        the engine failed."""
        finished: dict[str, object] = {}
        while len(finished) < len(sub.ids):
            kind, value = self._next_output(sub)
            if kind == "error":
                self._send_json(*_failure(value))
                return None
            finished[value.request_id] = value
        return [finished[i] for i in sub.ids]

    def _embeddings(self, sub: _Submission) -> None:
        outs = self._finished(sub)
        if outs is not None:
            self._send_json(200, embedding_body(new_id("embd", sub.req.request_id), now(),
                                                self.app.model_name, outs,
                                                sub.req.encoding_format))

    def _pooled(self, sub: _Submission, parse) -> None:
        """A /score, /rerank or /classify response, once every request of it finished."""
        outs = self._finished(sub)
        if outs is None:
            return
        app, req = self.app, sub.req
        if parse is parse_classify:
            body = classify_body(new_id("classify", req.request_id), now(), app.model_name,
                                 outs, app.llm.config.classifier.labels)
        elif parse is parse_score:
            body = score_body(new_id("score", req.request_id), now(), app.model_name,
                              sub.finish(outs))
        else:
            body = rerank_body(new_id("rerank", req.request_id), app.model_name,
                               sub.finish(outs), req.score_inputs[1], req.top_n)
        self._send_json(200, body)

    def _whole(self, sub: _Submission, chat: bool) -> None:
        outs = self._finished(sub)
        if outs is None:
            return
        app, req, created = self.app, sub.req, now()
        name = app.response_name(req)
        if chat:
            out = outs[0]
            parsers = [app.chat_output(req, out) for _ in out.outputs]
            choices = [chat_choice(c, req, p, delta=False) for c, p in zip(out.outputs, parsers)]
            body = chat_body(new_id("chatcmpl", req.request_id), created, name, choices,
                             usage(outs, req, sub.prompt_lens, app.prompt_tokens_details,
                                   reasoning_tokens(parsers, app.reasoning_parser)))
            if req.prompt_logprobs:
                body["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs)
        else:
            n = req.params.n
            choices = [completion_choice(out, c, req, app.decode, index=k * n + c.index)
                       for k, out in enumerate(outs) for c in out.outputs]
            body = completion_body(new_id("cmpl", req.request_id), created, name, choices,
                                   usage(outs, req, sub.prompt_lens, app.prompt_tokens_details))
        self._send_json(200, body)

    def _stream(self, sub: _Submission, chat: bool) -> None:
        """Server-sent events, as vLLM's: one choice a chunk (a chat completion's first chunks
        name each choice's role, then with echo give each its echo), the finish_reason with a
        choice's last chunk, a usage chunk last with stream_options.include_usage (with
        continuous_usage_stats also on every chunk: its choice's tokens so far and its prompt's),
        then [DONE]. With a reasoning parser a chat's usage also says how many of the tokens are
        reasoning (a chunk's: its choice's so far; the last: every choice's). A failure once the
        stream began is an error event before [DONE] (vLLM's), its requests aborted."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            self._stream_events(sub, chat)
        except (_ClientGone, OSError):
            raise
        except Exception as e:  # the headers are sent: an error event, never a second answer
            log.exception("minivllm serve: a stream failed; its requests are aborted")
            self.app.loop.abort(sub)
            self._event(error_body(f"{type(e).__name__}: {e}", 500, "InternalServerError"))
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _stream_events(self, sub: _Submission, chat: bool) -> None:
        """_stream's events before [DONE]."""
        app, req, created = self.app, sub.req, now()
        name = app.response_name(req)
        make = chat_body if chat else completion_body
        request_id = new_id("chatcmpl" if chat else "cmpl", req.request_id)

        def event(choices: list[dict], usage_: dict | None) -> None:
            self._event(make(request_id, created, name, choices, usage_, chunk=True))

        sent: dict = {}
        texts: dict[tuple[str, int], int] = {}  # a completion's text sent (its text_offset)
        tokens: dict[tuple[str, int], int] = {}  # each choice's tokens sent (continuous usage)
        parsers: dict[tuple[str, int], object] = {}  # a chat completion's ChatOutput
        last: dict[str, object] = {}
        order = {rid: k for k, rid in enumerate(sub.ids)}
        done = 0
        while done < len(sub.ids):
            kind, value = self._next_output(sub)
            if kind == "error":
                self._event(_failure(value)[1])
                return
            rid = value.request_id
            prompt_len = (len(value.prompt_token_ids) if value.prompt_token_ids is not None
                          else sub.prompt_lens[rid])
            if chat and not last:  # vLLM's first chunks: every choice's role, then its echo
                opening = (token_usage(prompt_len, 0, 0 if app.reasoning_parser else None)
                           if req.continuous_usage else None)
                for index in range(req.params.n):
                    event([chat_role_choice(index, req.role)], opening)
                for index in range(req.params.n if req.chat_echo else 0):
                    event([chat_echo_choice(index, req.chat_echo)], opening)
            last[rid] = value
            done += value.finished
            delta = _delta(value, sent)
            if delta is None:
                continue
            for c in delta.outputs:
                key = (rid, c.index)
                tokens[key] = tokens.get(key, 0) + len(c.token_ids)
                if chat:
                    if key not in parsers:
                        parsers[key] = app.chat_output(req, value)
                    # It counts the reasoning among c's tokens too, its chunk sent or not.
                    choice = chat_choice(c, req, parsers[key], delta=True)
                    if choice is None:
                        continue
                else:
                    choice = completion_choice(delta, c, req, app.decode,
                                               index=order[rid] * req.params.n + c.index,
                                               first=key not in texts, offset=texts.get(key, 0))
                    # The text sent, an echoed prompt's with it: the next token's text_offset.
                    texts[key] = texts.get(key, 0) + len(choice["text"])
                if req.continuous_usage:
                    event([choice], token_usage(prompt_len, 0 if req.echo_only else tokens[key],
                                                parsers[key].reasoning_tokens if chat else None))
                else:
                    event([choice], None)
        if req.include_usage:
            reasoning = reasoning_tokens(parsers.values(), chat and app.reasoning_parser)
            event([], usage([last[i] for i in sub.ids], req, sub.prompt_lens,
                            app.prompt_tokens_details, reasoning))

    def _event(self, body: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        self.wfile.flush()


class OpenAIServer:
    """The HTTP server and the engine loop over `llm`; `model_name` is the name requests give
    as "model" (any other is a 404, as vLLM's)."""

    def __init__(self, llm: LLM, *, host: str = "127.0.0.1", port: int = 8000,
                 model_name: str = "minivllm", api_key: str | None = None,
                 enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 lora_modules=None, disable_log_stats: bool = False,
                 max_request_body_bytes: int | None = None, listen: bool = True,
                 override_max_tokens: int | None = None,
                 enable_prompt_tokens_details: bool = False):
        """listen=False: no address is bound, for a caller that runs the request handler in
        memory (runtime/run_batch.py). override_max_tokens: the most tokens any request
        generates, even one whose max_tokens asks for more (vLLM's serving override_max_tokens:
        generation_config.override_max_tokens gives it for LLM's generation_config and
        override_generation_config; serve --override-generation-config's max_new_tokens).
        enable_prompt_tokens_details: usage (a whole response's, a stream's last chunk's) gives
        prompt_tokens_details {"cached_tokens"}, as vLLM's --enable-prompt-tokens-details."""
        tool_calls.check_parser(tool_call_parser)
        check_port(port)
        if override_max_tokens is not None and (
                isinstance(override_max_tokens, bool) or not isinstance(override_max_tokens, int)
                or override_max_tokens < 1):
            raise ValueError(f"override_max_tokens must be a positive integer or None, got "
                             f"{override_max_tokens!r}")
        if enable_auto_tool_choice and tool_call_parser is None:  # vLLM's check, at start
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (the form of the "
                             "calls tool_choice 'auto' reads from the answer)")
        config = llm.config
        capacity = llm.engine.num_blocks * config.block_size
        if capacity < config.max_model_len:
            # As vLLM, which refuses to start so: a request without max_tokens may grow to
            # max_model_len, so each such request (every default chat) would be refused.
            raise ValueError(f"the KV cache holds {capacity} tokens, less than max_model_len="
                             f"{config.max_model_len}: lower max_model_len or give the cache "
                             f"more blocks")
        if not isinstance(enable_prompt_tokens_details, bool):
            raise TypeError(f"enable_prompt_tokens_details must be a bool, got "
                            f"{enable_prompt_tokens_details!r}")
        self.prompt_tokens_details = enable_prompt_tokens_details
        self.llm = llm
        if disable_log_stats:  # as vLLM's flag: no metrics recorded (/metrics has the config only)
            llm.engine.metrics = None
        self.model_name = model_name
        # name -> LoRARequest. Replaced whole, never changed in place, when an adapter is loaded
        # or unloaded at runtime: the threads serving requests read it without a lock.
        self.lora_modules = self._lora_modules(llm, model_name, lora_modules)
        self.adapter_routes = _ADAPTER_ROUTES if runtime_lora_updating() else ()
        if self.adapter_routes:
            log.warning("minivllm serve: LoRA adapters may be loaded and unloaded at runtime "
                        "(%s): for local development only, as vLLM warns", RUNTIME_LORA_ENV)
        self._adapter_lock = threading.Lock()  # one load or unload at a time
        self._lora_ids = itertools.count(1 + max(
            (lora.lora_int_id for lora in self.lora_modules.values()), default=0))
        self.api_key = api_key
        # tool_choice "auto" reads calls only with both (a parser alone serves the constrained
        # choices, which need none, as vLLM's).
        self.tool_call_parser = tool_call_parser if enable_auto_tool_choice else None
        self.defaults = llm.get_diff_sampling_param()
        # What a completion's prompt_embeds must fit; None: they are refused (vLLM's
        # --enable-prompt-embeds, off by default: the bytes come from clients).
        self.embeds_limits = (EmbedsLimits(config.model_config.hidden_size, config.max_model_len)
                              if config.enable_prompt_embeds else None)
        # A client must not make the server allocate what it likes: Content-Length is checked
        # against this before the body is read. By default room for one max_model_len prompt of
        # base64 fp32 embeddings where they are taken, and 1 MiB for the rest of the JSON.
        if max_request_body_bytes is None:
            need = (4 * (self.embeds_limits.max_bytes // 3 + 1) + (1 << 20)
                    if self.embeds_limits is not None else 0)
            max_request_body_bytes = max(DEFAULT_MAX_BODY_BYTES, need)
        if isinstance(max_request_body_bytes, bool) or not isinstance(max_request_body_bytes, int) \
                or max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be a positive integer, got "
                             f"{max_request_body_bytes!r}")
        self.max_request_body_bytes = max_request_body_bytes
        self.dev_mode = server_dev_mode()
        if self.dev_mode:
            log.warning("minivllm serve: development routes are served (/sleep, /wake_up, "
                        "/is_sleeping, /reset_prefix_cache; VLLM_SERVER_DEV_MODE): not for "
                        "production, as vLLM warns")
        tok = llm.engine.tokenizer  # None without one (get_tokenizer() raises there)
        self.decode = tok.decode if tok is not None else None
        self.routes = pooling_routes(llm) if llm.config.runner == "pooling" else _ROUTES
        # Bound first: an address that cannot be served (taken, a host not this machine's)
        # fails before the engine's thread starts, which nothing would stop then.
        self.http = ThreadingHTTPServer((host, port), _Handler, bind_and_activate=listen)
        self.loop = EngineLoop(llm, override_max_tokens)
        self.http.daemon_threads = True
        self.http.app = self  # type: ignore[attr-defined]

    @property
    def address(self) -> tuple[str, int]:
        return self.http.server_address[:2]

    @property
    def reasoning_parser(self) -> bool:
        """Whether the LLM has a reasoning parser (the chat's usage then counts reasoning)."""
        return self.llm.engine.think_tags is not None

    def chat_output(self, req: ParsedRequest, out) -> ChatOutput:
        """The ChatOutput of a completion of `out`'s prompt (a RequestOutput): its reasoning
        phase read from the prompt's ids where the LLM has a reasoning parser."""
        tags = self.llm.engine.think_tags
        phase = tags.prompt_phase(out.prompt_token_ids) if tags is not None else None
        return chat_output(req, phase, self.tool_call_parser, tags)

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": now(), "owned_by": "minivllm",
                "root": self.llm.config.model, "max_model_len": self.llm.config.max_model_len}

    def model_cards(self) -> list[dict]:
        """/v1/models' data: the base model, then each LoRA module, as vLLM's (root: the
        adapter's path, parent: the base model's name)."""
        cards = [self.model_card()]
        for lora in self.lora_modules.values():
            cards.append({"id": lora.lora_name, "object": "model", "created": now(),
                          "owned_by": "minivllm", "root": lora.lora_path,
                          "parent": lora.base_model_name or self.model_name,
                          "max_model_len": self.llm.config.max_model_len})
        return cards

    def response_name(self, req: ParsedRequest) -> str:
        """The "model" a response names: the LoRA module's the request asked for, else the
        served model's."""
        lora = req.lora_request
        return lora.lora_name if lora is not None else self.model_name

    def load_lora_adapter(self, body) -> str:
        """POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"?}, as vLLM's:
        the adapter is read and checked on the engine's thread (a bad one is a 400 naming what
        is wrong, and nothing changes) and then served under the name, with a new lora_int_id.
        A name already loaded is a 400 unless load_inplace is true: the name then takes the new
        adapter, and requests already running with the old one finish with it."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise RequestError("Both 'lora_name' and 'lora_path' must be provided.", 400,
                               "InvalidUserInput")
        inplace = body.get("load_inplace", False)
        if not isinstance(inplace, bool):
            raise RequestError(f"'load_inplace' must be a boolean, got {inplace!r}")
        if not self.llm.config.enable_lora:
            raise RequestError("LoRA is not enabled: serve with --enable-lora to load adapters")
        if name == self.model_name:
            raise RequestError(f"The lora adapter name '{name}' is the served model's name.",
                               400, "InvalidUserInput")
        engine = self.llm.engine
        with self._adapter_lock:
            old = self.lora_modules.get(name)
            if old is not None and not inplace:
                raise RequestError(f"The lora adapter '{name}' has already been loaded. If you "
                                   f"want to load the adapter in place, set 'load_inplace' to "
                                   f"True.", 400, "InvalidUserInput")
            lora = LoRARequest(name, next(self._lora_ids), path)
            self.loop.call(lambda: engine.add_lora(lora))  # ValueError: a 400 with its message
            self.lora_modules = {**self.lora_modules, name: lora}
            if old is not None:
                self.loop.call(lambda: engine.remove_lora(old.lora_int_id))
        log.info("minivllm serve: loaded LoRA adapter %r from %r", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora_adapter(self, body) -> str:
        """POST /v1/unload_lora_adapter {"lora_name"}, as vLLM's: the name leaves /v1/models
        and a request naming it from now on is a 404 (an unknown name here is vLLM's 404).
        Requests already accepted with it, running or waiting, finish with the adapter: each
        sequence holds its weights, and a running one's slot is never given to another adapter
        (engine.remove_lora frees the slot now only where no sequence uses it)."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise RequestError("'lora_name' needs to be provided to unload a LoRA adapter.", 400,
                               "InvalidUserInput")
        engine = self.llm.engine
        with self._adapter_lock:
            lora = self.lora_modules.get(name)
            if lora is None:
                raise RequestError(f"The lora adapter '{name}' cannot be found.", 404,
                                   "NotFoundError")
            self.lora_modules = {k: v for k, v in self.lora_modules.items() if k != name}
            self.loop.call(lambda: engine.remove_lora(lora.lora_int_id))
        log.info("minivllm serve: unloaded LoRA adapter %r", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def dev_route(self, path: str, query: dict[str, list[str]]) -> None:
        """POST /sleep?level=1|2&mode=abort|wait, /wake_up?tags=weights&tags=kv_cache and
        /reset_prefix_cache, as vLLM's (answered with an empty 200). Each runs on the engine's
        thread between steps, as everything that touches the engine does.

        /sleep with vLLM's default mode "abort" aborts the requests running (their clients get
        a 503 naming the sleep; vLLM's get finish_reason "abort" and what was generated) and
        sleeps; "wait" lets them finish, refusing new ones, and sleeps then (the call answers
        once asleep). vLLM's "keep" (frozen requests, resumed on wake_up) and level 0 (a pause
        only) are 400s: this engine's sleep discards the KV cache and it has no pause. While
        anything sleeps, requests for the model are 503s naming /wake_up (vLLM leaves them
        waiting, or fails); /tokenize, /detokenize, /v1/models and /metrics still answer, as
        vLLM's. A sleep of a sleeping engine, or a wake_up of what is awake, does nothing but
        warn (vLLM's). /reset_prefix_cache forgets every cached block, or, while requests
        hold blocks, nothing (LLM.reset_prefix_cache's False, as vLLM's)."""
        def last(name, default):  # a repeated parameter: its last value, as Starlette's get
            return query.get(name, [default])[-1]

        if path == "/reset_prefix_cache":
            if self.loop.call(self.llm.reset_prefix_cache):
                log.info("minivllm serve: prefix cache reset")
            return  # an empty 200 either way, as vLLM's (LLM.reset_prefix_cache warned)
        if not self.llm.config.enable_sleep_mode:
            raise RequestError(f"{path} needs sleep mode: serve with --enable-sleep-mode")
        if path == "/wake_up":
            tags = query.get("tags") or None  # none given: all that sleeps
            try:
                check_tags(tags)
            except ValueError as e:
                raise RequestError(f"query parameter 'tags': {e}") from None
            def wake_up():
                if self.loop.pending_sleep is not None:  # it would sleep right after
                    raise RequestError("a sleep waits for the running requests (mode=wait): "
                                       "wake_up once it answers", 409, "ConflictError")
                self.llm.wake_up(tags)
            self.loop.call(wake_up)
            log.info("minivllm serve: woke up (%s)", ", ".join(tags or ("all",)))
            return
        text, mode = last("level", "1"), last("mode", "abort")
        try:
            spec = self.llm.config.speculative  # level 2 is refused with a draft model
            level = check_level(int(text) if re.fullmatch(r"-?[0-9]+", text.strip()) else text,
                                draft_model=spec is not None and spec.method == "draft_model")
        except ValueError as e:
            raise RequestError(f"query parameter 'level': {e}") from None
        if mode not in ("abort", "wait"):
            raise RequestError(f"query parameter 'mode' must be 'abort' (abort the running "
                               f"requests, vLLM's default) or 'wait' (let them finish), got "
                               f"{mode!r}; vLLM's 'keep' is not served: sleep discards their "
                               f"KV cache")
        self.loop.sleep(level, mode)
        log.info("minivllm serve: asleep (level %d, mode %s)", level, mode)

    @staticmethod
    def _lora_modules(llm: LLM, model_name: str, modules) -> dict[str, LoRARequest]:
        """name -> LoRARequest of serve's LoRA modules (a {name: path} dict, or LoRARequests),
        numbered from 1 in order, each adapter read and checked now (ValueError: before the
        server starts)."""
        if not modules:
            return {}
        if not llm.config.enable_lora:
            raise ValueError("LoRA modules need an LLM with enable_lora=True (--enable-lora)")
        items = list(modules.items()) if isinstance(modules, dict) else \
            [(m.lora_name, m) for m in modules]
        out: dict[str, LoRARequest] = {}
        for k, (name, module) in enumerate(items, start=1):
            lora = module if isinstance(module, LoRARequest) else LoRARequest(name, k, module)
            if name == model_name or name in out:
                raise ValueError(f"LoRA module name {name!r} is taken (by the served model or "
                                 f"another module)")
            llm.engine.check_lora(lora)
            out[name] = lora
        return out

    def serve_forever(self) -> None:
        self.http.serve_forever()

    def shutdown(self) -> None:
        """Stop serving (from another thread than serve_forever's) and stop the engine loop."""
        self.http.shutdown()
        self.http.server_close()
        self.loop.stop()
