"""The OpenAI API's requests and responses, as vLLM's server reads and writes them: JSON bodies of
/v1/completions and /v1/chat/completions -> (prompts, SamplingParams), and the engine's
RequestOutputs -> response bodies and stream chunks. Pure functions: no HTTP, no engine
(runtime/server.py serves them).

Sampling fields a request leaves unset take the model's generation_config.json values (vLLM's
server does the same), else vLLM's defaults. vLLM's extra fields (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, prompt_logprobs, ...) are taken too.
A field this server does not know is an error naming it (vLLM ignores it with a warning; here a
typo such as "max_token" would silently change the request), except the OpenAI fields that ask
for nothing a completion changes ("user", "metadata", ...). With --enable-prompt-embeds a
completion takes vLLM's prompt_embeds (base64 torch.save'd tensors, decode_prompt_embeds).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import math
import struct
import time
import uuid
import zipfile
from dataclasses import dataclass, field

import torch

from . import tool_calls
from .chat_messages import chat_message
from .chat_output import ChatOutput, message
from .outputs import Logprob, RequestOutput
from .pooling import PoolingParams
from .reasoning import ThinkTags
from .sampling_params import SamplingParams, StructuredOutputsParams
from .sequence import check_cache_salt


class RequestError(ValueError):
    """A bad request: the HTTP status and OpenAI's error type to answer it with."""

    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError",
                 param: str | None = None):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param  # the field at fault, where vLLM's error names one


def error_body(message: str, status: int, kind: str, param: str | None = None) -> dict:
    """OpenAI's (and vLLM's) error body; the openai client raises on it, mid-stream too."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# OpenAI fields accepted and not acted on: they ask for nothing a completion changes.
_IGNORED = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}

# Fields shared by both endpoints: name -> JSON type.
_COMMON = {"n": int, "best_of": int, "temperature": float, "top_p": float, "top_k": int,
           "min_p": float, "presence_penalty": float, "frequency_penalty": float,
           "repetition_penalty": float, "seed": int, "stop": (str, list),
           "stop_token_ids": list, "ignore_eos": bool, "min_tokens": int, "logit_bias": dict,
           "allowed_token_ids": list, "bad_words": list, "skip_special_tokens": bool,
           "spaces_between_special_tokens": bool, "include_stop_str_in_output": bool,
           "truncate_prompt_tokens": int, "max_tokens": int, "prompt_logprobs": int,
           "stream": bool, "stream_options": dict, "model": str, "structured_outputs": dict,
           "guided_choice": list, "guided_regex": str, "guided_json": (dict, str),
           "guided_grammar": str, "response_format": dict, "priority": int, "use_beam_search": bool,
           "length_penalty": float, "return_tokens_as_token_ids": bool, "request_id": str,
           "cache_salt": str, "thinking_token_budget": int}
_COMPLETION = {**_COMMON, "prompt": (str, list), "echo": bool, "logprobs": int, "suffix": str,
               "prompt_embeds": (str, list), "add_special_tokens": bool}
_CHAT = {**_COMMON, "messages": list, "max_completion_tokens": int, "logprobs": bool,
         "top_logprobs": int, "add_generation_prompt": bool, "continue_final_message": bool,
         "chat_template": str, "chat_template_kwargs": dict, "tools": list,
         "tool_choice": (str, dict), "include_reasoning": bool, "parallel_tool_calls": bool,
         "echo": bool}
# Fields that take only their default here (vLLM's extra fields among them: a client that
# sends their defaults, as some send every field, is served).
_UNSUPPORTED = {"suffix": None, "use_beam_search": False, "length_penalty": 1.0,
                "return_tokens_as_token_ids": False}

_JSON_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               list: "an array", dict: "an object"}
_INT64 = 1 << 63


def _typed(body: dict, name: str, kind) -> object:
    """body[name] checked against its JSON type (None when absent or null). An integer field
    takes an integral number (16.0), as vLLM's pydantic models do."""
    value = body.get(name)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for k in kinds:
        if isinstance(value, bool):  # JSON's true is not the number 1
            if k is bool:
                return value
        elif k is int:
            if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
                if not -_INT64 <= value < _INT64:
                    raise RequestError(f"'{name}' must fit in 64 bits, got {value!r:.40}")
                return int(value)
        elif k is float:
            if isinstance(value, (int, float)):
                try:
                    return float(value)
                except OverflowError:
                    raise RequestError(f"'{name}' is too large: {value!r:.40}") from None
        elif isinstance(value, k):
            return value
    names = " or ".join(_JSON_NAMES[k] for k in kinds)
    raise RequestError(f"'{name}' must be {names}, got {value!r:.80}")


def _lone_surrogate(body) -> str | None:
    """Where the body holds a string with a lone surrogate (JSON's "\\ud800" escape without its
    pair: no text, which the tokenizer refuses with a message naming neither), e.g.
    "messages[0].content"; None if nowhere. A walk, not recursion: bodies nest ~1,000 deep."""
    try:  # the common case at the C encoder's speed
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        return None
    except (UnicodeEncodeError, RecursionError):
        pass
    stack = [(body, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where or "the body"
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, where or "the body"))  # a key: the object holding it
                stack.append((item, f"{where}.{key}" if where else key))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{k}]") for k, item in enumerate(value))
    return None


