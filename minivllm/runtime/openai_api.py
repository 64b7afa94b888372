"""The OpenAI API's requests and responses, as vLLM's server reads and writes them: JSON bodies of
/v1/completions and /v1/chat/completions -> (prompts, SamplingParams), and the engine's
RequestOutputs -> response bodies and stream chunks. Pure functions: no HTTP, no engine
(runtime/server.py serves them).

Sampling fields a request leaves unset take the model's generation_config.json values (vLLM's
server does the same), else vLLM's defaults. vLLM's extra fields (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...) are taken too. A field this
server does not know is an error naming it (vLLM ignores it with a warning; here a typo such as
"max_token" would silently change the request), except the OpenAI fields that ask for nothing a
completion changes ("user", "metadata", ...).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

from .outputs import Logprob, RequestOutput
from .sampling_params import SamplingParams


class RequestError(ValueError):
    """A bad request: the HTTP status and OpenAI's error type to answer it with."""

    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status = status
        self.kind = kind


def error_body(message: str, status: int, kind: str) -> dict:
    """vLLM's error response."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


# OpenAI fields accepted and not acted on: they ask for nothing a completion changes.
_IGNORED = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}

# Sampling fields shared by both endpoints: name -> JSON type.
_SAMPLING = {"n": int, "best_of": int, "temperature": float, "top_p": float, "top_k": int,
             "min_p": float, "presence_penalty": float, "frequency_penalty": float,
             "repetition_penalty": float, "seed": int, "stop": (str, list),
             "stop_token_ids": list, "ignore_eos": bool, "min_tokens": int, "logit_bias": dict,
             "allowed_token_ids": list, "bad_words": list, "skip_special_tokens": bool,
             "spaces_between_special_tokens": bool, "include_stop_str_in_output": bool,
             "truncate_prompt_tokens": int, "max_tokens": int,
             "stream": bool, "stream_options": dict, "model": str}
_COMPLETION = {**_SAMPLING, "prompt": (str, list), "echo": bool, "logprobs": int,
               "suffix": str}
_CHAT = {**_SAMPLING, "messages": list, "max_completion_tokens": int, "logprobs": bool,
         "top_logprobs": int, "add_generation_prompt": bool, "continue_final_message": bool,
         "chat_template": str, "chat_template_kwargs": dict, "tools": list, "tool_choice": (str, dict),
         "response_format": dict, "parallel_tool_calls": bool}
# Fields that take only their default here.
_UNSUPPORTED = {"suffix": None, "tools": [], "tool_choice": "none", "parallel_tool_calls": None}

_JSON_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               list: "an array", dict: "an object"}


def _typed(body: dict, name: str, kind) -> object:
    """body[name] checked against its JSON type (None when absent or null)."""
    value = body.get(name)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for k in kinds:
        if k is bool and isinstance(value, bool):
            return value
        if k is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if k is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if k in (str, list, dict) and isinstance(value, k):
            return value
    names = " or ".join(_JSON_NAMES[k] for k in kinds)
    raise RequestError(f"'{name}' must be {names}, got {value!r:.80}")


def _checked_fields(body, known: dict) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - set(known) - _IGNORED)
    if unknown:
        raise RequestError(f"unknown fields {unknown}")
    values = {name: _typed(body, name, kind) for name, kind in known.items()}
    for name, default in _UNSUPPORTED.items():
        if name in values and values[name] is not None and values[name] != default:
            raise RequestError(f"'{name}' is not supported by this server")
    return values


@dataclass
class ParsedRequest:
    """What a request asks the engine for. prompts: engine prompts (strings or
    {"prompt_token_ids"}) for a completion; None for a chat, whose conversation (`messages`,
    rendered by the tokenizer's chat template with `chat_options`) is its one prompt."""

    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    prompts: list | None = None
    messages: list | None = None
    chat_options: dict = field(default_factory=dict)
    echo: bool = False
    logprobs: int | None = None  # top logprobs a token in the response
    model: str | None = None


def _sampling(values: dict, defaults: dict, *, max_tokens, logprobs, prompt_logprobs) -> SamplingParams:
    n = values["n"] if values["n"] is not None else 1
    if values["best_of"] is not None and values["best_of"] != n:
        raise RequestError("best_of other than n is not supported (nor by vLLM's V1 engine)")
    kwargs = {name: values[name] for name in (
        "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
        "allowed_token_ids", "bad_words", "skip_special_tokens", "spaces_between_special_tokens",
        "include_stop_str_in_output", "truncate_prompt_tokens") if values[name] is not None}
    for name, value in defaults.items():  # the model's generation_config.json
        if name != "max_tokens":
            kwargs.setdefault(name, value)
    if values["logit_bias"] is not None:  # JSON keys are strings
        try:
            kwargs["logit_bias"] = {int(k): v for k, v in values["logit_bias"].items()}
        except ValueError:
            raise RequestError(f"'logit_bias' keys must be token ids, got "
                               f"{sorted(values['logit_bias'])!r:.80}") from None
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens")
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, **kwargs)
    except (ValueError, TypeError) as e:
        raise RequestError(str(e)) from None


