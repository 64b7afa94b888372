"""Tool calls (OpenAI's function calling) as vLLM's server makes them for Qwen3: a request's
`tools` and `tool_choice` checked, the constraint that "required" and a named function put on
the answer, and the calls read back from it.

Qwen3 writes each call as a hermes block (vLLM's `--tool-call-parser hermes`):
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
Qwen3-Coder writes XML blocks instead (`--tool-call-parser qwen3_coder`:
runtime/qwen3_coder_tools.py).
tool_choice "auto" reads such blocks from the answer (answer_split); "required" constrains the
answer to a JSON array of {"name", "parameters"} objects, one of the tools each, and a named
function to that function's parameters (structured outputs, runtime/guide.py), as vLLM does,
whichever the parser: vLLM's qwen3_coder parser, as hermes, declares supports_required_and_named,
so its server constrains those choices to JSON and never asks the parser.
"""

from __future__ import annotations

import json
import re
import uuid

from .json_stream import CallScanner
from .qwen3_coder_tools import Qwen3CoderSplit
from .reasoning import partial_tag

START_TAG, END_TAG = "<tool_call>", "</tool_call>"
PARSERS = ("hermes", "qwen3_coder")
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
NO_ARGUMENTS = {"type": "object", "properties": {}}


def check_parser(name) -> str | None:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {list(PARSERS)} or None, got {name!r}")
    return name


def check_tools(tools) -> list[dict]:
    """OpenAI's tools: [{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}]. ValueError naming what is wrong."""
    if not isinstance(tools, list):
        raise ValueError("'tools' must be an array of {'type': 'function', 'function': {...}} "
                         "objects")
    names = set()
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(tool.get("function"), dict):
            raise ValueError(f"tools[{k}] must be {{'type': 'function', 'function': {{...}}}}")
        unknown = sorted(set(tool) - {"type", "function"})
        if unknown:
            raise ValueError(f"tools[{k}]: unknown fields {unknown}")
        fn = tool["function"]
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ValueError(f"tools[{k}].function: unknown fields {unknown}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{k}].function.name must be a non-empty string")
        if name in names:
            raise ValueError(f"tools[{k}]: two tools are named {name!r}")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"tools[{k}].function.description must be a string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ValueError(f"tools[{k}].function.parameters must be a JSON schema object")
    return tools


def check_tool_choice(choice, tools: list[dict] | None) -> str:
    """The request's tool_choice as "none", "auto", "required" or the named function's name
    prefixed "function:". Unset: "auto" with tools, "none" without (OpenAI's and vLLM's)."""
    if choice is None:
        return "auto" if tools else "none"
    if choice != "none" and not tools:  # vLLM's words
        raise ValueError("When using `tool_choice`, `tools` must be set.")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ValueError(f"'tool_choice' must be 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type", "function") != "function" or \
            not isinstance(fn.get("name"), str):
        raise ValueError("a named 'tool_choice' is {'type': 'function', 'function': "
                         "{'name': ...}}")
    names = [t["function"]["name"] for t in tools or ()]
    if fn["name"] not in names:
        raise ValueError(f"'tool_choice' names {fn['name']!r}, which is not among the tools "
                         f"{names}")
    return "function:" + fn["name"]


def _parameters(tool: dict) -> dict:
    """A tool's parameters schema; none, or an object schema that lists no properties, is a
    function without arguments: the empty object (any JSON object is not a regular language:
    runtime/guide.py)."""
    params = tool["function"].get("parameters")
    if not params or (params.get("type") == "object" and "properties" not in params
                      and not params.get("additionalProperties")):
        if params and params.get("required"):  # the empty object would break its own required
            raise ValueError(f"tool {tool['function']['name']!r}: its parameters require "
                             f"{params['required']!r:.60} but give no 'properties' to hold "
                             f"the answer to")
        return NO_ARGUMENTS
    return params