def _checked_fields(body, known: dict) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    bad = _lone_surrogate(body)
    if bad is not None:  # vLLM's pydantic refuses it too (not a valid string)
        raise RequestError(f"'{bad}' is not valid Unicode text: it holds a lone surrogate (a "
                           f"\\uD800-\\uDFFF escape without its pair)")
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
    rendered by the tokenizer's chat template with `chat_options`) is its one prompt.
    logprobs: top logprobs a token in the response (-1: all the engine gives); echo_only: echo
    with max_tokens 0 (the prompt scored, nothing generated in the response).
    request_id: the id a response carries after its prefix ("chatcmpl-{request_id}"), vLLM's
    field or X-Request-Id header; None: a new one. It names the response only: the engine's
    own ids stay unique, so two requests may give the same one."""

    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    prompts: list | None = None
    messages: list | None = None
    chat_options: dict = field(default_factory=dict)
    echo: bool = False
    echo_only: bool = False
    logprobs: int | None = None
    # The response carries them (vLLM's prompt_logprobs field; a stream's chunks never do).
    prompt_logprobs: bool = False
    model: str | None = None
    tool_mode: str = "none"  # tool_calls.check_tool_choice's
    include_reasoning: bool = True
    parallel_tool_calls: bool = True
    encoding_format: str = "float"  # an embedding request's
    priority: int = 0  # lower first, under the "priority" scheduling policy
    # A completion, embedding or classification request's: False tokenizes its texts without
    # the tokenizer's special tokens (vLLM's field; token ids are taken as given).
    add_special_tokens: bool = True
    # A /score or /rerank request's (data_1, data_2) (LLM.score's forms: texts or lists of
    # them); its prompts are the pairs LLM.score_plan makes of them.
    score_inputs: tuple | None = None
    top_n: int = 0  # a /rerank request's: the best top_n results (0: all)
    # The LoRA adapter its "model" names (serve --lora-modules), or None: the base model.
    lora_request: object = None
    request_id: str | None = None
    # A chat response's role, vLLM's: the assistant's, or without add_generation_prompt the
    # last message's; chat_echo: with echo, the last message's content where it has that role,
    # which the response's content starts with (vLLM's echo).
    role: str = "assistant"
    chat_echo: str = ""
    # The output tokens the request itself asks for, as vLLM's server checks them against the
    # context (its TokenizeParams' max_output_tokens), and the field that gave them: a chat's
    # max_completion_tokens or max_tokens (None: neither), a completion's max_tokens (OpenAI's
    # 16 when not given, None when null; 0 for echo_only). params.max_tokens may instead hold
    # the server's default (generation_config's max_new_tokens): that one is lowered to the
    # room left.
    max_tokens_asked: int | None = None
    max_tokens_field: str = "max_tokens"
    # vLLM's cache_salt: every prompt of the request salts its prefix-cache blocks with it
    # (shared only with requests of the same salt); None: unsalted.
    cache_salt: str | None = None


def _cache_salt(values: dict) -> str | None:
    """A completion or chat request's cache_salt: a non-empty string, or null / absent (vLLM's
    check_cache_salt_support, in its words)."""
    try:
        return check_cache_salt(values["cache_salt"])
    except (TypeError, ValueError) as e:
        raise RequestError(str(e)) from None


def _structured(values: dict, tool_schema: dict | None = None) -> StructuredOutputsParams | None:
    """The request's constraint: vLLM's structured_outputs object, its older guided_choice /
    guided_regex / guided_json / guided_grammar, OpenAI's response_format json_schema or
    json_object, or the JSON a tool_choice of "required" or a named function asks for; at most
    one."""
    given = {}
    if tool_schema is not None:
        given["tool_choice"] = {"json": tool_schema}
    if values["structured_outputs"] is not None:
        given["structured_outputs"] = values["structured_outputs"]
    for name, key in (("guided_choice", "choice"), ("guided_regex", "regex"),
                      ("guided_json", "json"), ("guided_grammar", "grammar")):
        if values[name] is not None:
            given[name] = {key: values[name]}
    fmt = values["response_format"]
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise RequestError("'response_format' json_schema needs {'json_schema': "
                                   "{'schema': {...}}}")
            given["response_format"] = {"json": spec["schema"]}
        elif kind == "json_object":
            given["response_format"] = {"json_object": True}
        elif kind != "text":
            raise RequestError(f"'response_format' {kind!r} is not supported ('text', "
                               f"'json_object' and 'json_schema' are)")
    if not given:
        return None
    if len(given) > 1:
        raise RequestError(f"give one constraint, got {sorted(given)}")
    (name, spec), = given.items()
    try:
        return StructuredOutputsParams(**spec)
    except TypeError:
        raise RequestError(f"'{name}' takes choice, regex, json or json_object, or grammar, "
                           f"got {sorted(spec)}") from None
    except ValueError as e:
        raise RequestError(str(e)) from None


def _sampling(values: dict, defaults: dict, *, max_tokens, logprobs, prompt_logprobs,
              tool_schema: dict | None = None) -> SamplingParams:
    n = values["n"] if values["n"] is not None else 1
    if values["best_of"] is not None and values["best_of"] != n:
        raise RequestError("best_of other than n is not supported (nor by vLLM's V1 engine)")
    kwargs = {name: values[name] for name in (
        "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
        "allowed_token_ids", "bad_words", "skip_special_tokens", "spaces_between_special_tokens",
        "include_stop_str_in_output", "truncate_prompt_tokens", "thinking_token_budget")
        if values[name] is not None}
    for name, value in defaults.items():  # the model's generation_config.json
        if name != "max_tokens":
            kwargs.setdefault(name, value)
    if values["logit_bias"] is not None:  # JSON keys are strings
        try:
            kwargs["logit_bias"] = {int(k): _clamp_bias(v)
                                    for k, v in values["logit_bias"].items()}
        except ValueError:
            raise RequestError(f"'logit_bias' keys must be token ids, got "
                               f"{sorted(values['logit_bias'])!r:.80}") from None
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens")
    kwargs["structured_outputs"] = _structured(values, tool_schema)
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, **kwargs)
    except (ValueError, TypeError) as e:
        raise RequestError(str(e)) from None


def _clamp_bias(bias):
    """A request's logit bias within [-100, 100], as vLLM's server (SamplingParams.from_optional)
    and OpenAI's range; what is no number is left for SamplingParams to refuse."""
    if isinstance(bias, (int, float)) and not isinstance(bias, bool):
        return min(100.0, max(-100.0, bias))
    return bias


def _stream_options(values: dict) -> tuple[bool, bool]:
    """(include_usage, continuous usage): include_usage true when stream_options is given;
    usage on each chunk only with include_usage too (vLLM's should_include_usage: a stream
    asking for no usage gets none, continuous_usage_stats or not). An empty stream_options is
    taken without a stream too (vLLM's validate_stream_options refuses only a non-empty one)."""
    options = values["stream_options"]
    if options is None or not options and not values["stream"]:
        return False, False
    if not values["stream"]:
        raise RequestError("'stream_options' needs 'stream': true")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise RequestError(f"unknown stream_options {unknown}")
    flags = []
    for key, default in (("include_usage", True), ("continuous_usage_stats", False)):
        value = options.get(key, default)
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"'stream_options.{key}' must be true or false")
        flags.append(bool(value))
    return flags[0], flags[0] and flags[1]