def _stream_options(values: dict) -> bool:
    options = values["stream_options"] or {}
    if options and not values["stream"]:
        raise RequestError("'stream_options' needs 'stream': true")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise RequestError(f"unknown stream_options {unknown}")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise RequestError("'stream_options.include_usage' must be true or false")
    return usage


def parse_completion(body, defaults: dict) -> ParsedRequest:
    """A /v1/completions body -> ParsedRequest. defaults: the model's sampling defaults
    (LLM.get_diff_sampling_param())."""
    values = _checked_fields(body, _COMPLETION)
    prompt = values["prompt"]
    if prompt is None:
        raise RequestError("'prompt' is required")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [{"prompt_token_ids": prompt}]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif prompt and all(isinstance(p, list) for p in prompt):
        prompts = [{"prompt_token_ids": p} for p in prompt]
    else:
        raise RequestError("'prompt' must be a string, an array of strings, an array of token "
                           "ids or an array of such arrays, and not empty")
    echo = bool(values["echo"])
    logprobs = values["logprobs"]
    # Echo with logprobs scores the prompt too (vLLM's).
    prompt_logprobs = logprobs if echo and logprobs is not None else None
    max_tokens = values["max_tokens"] if values["max_tokens"] is not None else 16  # OpenAI's
    params = _sampling(values, defaults, max_tokens=max_tokens, logprobs=logprobs,
                       prompt_logprobs=prompt_logprobs)
    return ParsedRequest(params=params, stream=bool(values["stream"]),
                         include_usage=_stream_options(values), prompts=prompts, echo=echo,
                         logprobs=logprobs, model=values["model"])