def _hoist_defs(params: dict, defs: dict) -> dict:
    """params without its $defs / definitions, which go into `defs` (one schema's, where its
    $refs look: vLLM's get_tool_schema_defs)."""
    params = dict(params)
    for key in ("$defs", "definitions"):
        for name, schema in (params.pop(key, None) or {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"two tools define {name!r} in their $defs differently")
    return params


def choice_schema(choice: str, tools: list[dict]) -> dict | None:
    """The JSON schema the answer is held to: a named function's parameters; for "required",
    an array of one or more {"name": one of the tools, "parameters": its parameters}, their
    $defs gathered at its top (vLLM's); None for "none" and "auto"."""
    if choice.startswith("function:"):
        name = choice[len("function:"):]
        return _parameters(next(t for t in tools if t["function"]["name"] == name))
    if choice != "required":
        return None
    defs: dict = {}
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                          "parameters": _hoist_defs(_parameters(t), defs)},
         "required": ["name", "parameters"]} for t in tools]}}
    if defs:
        schema["$defs"] = defs
    return schema


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_json(name: str, arguments: str) -> dict:
    """A tool call of a response's message."""
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _loads(text: str):
    """json.loads(text), or None where the text is no JSON (broken, or nested past the
    decoder's recursion): a model may write anything."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _hermes_call(text: str) -> dict | None:
    """A <tool_call> block's text as a call (a JSON object with a string "name" and an
    "arguments" value), or None where it is not one."""
    call = _loads(text)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or \
            "arguments" not in call:
        return None
    return call


def parse_hermes(text: str) -> list[dict] | None:
    """The calls in an answer from its first <tool_call> on, as [{"name", "arguments"}]
    (arguments a JSON text); None where a block is not a call (its JSON broken, or without a
    string name and an arguments value), as vLLM's hermes parser, which then returns the whole
    answer as content. A last block without its closing tag is read to the end (a completion
    that stopped at its EOS right after the JSON)."""
    calls = []
    for closed, open_ in _BLOCK.findall(text):
        call = _hermes_call(closed or open_)
        if call is None:
            return None
        calls.append({"name": call["name"],
                      "arguments": json.dumps(call["arguments"], ensure_ascii=False)})
    return calls


def parse_required(text: str) -> list[dict] | None:
    """The calls of a "required" answer (a JSON array of {"name", "parameters"}); None where
    the answer is not one (a completion cut short by max_tokens)."""
    items = _loads(text)
    if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str) and "parameters" in i
            for i in items):
        return None
    return [{"name": i["name"], "arguments": json.dumps(i["parameters"], ensure_ascii=False)}
            for i in items]


class ToolCallSplit:
    """An answer, fed as it grows, split into the content before its first <tool_call> (sent
    as it comes, but for an end that may begin the tag) and the calls. Each call streams as it
    is generated (`events`, read by ChatOutput): its name once the JSON's "name" string closed,
    then its arguments as json_stream.CallScanner writes them, pieces of exactly the text the
    whole answer's parse gives (json.dumps of the value); a block whose </tool_call> came is
    checked against json.loads of its text. finish() parses the rest whole (parse_hermes): then
    the calls, or, where the rest holds none that parses, the rest as content (so that a streamed
    answer's content ends as the whole one's; calls already streamed stay sent). Text after the
    first call is not content (vLLM's). Leading whitespace waits for the first other character:
    content that is only whitespace is none where calls follow (vLLM's server drops it)."""

    def __init__(self):
        self.pending = ""
        self.rest: str | None = None  # from the first <tool_call> on, once it came
        self.held = ""  # leading whitespace not sent yet (until a character that is not)
        self.sent_text = False  # whether content other than whitespace was sent
        # The calls as they come: (index, name, arguments piece), name None after the first.
        self.events: list[tuple[int, str | None, str]] = []
        self._pos = 0  # how far into rest the calls were read
        self._scanner: CallScanner | None = None  # the open block's
        self._start = 0  # where the open block's text starts in rest
        self._index = -1  # the open (or last) block's call index
        self._named = False  # the open block's name was given out
        self._given = 0  # how much of the open block's arguments was given out
        self._stopped = False  # the answer went where a stream cannot follow: finish() decides

    def feed(self, text: str) -> str:
        if self.rest is not None:
            self.rest += text
            self._read_calls()
            return ""
        text = self.pending + text
        before, tag, after = text.partition(START_TAG)
        if tag:
            self.pending, self.rest = "", tag + after
            self._read_calls()
            return self._send(before)
        keep = partial_tag(text, START_TAG)
        self.pending = text[len(text) - keep:] if keep else ""
        return self._send(text[:len(text) - keep])

    def _read_calls(self) -> None:
        """The blocks of rest read as far as it decides them (an end that may begin
        </tool_call> waits), their calls' pieces added to `events`."""
        rest = self.rest
        while not self._stopped:
            if self._scanner is None:
                start = rest.find(START_TAG, self._pos)
                if start < 0:
                    self._pos = max(self._pos, len(rest) - len(START_TAG) + 1)
                    return
                self._pos = self._start = start + len(START_TAG)
                self._scanner, self._named, self._given = CallScanner(), False, 0
                self._index += 1
                continue
            end = rest.find(END_TAG, self._pos)
            upto = end if end >= 0 else len(rest) - partial_tag(rest[self._pos:], END_TAG)
            self._scanner.feed(rest[self._pos:upto])
            self._pos = upto
            if end < 0:
                if self._scanner.failed:
                    self._stopped = True
                else:
                    self._give(self._scanner.name, self._scanner.args)
                return
            self._close_block(rest[self._start:end])
            self._pos, self._scanner = end + len(END_TAG), None

    def _close_block(self, text: str) -> None:
        """A block whose text is whole: its call as parse_hermes reads it."""
        call = _hermes_call(text)
        if call is None:
            self._stopped = True  # no call: finish() makes the rest content
            return
        args = json.dumps(call["arguments"], ensure_ascii=False)
        if self._named and call["name"] != self._scanner.name or \
                not args.startswith(self._scanner.args[:self._given]):
            self._stopped = True  # what was given out is not this call's: finish() decides
            return
        self._give(call["name"], args)

    def _give(self, name: str | None, args: str) -> None:
        """The open block's call as now known: its name (None: not read yet) and arguments so
        far, of which what was not given out yet goes to `events`."""
        if name is None:
            return
        piece, self._given = args[self._given:], len(args)
        if not self._named:
            self._named = True
            self.events.append((self._index, name, piece))
        elif piece:
            self.events.append((self._index, None, piece))

    def _send(self, content: str) -> str:
        """`content` to send now, less leading whitespace held back."""
        if self.sent_text:
            return content
        content, self.held = self.held + content, ""
        if not content.strip():
            self.held = content
            return ""
        self.sent_text = True
        return content

    def finish(self) -> tuple[str, list[dict]]:
        """(content still to send, calls): all the answer's calls, those streamed too (the
        stream sends what they lack, runtime/chat_output.py)."""
        held, self.held = self.held, ""
        if self.rest is None:
            text, self.pending = self.pending, ""
            return held + text, []
        calls = parse_hermes(self.rest)
        if calls is None:
            return held + self.rest, []
        return "", calls


def answer_split(parser: str, tools: list[dict] | None):
    """The split of an "auto" answer into content and calls by the named parser's rules
    (feed(text) -> content to send, finish() -> (content still to send, calls)); the tools type
    qwen3_coder's values."""
    if parser == "hermes":
        return ToolCallSplit()
    if parser == "qwen3_coder":
        return Qwen3CoderSplit(tools)
    raise ValueError(f"tool_call_parser must be one of {list(PARSERS)}, got {parser!r}")