def _prompt_logprobs(values: dict) -> int | None:
    """The request's prompt_logprobs. As vLLM's check_logprobs: a stream refuses any that
    returns alternatives (> 0, or -1 for all); 0 (each prompt token's own logprob) streams,
    its stream chunks carrying no prompt_logprobs field."""
    n = values["prompt_logprobs"]
    if n is not None and values["stream"] and (n > 0 or n == -1):
        raise RequestError("'prompt_logprobs' is not available with 'stream': true (as vLLM)")
    return n


@dataclass(frozen=True)
class EmbedsLimits:
    """What a completion's prompt_embeds must fit (serve --enable-prompt-embeds): the model's
    hidden_size and max_model_len (rows; the engine refuses a prompt of that many, but the
    bound on the bytes decoded is taken from it)."""

    hidden_size: int
    max_model_len: int

    @property
    def max_bytes(self) -> int:
        """The largest torch.save payload taken: max_model_len fp32 rows and the archive's own
        records (a few KiB: data.pkl, version, byteorder, alignment padding)."""
        return self.max_model_len * self.hidden_size * 4 + (64 << 10)


# vLLM's accepted dtypes for prompt_embeds (its loader asserts these three).
_EMBEDS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def decode_prompt_embeds(data, name: str, limits: EmbedsLimits) -> torch.Tensor:
    """One base64 string of a torch.save'd tensor [T, hidden_size] -> the tensor on the host,
    or a RequestError naming the problem. Safe on untrusted bytes: the size is bounded before
    decoding, the archive must hold only stored (uncompressed) records, so its bytes bound what
    loading allocates (no zip bomb), and torch.load runs with weights_only=True (no pickled
    code) onto the CPU (a tensor saved from a GPU is not put back there)."""
    if not isinstance(data, str):
        raise RequestError(f"'{name}' must be a base64 string of a torch.save'd tensor, got "
                           f"{type(data).__name__}")
    if len(data) > 4 * (limits.max_bytes // 3 + 1):  # before decoding: base64 is 4/3 the bytes
        raise RequestError(f"'{name}' is too large: {len(data)} base64 characters; at most "
                           f"max_model_len={limits.max_model_len} rows of "
                           f"hidden_size={limits.hidden_size} fp32 are taken")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"'{name}' is not valid base64") from None
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError):
        raise RequestError(f"'{name}' is not a torch.save file (a zip archive)") from None
    if any(r.compress_type != zipfile.ZIP_STORED for r in records) or \
            sum(r.file_size for r in records) > limits.max_bytes:
        raise RequestError(f"'{name}' holds compressed or oversized records (torch.save writes "
                           f"them stored)")
    try:
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as e:  # the unpickler's refusals and a corrupt archive alike
        raise RequestError(f"'{name}' could not be loaded with torch.load(weights_only=True): "
                           f"{type(e).__name__}: {str(e)[:200]}") from None
    if type(tensor) is not torch.Tensor:  # not a Parameter nor a dict / list of tensors
        raise RequestError(f"'{name}' must hold a single tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise RequestError(f"'{name}' must be a dense tensor, got layout {tensor.layout}")
    if tensor.dtype not in _EMBEDS_DTYPES:
        raise RequestError(f"'{name}' must be float32, float16 or bfloat16, got {tensor.dtype}")
    if tensor.ndim != 2 or tensor.shape[1] != limits.hidden_size:
        raise RequestError(f"'{name}' must be [tokens, hidden_size={limits.hidden_size}], got "
                           f"shape {list(tensor.shape)}")
    return tensor


def _embeds_prompts(value, limits: EmbedsLimits) -> list[dict]:
    """A request's prompt_embeds (a base64 string, or a list of them) -> {"prompt_embeds"}
    prompts, in order."""
    if isinstance(value, str):
        return [{"prompt_embeds": decode_prompt_embeds(value, "prompt_embeds", limits)}]
    if not value:
        raise RequestError("'prompt_embeds' must be a base64 string or a non-empty array of them")
    return [{"prompt_embeds": decode_prompt_embeds(v, f"prompt_embeds[{k}]", limits)}
            for k, v in enumerate(value)]


def parse_completion(body, defaults: dict, embeds: EmbedsLimits | None = None) -> ParsedRequest:
    """A /v1/completions body -> ParsedRequest. defaults: the model's sampling defaults
    (LLM.get_diff_sampling_param()); embeds: what prompt_embeds must fit, None where they are
    not taken (no --enable-prompt-embeds).

    As vLLM's: a request gives 'prompt', 'prompt_embeds' or both (the embeddings' prompts come
    first, then the text's); echo and prompt_logprobs are refused with embeddings (no prompt
    ids to return or score)."""
    values = _checked_fields(body, _COMPLETION)
    cache_salt = _cache_salt(values)
    prompts = []
    if values["prompt_embeds"] is not None:
        if embeds is None:  # vLLM's words
            raise RequestError("You must set `--enable-prompt-embeds` to input "
                               "`prompt_embeds`.")
        if values["echo"]:
            raise RequestError("Echo is unsupported with prompt embeds.")
        if values["prompt_logprobs"] is not None:
            raise RequestError("prompt_logprobs is not compatible with prompt embeds.")
        prompts = _embeds_prompts(values["prompt_embeds"], embeds)
    if values["prompt"] is not None and values["prompt"] != "" or not prompts:
        if values["prompt"] is None:
            raise RequestError("'prompt' is required (or 'prompt_embeds' with "
                               "--enable-prompt-embeds)")
        prompts += _prompts(values["prompt"], "prompt")
    echo = bool(values["echo"])
    logprobs = values["logprobs"]
    # vLLM's CompletionRequest: absent is OpenAI's 16; null is None, which the server gives
    # the room the prompt leaves (or generation_config's max_new_tokens if less: fit_context).
    max_tokens = 16 if "max_tokens" not in body else values["max_tokens"]
    # Echo with max_tokens 0 scores the prompt alone (log-likelihood clients): one token is
    # generated and left out of the response, as vLLM does.
    echo_only = echo and max_tokens == 0
    if echo_only:
        max_tokens = 1
    # Echo scores the prompt with `logprobs` alternatives unless prompt_logprobs is given:
    # vLLM's CompletionRequest.to_sampling_params.
    scored = _prompt_logprobs(values)
    prompt_logprobs = logprobs if scored is None and echo else scored
    params = _sampling(values, defaults, max_tokens=max_tokens, logprobs=logprobs,
                       prompt_logprobs=prompt_logprobs)
    include_usage, continuous = _stream_options(values)
    return ParsedRequest(params=params, stream=bool(values["stream"]),
                         include_usage=include_usage, continuous_usage=continuous,
                         prompts=prompts, echo=echo, echo_only=echo_only, logprobs=logprobs,
                         prompt_logprobs=scored is not None and not values["stream"],
                         model=values["model"] or None,
                         priority=values["priority"] or 0,
                         add_special_tokens=values["add_special_tokens"] is not False,
                         request_id=values["request_id"],
                         max_tokens_asked=0 if echo_only else max_tokens, cache_salt=cache_salt)


def _message_text(message, k: int) -> dict:
    """messages[k] as the chat template reads it (chat_messages.chat_message, vLLM's parser);
    its errors a 400."""
    try:
        return chat_message(message, f"messages[{k}]")
    except (ValueError, TypeError) as e:
        raise RequestError(str(e)) from None


def _chat_options(values: dict) -> dict:
    """How a request's messages go through the chat template (render_chat's options)."""
    add_generation_prompt = values["add_generation_prompt"]
    return dict(chat_template=values["chat_template"],
                add_generation_prompt=True if add_generation_prompt is None else add_generation_prompt,
                continue_final_message=bool(values["continue_final_message"]),
                chat_template_kwargs=values["chat_template_kwargs"] or {},
                tools=values["tools"])


def _check_generation_prompt(values: dict) -> None:
    """vLLM's refusals of continue_final_message with add_generation_prompt: its request
    validator's when both are given true; transformers' (which vLLM answers 400) when
    add_generation_prompt is left to its default, true."""
    if not values["continue_final_message"]:
        return
    if values["add_generation_prompt"]:
        raise RequestError("Cannot set both `continue_final_message` and "
                           "`add_generation_prompt` to True.")
    if values["add_generation_prompt"] is None:
        raise RequestError("continue_final_message and add_generation_prompt are not "
                           "compatible: add_generation_prompt defaults to true, so "
                           "'continue_final_message' needs 'add_generation_prompt': false")


def parse_chat(body, defaults: dict) -> ParsedRequest:
    """A /v1/chat/completions body -> ParsedRequest (see parse_completion)."""
    values = _checked_fields(body, _CHAT)
    cache_salt = _cache_salt(values)
    messages = values["messages"]
    if not messages:
        raise RequestError("'messages' is required and must not be empty")
    messages = [_message_text(m, k) for k, m in enumerate(messages)]
    choice = values["tool_choice"]
    if values["tools"] == [] and choice in ("auto", "required"):
        # vLLM serves an empty tools list as none: "required" becomes "none", and "auto" reads
        # no calls (its parser runs only where the request has tools).
        choice = "none"
    try:
        tools = tool_calls.check_tools(values["tools"]) if values["tools"] is not None else None
        tool_mode = tool_calls.check_tool_choice(choice, tools)
    except ValueError as e:
        raise RequestError(str(e)) from None
    if tool_mode == "auto":
        # Some tokenizers mark <tool_call> special: its text must stay (vLLM's parsers read it).
        values = {**values, "skip_special_tokens": False}
    top = values["top_logprobs"]
    if top and not values["logprobs"]:  # 0 without logprobs asks for nothing (as vLLM)
        raise RequestError("'top_logprobs' needs 'logprobs': true")
    logprobs = (top or 0) if values["logprobs"] else None
    # As vLLM: max_completion_tokens, OpenAI's newer name, wins.
    max_tokens, max_tokens_field = values["max_completion_tokens"], "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_tokens_field = values["max_tokens"], "max_tokens"
    _check_generation_prompt(values)
    options = _chat_options(values)
    # vLLM's response role, and its echo of the last message where that has the role.
    last = messages[-1]
    role = "assistant" if options["add_generation_prompt"] else last["role"]
    echo = last["content"] if values["echo"] and last["role"] == role else ""
    scored = _prompt_logprobs(values)
    params = _sampling(values, defaults, max_tokens=max_tokens, logprobs=logprobs,
                       prompt_logprobs=scored,
                       tool_schema=tool_calls.choice_schema(tool_mode, tools or []))
    include_usage, continuous = _stream_options(values)
    include_reasoning, parallel = values["include_reasoning"], values["parallel_tool_calls"]
    return ParsedRequest(params=params, stream=bool(values["stream"]),
                         include_usage=include_usage, continuous_usage=continuous,
                         messages=messages, chat_options=options, logprobs=logprobs,
                         prompt_logprobs=scored is not None and not values["stream"],
                         model=values["model"] or None,
                         tool_mode=tool_mode,
                         include_reasoning=True if include_reasoning is None else include_reasoning,
                         parallel_tool_calls=True if parallel is None else parallel,
                         priority=values["priority"] or 0, request_id=values["request_id"],
                         role=role, chat_echo=echo, max_tokens_asked=max_tokens,
                         max_tokens_field=max_tokens_field, cache_salt=cache_salt)


# -- the context: prompt + max_tokens within max_model_len (vLLM's server) ---------------------


def context_params(params: SamplingParams, asked: int | None, field_name: str,
                   max_model_len: int) -> SamplingParams:
    """Before the prompt is tokenized, vLLM's TokenizeParams (renderers/params.py) for a
    request asking for `asked` output tokens in `field_name`: more than max_model_len is a 400,
    and so is a truncate_prompt_tokens past the room they leave; -1 keeps the last
    max_model_len - asked prompt tokens (vLLM's max_input_tokens), not max_model_len, so that
    a truncated prompt fits with them."""
    if not asked:  # vLLM's `max_output_tokens=max_tokens or 0`: nothing to reserve
        return params
    if asked > max_model_len:
        raise RequestError(f"{field_name}={asked} cannot be greater than max_model_len="
                           f"{max_model_len}. Please request fewer output tokens. "
                           f"(parameter={field_name}, value={asked})", param=field_name)
    room = max_model_len - asked
    keep = params.truncate_prompt_tokens
    if keep == -1 and room >= 1:  # room 0: no prompt fits, and the engine refuses this one
        return dataclasses.replace(params, truncate_prompt_tokens=room)
    if keep is not None and keep > room:
        raise RequestError(f"truncate_prompt_tokens={keep} cannot be greater than "
                           f"max_model_len - {field_name} = {room}. Please request a smaller "
                           f"truncation size. (parameter=truncate_prompt_tokens, value={keep})",
                           param="truncate_prompt_tokens")
    return params


def check_room(prompt_len: int, asked: int | None, max_model_len: int) -> None:
    """A 400 with vLLM's words unless a prompt of prompt_len tokens (after truncation) leaves
    room for the output tokens the request asks for: past the room, TokenizeParams.
    _token_len_check's (renderers/params.py); asking for none (a null or absent max_tokens, a
    chat's default) with a prompt that fills the context, OpenAIServing._validate_input's
    (entrypoints/openai/engine/serving.py: the prompt must leave room for one token)."""
    if asked and asked > max_model_len - prompt_len:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens. "
                           f"However, you requested {asked} output tokens and your prompt "
                           f"contains {prompt_len} input tokens, for a total of "
                           f"{prompt_len + asked} tokens. Please reduce the length of the "
                           f"input prompt or the number of requested output tokens. "
                           f"(parameter=input_tokens, value={prompt_len})",
                           param="input_tokens")
    if prompt_len >= max_model_len:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens. "
                           f"However, your request has {prompt_len} input tokens. Please reduce "
                           f"the length of the input messages. (parameter=input_tokens, "
                           f"value={prompt_len})", param="input_tokens")