def _message_text(message, k: int) -> dict:
    if not isinstance(message, dict):
        raise RequestError(f"messages[{k}] must be an object with 'role' and 'content'")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise RequestError(f"messages[{k}].role must be a string")
    if isinstance(content, list):  # OpenAI's content parts: text ones only here
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{k}].content: only text parts are supported")
            parts.append(part["text"])
        content = "\n".join(parts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise RequestError(f"messages[{k}].content must be a string or an array of text parts")
    return {**message, "content": content}


def parse_chat(body, defaults: dict) -> ParsedRequest:
    """A /v1/chat/completions body -> ParsedRequest (see parse_completion)."""
    values = _checked_fields(body, _CHAT)
    messages = values["messages"]
    if not messages:
        raise RequestError("'messages' is required and must not be empty")
    messages = [_message_text(m, k) for k, m in enumerate(messages)]
    fmt = values["response_format"]
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError("'response_format' other than {'type': 'text'} is not supported")
    top = values["top_logprobs"]
    if top is not None and not values["logprobs"]:
        raise RequestError("'top_logprobs' needs 'logprobs': true")
    logprobs = (top or 0) if values["logprobs"] else None
    if values["max_tokens"] is not None and values["max_completion_tokens"] is not None:
        raise RequestError("give 'max_tokens' or 'max_completion_tokens', not both")
    max_tokens = values["max_completion_tokens"] or values["max_tokens"]
    add_generation_prompt = values["add_generation_prompt"]
    if add_generation_prompt is None:
        add_generation_prompt = True
    if values["continue_final_message"] and add_generation_prompt:
        raise RequestError("'continue_final_message' needs 'add_generation_prompt': false")
    params = _sampling(values, defaults, max_tokens=max_tokens, logprobs=logprobs,
                       prompt_logprobs=None)
    options = dict(chat_template=values["chat_template"],
                   add_generation_prompt=add_generation_prompt,
                   continue_final_message=bool(values["continue_final_message"]),
                   chat_template_kwargs=values["chat_template_kwargs"] or {})
    return ParsedRequest(params=params, stream=bool(values["stream"]),
                         include_usage=_stream_options(values), messages=messages,
                         chat_options=options, logprobs=logprobs, model=values["model"])


# -- responses ---------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def _finite(x: float) -> float:
    """JSON has no -inf: vLLM writes -9999.0 for an impossible token."""
    return max(x, -9999.0) if not math.isnan(x) else -9999.0


def _token_text(token_id: int, lp: Logprob) -> str:
    # Without a tokenizer (or detokenize off) the id stands in, as vLLM's "token_id:N".
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def completion_logprobs(token_ids: list[int], entries: list, top: int, offset: int) -> dict:
    """OpenAI's completion logprobs for tokens and their logprob entries ({id: Logprob}, None for
    a first prompt token): tokens, token_logprobs, top_logprobs, text_offset (from `offset`)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        out["text_offset"].append(offset)
        if entry is None:
            out["tokens"].append(None)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        lp = entry[token_id]
        text = _token_text(token_id, lp)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(lp.logprob))
        ranked = sorted((e for e in entry.items() if e[1].rank is not None and e[1].rank <= top),
                        key=lambda e: e[1].rank)
        best = {_token_text(i, v): _finite(v.logprob) for i, v in ranked}
        best.setdefault(text, _finite(lp.logprob))  # the sampled token too (vLLM's)
        out["top_logprobs"].append(best)
        offset += len(text)
    return out


def chat_logprobs(token_ids: list[int], entries: list, top: int) -> dict:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        lp = entry[token_id]
        text = _token_text(token_id, lp)
        ranked = sorted((e for e in entry.items() if e[1].rank is not None and e[1].rank <= top),
                        key=lambda e: e[1].rank)
        content.append({"token": text, "logprob": _finite(lp.logprob),
                        "bytes": list(text.encode("utf-8", errors="replace")),
                        "top_logprobs": [{"token": _token_text(i, v), "logprob": _finite(v.logprob),
                                          "bytes": list(_token_text(i, v).encode("utf-8", errors="replace"))}
                                         for i, v in ranked]})
    return {"content": content}


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _prompt_text(out: RequestOutput, decode) -> str:
    if out.prompt is not None:
        return out.prompt
    return decode(out.prompt_token_ids) if decode is not None else ""


def _always(request_id: str, index: int) -> bool:
    return True


def completion_choices(outs: list[RequestOutput], req: ParsedRequest, decode, *,
                       first=_always) -> list[dict]:
    """Choices of a completion response (or of one stream chunk, the outputs being deltas):
    index = prompt's index * n + completion's index. first(request_id, index): whether this is
    the completion's first chunk (echo puts the prompt there)."""
    choices = []
    n = req.params.n
    for k, out in enumerate(outs):
        for c in out.outputs:
            text, token_ids, entries = c.text, list(c.token_ids), c.logprobs
            if req.echo and first(out.request_id, c.index):
                prompt = _prompt_text(out, decode)
                text = prompt + text
                if req.logprobs is not None:
                    token_ids = list(out.prompt_token_ids) + token_ids
                    entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + \
                        list(entries or [])
            lps = None
            if req.logprobs is not None and entries is not None:
                lps = completion_logprobs(token_ids, entries, req.logprobs, 0)
            choices.append({"index": k * n + c.index, "text": text, "logprobs": lps,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return choices


def completion_body(request_id: str, created: int, model: str, choices: list[dict],
                    usage_: dict | None, *, chunk: bool = False) -> dict:
    body = {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def chat_choices(out: RequestOutput, req: ParsedRequest, *, delta: bool, first=_always) -> list[dict]:
    """Choices of a chat response, or of one stream chunk (delta: the outputs are deltas, and a
    completion's first, by first(request_id, index), names the role)."""
    choices = []
    for c in out.outputs:
        lps = (chat_logprobs(list(c.token_ids), c.logprobs, req.logprobs)
               if req.logprobs is not None and c.logprobs is not None else None)
        if delta:
            message = ({"role": "assistant", "content": c.text} if first(out.request_id, c.index)
                       else {"content": c.text})
            choices.append({"index": c.index, "delta": message, "logprobs": lps,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        else:
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": lps, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
    return choices


def chat_body(request_id: str, created: int, model: str, choices: list[dict],
              usage_: dict | None, *, chunk: bool = False) -> dict:
    body = {"id": request_id, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": created, "model": model, "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body