def fit_context(params: SamplingParams, asked: int | None, prompt_len: int,
                max_model_len: int, override_max_tokens: int | None = None) -> SamplingParams:
    """params for a prompt of prompt_len tokens (after truncation), as vLLM's server: output
    tokens the request asks for past the room the prompt leaves are a 400 (check_room), never
    quietly fewer; max_tokens is then vLLM's get_max_tokens, the least of the room, the tokens
    asked for (else the server's default, else none) and override_max_tokens (serve
    --override-generation-config's max_new_tokens, which lowers even a max_tokens asked for:
    generation_config.override_max_tokens), so that vllm:request_params_max_tokens observes
    what can be generated."""
    check_room(prompt_len, asked, max_model_len)
    wanted = asked or params.max_tokens  # echo_only asks 0 and generates the 1 it holds
    limit = min(n for n in (max_model_len - prompt_len, wanted, override_max_tokens)
                if n is not None)
    if limit != params.max_tokens:
        return dataclasses.replace(params, max_tokens=limit)
    return params


# -- responses ---------------------------------------------------------------------------------


def new_id(prefix: str, base: str | None = None) -> str:
    """A response's id: the request's own (vLLM's request_id) after the prefix, else a new one."""
    return f"{prefix}-{base or uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def _finite(x: float) -> float:
    """JSON has no -inf: vLLM writes -9999.0 for an impossible token."""
    return max(x, -9999.0) if not math.isnan(x) else -9999.0


def _token_text(token_id: int, lp: Logprob | None, decode=None) -> str:
    """A token's text: its logprob entry's, else decoded, else vLLM's "token_id:N"."""
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    if decode is not None:
        return decode([token_id])
    return f"token_id:{token_id}"


def _top(entry: dict, top: int) -> list[tuple[int, Logprob]]:
    """The entry's top `top` ids by rank (-1: all it holds)."""
    ranked = sorted((e for e in entry.items() if e[1].rank is not None), key=lambda e: e[1].rank)
    return ranked if top == -1 else [e for e in ranked if e[1].rank <= top]


def completion_logprobs(token_ids: list[int], entries: list, top: int, offset: int,
                        decode=None) -> dict:
    """OpenAI's completion logprobs for tokens and their logprob entries ({id: Logprob}; None for
    a first prompt token, which has no logprob): tokens, token_logprobs, top_logprobs (the top
    `top` and the token itself), text_offset (each token's start, from `offset`)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        lp = entry[token_id] if entry is not None else None
        text = _token_text(token_id, lp, decode)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(lp.logprob))
        best = {_token_text(i, v): _finite(v.logprob) for i, v in _top(entry, top)}
        best.setdefault(text, _finite(lp.logprob))  # the sampled token too (vLLM's)
        out["top_logprobs"].append(best)
    return out


def chat_logprobs(token_ids: list[int], entries: list, top: int) -> dict:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}, the top
    `top` ids by rank (-1: all the entry holds)."""
    def item(token_id, lp):
        text = _token_text(token_id, lp)
        return {"token": text, "logprob": _finite(lp.logprob),
                "bytes": list(text.encode("utf-8", errors="replace"))}

    return {"content": [{**item(t, entry[t]),
                         "top_logprobs": [item(i, v) for i, v in _top(entry, top)]}
                        for t, entry in zip(token_ids, entries)]}


def vllm_prompt_logprobs(entries) -> list | None:
    """vLLM's prompt_logprobs field: per prompt token None or {id: {logprob, rank,
    decoded_token}} (ids as JSON keys)."""
    if entries is None:
        return None
    return [None if e is None else
            {str(i): {"logprob": _finite(v.logprob), "rank": v.rank,
                      "decoded_token": v.decoded_token} for i, v in e.items()}
            for e in entries]


def usage(outs: list[RequestOutput], req: ParsedRequest | None = None,
          prompt_lens: dict[str, int] | None = None, cached: bool = False,
          reasoning: int | None = None) -> dict:
    """OpenAI's usage; prompt_lens: request id -> its prompt's tokens, for the outputs of
    prompts given as embeddings (whose prompt_token_ids are None: T rows are T tokens).
    cached: with prompt_tokens_details {"cached_tokens"}, the prompt tokens found in the prefix
    cache (vLLM's --enable-prompt-tokens-details). reasoning: a chat's reasoning tokens, every
    choice's (reasoning_tokens), None without a reasoning parser."""
    prompt = sum(len(o.prompt_token_ids) if o.prompt_token_ids is not None
                 else prompt_lens[o.request_id] for o in outs)
    completion = 0 if req is not None and req.echo_only else \
        sum(len(c.token_ids) for o in outs for c in o.outputs)
    counts = token_usage(prompt, completion, reasoning)
    if cached:
        counts["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens
                                                                for o in outs)}
    return counts


def token_usage(prompt: int, completion: int, reasoning: int | None = None) -> dict:
    """OpenAI's usage of `prompt` prompt tokens and `completion` generated ones (a stream's
    continuous usage: one choice's so far, with its own prompt's, as vLLM's). reasoning: how
    many of those generated are reasoning, as completion_tokens_details {"reasoning_tokens"}:
    vLLM's chat gives it wherever its server has a reasoning parser (0 where none came), and
    only there."""
    counts = {"prompt_tokens": prompt, "completion_tokens": completion,
              "total_tokens": prompt + completion}
    if reasoning is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return counts


def reasoning_tokens(parsers, reasoning_parser: bool) -> int | None:
    """The reasoning tokens of a chat's choices (their ChatOutputs), summed as vLLM's usage does
    for n > 1; None without a reasoning parser (the key is then absent, as vLLM's)."""
    if not reasoning_parser:
        return None
    return sum(p.reasoning_tokens or 0 for p in parsers)


def _prompt_text(out: RequestOutput, decode) -> str:
    if out.prompt is not None:
        return out.prompt
    return decode(out.prompt_token_ids) if decode is not None else ""


def completion_choice(out: RequestOutput, c, req: ParsedRequest, decode, *, index: int,
                      first: bool = True, offset: int = 0) -> dict:
    """One choice of a completion response, or of a stream chunk (out and c then deltas).
    first: the completion's first chunk (echo puts the prompt there); offset: the text_offset
    its first token starts at (the completion's text sent before, as vLLM)."""
    text, token_ids, entries = c.text, list(c.token_ids), c.logprobs
    if req.echo_only:
        text, token_ids, entries = "", [], []
    if req.echo and first:
        text = _prompt_text(out, decode) + text
        if req.logprobs is not None:
            token_ids = list(out.prompt_token_ids) + token_ids
            entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + \
                list(entries or [])
    lps = None
    if req.logprobs is not None and entries is not None:
        lps = completion_logprobs(token_ids, entries, req.logprobs, offset, decode)
    choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": c.finish_reason,
              "stop_reason": c.stop_reason}
    if req.prompt_logprobs:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs)
    return choice


def _body(kind: str, request_id: str, created: int, model: str, choices: list[dict],
          usage_: dict | None, chunk: bool) -> dict:
    """A response or stream chunk of object `kind`; usage in a whole response always, in a
    chunk where given."""
    body = {"id": request_id, "object": kind, "created": created, "model": model,
            "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def completion_body(request_id: str, created: int, model: str, choices: list[dict],
                    usage_: dict | None, *, chunk: bool = False) -> dict:
    return _body("text_completion", request_id, created, model, choices, usage_, chunk)


def chat_output(req: ParsedRequest, phase: str | None, tool_parser: str | None = None,
                tags: ThinkTags | None = None) -> ChatOutput:
    """A completion's ChatOutput; phase: ThinkTags.prompt_phase of its prompt, None without a
    reasoning parser; tool_parser: the server's, which reads an "auto" answer's calls (None
    where it has none: "auto" is then refused before this); tags: the ThinkTags the phase was
    read with (its reasoning tokens are counted by them)."""
    return ChatOutput(phase, req.tool_mode, req.include_reasoning, req.parallel_tool_calls,
                      tool_parser or "hermes", req.chat_options.get("tools"), tags)


def _finish_reason(c, parser: ChatOutput, streamed: bool = False) -> str | None:
    """vLLM's (and OpenAI's): "tool_calls" where an "auto" answer called tools, or a "required"
    one ended whole; a named function's call ends with the completion's own reason. streamed:
    a stream's last chunk, where vLLM's "auto" answer too says "tool_calls" only if it stopped
    (cut by max_tokens it stays "length": its last call may be cut short)."""
    ended = c.finish_reason == "stop" if streamed else c.finish_reason is not None
    if parser.called and (parser.tool_mode == "auto" and ended or
                          parser.tool_mode == "required" and c.finish_reason == "stop"):
        return "tool_calls"
    return c.finish_reason


def chat_choice(c, req: ParsedRequest, parser: ChatOutput, *, delta: bool) -> dict | None:
    """One choice of a chat response, or of a stream chunk (delta: c holds what is new; None
    when the chunk would carry nothing: its text held back, no logprobs, not the last). The
    parser counts c's reasoning tokens (its usage's), the chunk sent or not."""
    parser.count(c.token_ids)
    # Hidden reasoning hides its tokens' logprobs too (vLLM's).
    hidden = parser.reasoning_parser and not parser.include_reasoning
    lps = (chat_logprobs(list(c.token_ids), c.logprobs, req.logprobs)
           if req.logprobs is not None and c.logprobs is not None and not hidden else None)
    if delta:
        fields = parser.feed(c.text, last=c.finish_reason is not None)
        if c.finish_reason is not None:
            for key, value in parser.finish().items():
                fields[key] = fields[key] + value if key in fields else value
        if parser.split is None and parser.tool_mode == "none":
            # vLLM's stream without a parser: each chunk its content, "" where its tokens' text
            # is held back or empty (the last chunk's, after EOS), as clients reading
            # delta["content"] expect.
            fields.setdefault("content", "")
        if not fields and lps is None and c.finish_reason is None:
            return None
        return {"index": c.index, "delta": fields, "logprobs": lps,
                "finish_reason": _finish_reason(c, parser, streamed=True),
                "stop_reason": c.stop_reason}
    msg = {**message(parser, c.text), "role": req.role}
    if req.chat_echo:  # vLLM's: prepended even to an answer of tool calls alone
        msg["content"] = req.chat_echo + (msg["content"] or "")
    return {"index": c.index, "message": msg, "logprobs": lps,
            "finish_reason": _finish_reason(c, parser), "stop_reason": c.stop_reason}


def chat_role_choice(index: int, role: str = "assistant") -> dict:
    """The first chunk of each streamed chat completion: its role (vLLM's)."""
    return {"index": index, "delta": {"role": role, "content": ""}, "logprobs": None,
            "finish_reason": None}


def chat_echo_choice(index: int, text: str) -> dict:
    """The chunk after the role's with echo: the last message's content (vLLM's)."""
    return {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}


def chat_body(request_id: str, created: int, model: str, choices: list[dict],
              usage_: dict | None, *, chunk: bool = False) -> dict:
    return _body("chat.completion.chunk" if chunk else "chat.completion", request_id, created,
                 model, choices, usage_, chunk)


# -- /v1/embeddings (a pooling LLM's) ----------------------------------------------------------

_EMBEDDING = {"model": str, "input": (str, list), "encoding_format": str, "dimensions": int,
              "truncate_prompt_tokens": int, "normalize": bool, "use_activation": bool,
              "priority": int, "add_special_tokens": bool, "request_id": str}
# vLLM's EmbeddingChatRequest: messages instead of input, through the chat template.
_EMBEDDING_CHAT = {"messages": list, "add_generation_prompt": bool,
                   "continue_final_message": bool, "chat_template": str,
                   "chat_template_kwargs": dict}


def _prompts(value, name: str) -> list:
    """OpenAI's prompt forms: a string, strings, token ids, or arrays of token ids."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [{"prompt_token_ids": value}]
    if value and all(isinstance(p, str) for p in value):
        return list(value)
    if value and all(isinstance(p, list) for p in value):
        return [{"prompt_token_ids": p} for p in value]
    raise RequestError(f"'{name}' must be a string, an array of strings, an array of token "
                       f"ids or an array of such arrays, and not empty")


def _embedding_chat(values: dict) -> tuple[list, dict]:
    """A chat embedding's (messages, chat options), as vLLM's EmbeddingChatRequest: no
    generation prompt unless asked for (an embedding continues nothing)."""
    if not values["messages"]:
        raise RequestError("'messages' must not be empty")
    messages = [_message_text(m, k) for k, m in enumerate(values["messages"])]
    if values["continue_final_message"] and values["add_generation_prompt"]:  # vLLM's words
        raise RequestError("Cannot set both `continue_final_message` and "
                           "`add_generation_prompt` to True.")
    options = _chat_options({**values, "tools": None,
                             "add_generation_prompt": bool(values["add_generation_prompt"])})
    return messages, options


def parse_embedding(body, defaults: dict | None = None) -> ParsedRequest:
    """A /v1/embeddings body -> ParsedRequest whose params are PoolingParams (`defaults`, the
    sampling defaults, are not read: an embedding samples nothing). Its input is 'input', or
    'messages' rendered by the chat template (vLLM's EmbeddingChatRequest, whose text is
    tokenized without the tokenizer's special tokens unless add_special_tokens is true)."""
    values = _checked_fields(body, {**_EMBEDDING, **_EMBEDDING_CHAT})
    if (values["input"] is None) == (values["messages"] is None):
        raise RequestError("give 'input' or 'messages' (a conversation, through the chat "
                           "template), one of them")
    prompts, messages, options = None, None, {}
    if values["messages"] is not None:
        messages, options = _embedding_chat(values)
        values = {**values, "add_special_tokens": values["add_special_tokens"] is True}
    else:
        given = sorted(name for name in _EMBEDDING_CHAT if values[name] is not None)
        if given:
            raise RequestError(f"{given} need 'messages' (they render a conversation)")
        prompts = _prompts(values["input"], "input")
    fmt = "float" if values["encoding_format"] is None else values["encoding_format"]
    if fmt not in ("float", "base64"):
        raise RequestError(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}")
    try:
        params = PoolingParams(dimensions=values["dimensions"], normalize=values["normalize"],
                               use_activation=values["use_activation"],
                               truncate_prompt_tokens=values["truncate_prompt_tokens"])
    except ValueError as e:
        raise RequestError(str(e)) from None
    return ParsedRequest(params=params, prompts=prompts, messages=messages,
                         chat_options=options, model=values["model"] or None,
                         encoding_format=fmt, request_id=values["request_id"],
                         **_pooling_options(values))


def embedding_body(request_id: str, created: int, model: str, outs: list, fmt: str) -> dict:
    """OpenAI's embeddings response; base64: each vector's float32 little-endian bytes."""
    def vector(e: list[float]):
        return e if fmt == "float" else base64.b64encode(struct.pack(f"<{len(e)}f", *e)).decode()

    return _list_body(request_id, created, model, outs,
                      [{"index": k, "object": "embedding", "embedding": vector(o.outputs.embedding)}
                       for k, o in enumerate(outs)])


# -- /score, /rerank and /classify (a pooling LLM's, as vLLM's) --------------------------------

# vLLM's pooling requests all carry priority (0 unless the scheduling policy is "priority").
_POOLED = {"model": str, "truncate_prompt_tokens": int, "use_activation": bool, "priority": int}
# /score's forms (vLLM's ScoreRequest): one of these pairs of fields gives (data_1, data_2).
_SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                ("text_1", "text_2"))
_SCORE = {**_POOLED, **{name: (str, list) for pair in _SCORE_PAIRS for name in pair}}
_RERANK = {**_POOLED, "query": str, "documents": (str, list), "top_n": int}
_CLASSIFY = {**_POOLED, "input": (str, list), "add_special_tokens": bool}


def _pooling_options(values: dict) -> dict:
    """A pooling request's priority and add_special_tokens (where it takes them), for
    ParsedRequest; the server refuses a priority its pooling requests cannot have."""
    options = {"priority": values["priority"] or 0}
    if values.get("add_special_tokens") is not None:
        options["add_special_tokens"] = values["add_special_tokens"]
    return options


def _pooling_params(values: dict, task: str | None = None) -> PoolingParams:
    try:
        return PoolingParams(use_activation=values["use_activation"],
                             truncate_prompt_tokens=values["truncate_prompt_tokens"], task=task)
    except ValueError as e:
        raise RequestError(str(e)) from None


def _texts(value, name: str) -> str | list[str]:
    """A text or a list of texts (vLLM's score inputs; its multi-modal content is not taken)."""
    if isinstance(value, list) and not all(isinstance(t, str) for t in value):
        raise RequestError(f"'{name}' must be a string or an array of strings (minivllm scores "
                           f"texts), got {value!r:.80}")
    return value


def parse_score(body, defaults: dict | None = None) -> ParsedRequest:
    """A /score (/v1/score) body -> ParsedRequest with score_inputs: one pair of fields,
    queries and documents (or items), data_1 and data_2, or text_1 and text_2."""
    values = _checked_fields(body, _SCORE)
    given = {name for name in _SCORE if name not in _POOLED and values[name] is not None}
    pair = next((p for p in _SCORE_PAIRS if set(p) == given), None)
    if pair is None:
        raise RequestError(f"give one pair of fields: 'queries' and 'documents' (or 'items'), "
                           f"'data_1' and 'data_2', or 'text_1' and 'text_2'; got "
                           f"{sorted(given)}")
    return ParsedRequest(params=_pooling_params(values), model=values["model"] or None,
                         score_inputs=tuple(_texts(values[name], name) for name in pair),
                         **_pooling_options(values))


def parse_rerank(body, defaults: dict | None = None) -> ParsedRequest:
    """A /rerank (/v1/rerank, /v2/rerank) body: a query, its documents, top_n (0: all)."""
    values = _checked_fields(body, _RERANK)
    for name in ("query", "documents"):
        if values[name] is None:
            raise RequestError(f"'{name}' is required")
    top_n = values["top_n"] or 0
    if top_n < 0:
        raise RequestError(f"'top_n' must be >= 0 (0: every document), got {top_n}")
    return ParsedRequest(params=_pooling_params(values), model=values["model"] or None,
                         score_inputs=(values["query"], _texts(values["documents"], "documents")),
                         top_n=top_n, **_pooling_options(values))


def parse_classify(body, defaults: dict | None = None) -> ParsedRequest:
    """A /classify body: 'input' as /v1/embeddings takes it."""
    values = _checked_fields(body, _CLASSIFY)
    if values["input"] is None:
        raise RequestError("'input' is required")
    return ParsedRequest(params=_pooling_params(values, "classify"),
                         prompts=_prompts(values["input"], "input"),
                         model=values["model"] or None, **_pooling_options(values))


def _prompt_tokens(outs: list) -> dict:
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _list_body(request_id: str, created: int, model: str, outs: list, data: list) -> dict:
    """The envelope of the pooling routes' responses (embeddings, scores, classes): `data`, one
    item per output, and the prompts' token usage."""
    return {"id": request_id, "object": "list", "created": created, "model": model,
            "data": data, "usage": _prompt_tokens(outs)}


def score_body(request_id: str, created: int, model: str, outs: list) -> dict:
    """vLLM's /score response: a score per pair, in pair order."""
    return _list_body(request_id, created, model, outs,
                      [{"index": k, "object": "score", "score": o.outputs.score}
                       for k, o in enumerate(outs)])


def rerank_body(request_id: str, model: str, outs: list, documents, top_n: int) -> dict:
    """vLLM's /rerank response: the documents by relevance, best first (the first given first
    among equals), the best top_n of them (0: all)."""
    documents = [documents] if isinstance(documents, str) else documents
    results = [{"index": k, "document": {"text": doc, "multi_modal": None},
                "relevance_score": o.outputs.score}
               for k, (doc, o) in enumerate(zip(documents, outs))]
    results.sort(key=lambda r: r["relevance_score"], reverse=True)
    if 0 < top_n < len(results):
        results = results[:top_n]
    return {"id": request_id, "model": model, "usage": _prompt_tokens(outs), "results": results}


def classify_body(request_id: str, created: int, model: str, outs: list,
                  labels: tuple[str, ...]) -> dict:
    """vLLM's /classify response: each prompt's probabilities and its likeliest label."""
    def label(probs: list[float]) -> str | None:
        best = max(range(len(probs)), key=probs.__getitem__)
        return labels[best] if best < len(labels) else None

    return _list_body(request_id, created, model, outs,
                      [{"index": k, "label": label(o.outputs.probs), "probs": o.outputs.probs,
                        "num_classes": len(o.outputs.probs)} for k, o in enumerate(outs)])


# -- /tokenize and /detokenize (vLLM's) --------------------------------------------------------

_TOKENIZE = {"model": str, "prompt": str, "messages": list, "add_special_tokens": bool,
             "add_generation_prompt": bool, "continue_final_message": bool,
             "chat_template": str, "chat_template_kwargs": dict, "return_token_strs": bool,
             "tools": list}


@dataclass
class TokenizeRequest:
    prompt: str | None
    messages: list | None
    add_special_tokens: bool
    return_token_strs: bool
    chat_options: dict
    model: str | None


def parse_tokenize(body) -> TokenizeRequest:
    """A /tokenize body: a prompt, or messages (rendered by the chat template, whose special
    tokens it writes itself: add_special_tokens then defaults to false, as vLLM's)."""
    values = _checked_fields(body, _TOKENIZE)
    if (values["prompt"] is None) == (values["messages"] is None):
        raise RequestError("give 'prompt' or 'messages'")
    messages = None
    if values["messages"] is not None:
        if not values["messages"]:
            raise RequestError("'messages' must not be empty")
        messages = [_message_text(m, k) for k, m in enumerate(values["messages"])]
        _check_generation_prompt(values)
    if values["tools"] is not None:
        if messages is None:
            raise RequestError("'tools' needs 'messages'")
        try:
            tool_calls.check_tools(values["tools"])
        except ValueError as e:
            raise RequestError(str(e)) from None
    special = values["add_special_tokens"]
    return TokenizeRequest(prompt=values["prompt"], messages=messages,
                           add_special_tokens=(messages is None) if special is None else special,
                           return_token_strs=bool(values["return_token_strs"]),
                           chat_options=_chat_options(values), model=values["model"] or None)


def render_chat(llm, messages: list, options: dict) -> dict:
    """A conversation through the chat template as a prompt ({"prompt", "prompt_token_ids"});
    the request's own fields win over the same keys in chat_template_kwargs (as vLLM)."""
    kwargs = {k: v for k, v in options["chat_template_kwargs"].items()
              if k not in ("add_generation_prompt", "continue_final_message", "chat_template",
                           "tokenize", "conversation", "tools")}
    return llm.chat_prompts(messages, chat_template=options["chat_template"],
                            add_generation_prompt=options["add_generation_prompt"],
                            continue_final_message=options["continue_final_message"],
                            chat_template_kwargs=kwargs, tools=options["tools"])[0]


def tokenize(llm, req: TokenizeRequest) -> dict:
    """The /tokenize answer (vLLM's fields); runs where the tokenizer may be used."""
    tok = llm.get_tokenizer()
    if req.messages is not None:
        text = render_chat(llm, req.messages, req.chat_options)["prompt"]
    else:
        text = req.prompt
    ids = tok.encode(text, add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": llm.config.max_model_len, "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}


def parse_detokenize(body) -> dict:
    values = _checked_fields(body, {"model": str, "tokens": list})
    tokens = values["tokens"]
    if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise RequestError("'tokens' must be an array of token ids")
    return {"tokens": tokens, "model": values["model"] or None}


def detokenize(llm, tokens: list[int]) -> dict:
    vocab = llm.engine.vocab_size
    for t in tokens:
        if not 0 <= t < vocab:
            raise RequestError(f"token id {t} is outside the vocabulary [0, {vocab})")
    return {"prompt": llm.get_tokenizer().decode(tokens)}
