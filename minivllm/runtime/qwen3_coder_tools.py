"""Qwen3-Coder's tool calls (vLLM's `--tool-call-parser qwen3_coder`): XML blocks whose values
are raw text, typed by the tool's JSON schema.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The rules are those of vLLM 0.20's Qwen3CoderToolParser.extract_tool_calls
(vllm/tool_parsers/qwen3coder_tool_parser.py) with its server's use of the result
(OpenAIServing._parse_tool_calls_from_content), which decide a whole answer's message:
- no "<function=" anywhere, or none inside the blocks: no calls, the whole answer is content;
- the blocks are <tool_call> ... </tool_call>, the last one read to the end when unclosed; an
  answer without any <tool_call> is read as one block (a bare <function=...>);
- in a block, each <function=NAME> ... </function> is a call (several may share a block), the
  last read to the end when unclosed; one whose name has no closing ">" is dropped;
- a parameter's value runs to its </parameter>, or to the next <parameter=, or to </function>,
  or to the end; one leading and one trailing newline are stripped (the template's own); a
  parameter tag without its ">" makes the whole answer content (vLLM's parser raises there);
- values are typed by the tool's "properties" (convert_value); a parameter or function the tools
  do not list keeps its text; the arguments are the JSON text of the parameters in their order;
- the content is the text before the first <tool_call> (before the first <function= when there
  is no <tool_call>), none when it is only whitespace; text after the calls is dropped.
A call vLLM's parser fails on makes the whole answer content, as there: a value JSON cannot
write (a Python literal such as a set or a complex number) or an infinite "number" (whose int()
overflows).

Later vLLM (0.34) replaced this parser by a parser engine; its main branch in between grew
heuristics for tags written inside values: neither is followed here (README.md).
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from typing import Any

from .reasoning import partial_tag

TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"
# vLLM's patterns (its regex module reads them as re does): with DOTALL, a lazy group that ends
# at `$` stops before a final newline, a greedy one takes it.
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$", re.DOTALL)
_FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)",
                        re.DOTALL)

# vLLM's type names, read loosely (the schema's "type" lowercased, any other text allowed).
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_BOOL_TYPES = ("boolean", "bool", "binary")
_CONTAINER_TYPES = ("object", "array", "arr")


class _Unreadable(Exception):
    """The answer holds no calls that vLLM's parser would return (it raised there)."""


def tool_properties(tools: list[dict] | None, name: str) -> dict:
    """The named tool's parameters' "properties" (vLLM's find_tool_properties); {} for a tool
    not among `tools`, one without parameters, or properties that are not an object."""
    for tool in tools or ():
        fn = tool.get("function") or {}
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties")
            return props if isinstance(props, dict) else {}
    return {}


def _schema_type(schema) -> str:
    """A parameter schema's type name as vLLM reads it: its "type" as text, lowercased (a list
    of types is its Python text, so no known name); "object" for an anyOf without a "type"
    (its JSON parsed); "string" for anything else (an enum, a $ref, ...)."""
    if isinstance(schema, dict) and "type" in schema:
        return str(schema["type"]).strip().lower()
    if isinstance(schema, dict) and "anyOf" in schema:
        return "object"
    return "string"


def _number(value: str):
    """A number's value: an int where it is whole (vLLM's); the text where it is none (nan
    included). An infinite one cannot be an int: unreadable, as in vLLM."""
    try:
        number = float(value)
    except ValueError:
        return value
    try:
        return number if number - int(number) != 0 else int(number)
    except ValueError:  # nan
        return value
    except OverflowError:
        raise _Unreadable from None


def _literal(value: str, container: bool):
    """An object's or array's value (and any type vLLM does not name): JSON for a container,
    else (or where that fails) a Python literal, else the text."""
    if container:
        try:
            return json.loads(value)
        except (ValueError, RecursionError):  # JSONDecodeError, or nested too deep
            pass
    try:
        with warnings.catch_warnings():  # model text is no source code: its warnings are noise
            warnings.simplefilter("ignore", SyntaxWarning)
            return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        return value


def convert_value(value: str, name: str, properties: dict) -> Any:
    """A parameter's text as its schema types it (vLLM's _convert_param_value): "null" (any
    case) is None whatever the type; a parameter the properties do not list keeps its text;
    strings keep it; integers by int() and numbers by float() (whole ones as int), their text
    where that fails; booleans are "true" (any case), anything else false; objects and arrays
    by json.loads, then ast.literal_eval (Python's literals), then the text."""
    if value.lower() == "null":
        return None
    if name not in properties:
        return value
    kind = _schema_type(properties[name])
    if kind in _STRING_TYPES:
        return value
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        return _number(value)
    if kind in _BOOL_TYPES:
        return value.lower() == "true"
    return _literal(value, kind in _CONTAINER_TYPES or kind.startswith(("dict", "list")))


def _strip_newlines(value: str) -> str:
    """One leading and one trailing newline off: the template writes the value on its own
    lines."""
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


def parse_function(text: str, tools: list[dict] | None) -> dict | None:
    """One call from the text after "<function=" ({"name", "arguments"}, the arguments a JSON
    text); None where the name has no closing ">"."""
    name, close, body = text.partition(">")
    if not close:
        return None
    properties = tool_properties(tools, name)
    arguments = {}
    for match in _PARAMETER.findall(body):
        key, close, value = match.partition(">")
        if not close:
            raise _Unreadable  # vLLM's str.index raises here
        arguments[key] = convert_value(_strip_newlines(value), key, properties)
    try:
        return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    except (TypeError, ValueError):  # a Python literal JSON has no form for
        raise _Unreadable from None


def _function_texts(text: str) -> list[str]:
    """The texts after each "<function=" of the answer's blocks (the whole answer is one block
    where it has no <tool_call>)."""
    blocks = [closed or open_ for closed, open_ in _BLOCK.findall(text)] or [text]
    return [closed or open_ for block in blocks for closed, open_ in _FUNCTION.findall(block)]


def parse_qwen3_coder(text: str, tools: list[dict] | None) -> tuple[str | None, list[dict]]:
    """A whole answer's (content, calls), as vLLM's server answers with them: calls as
    [{"name", "arguments"}]; with none, the whole answer is the content."""
    if FUNCTION_START not in text:
        return text, []
    try:
        calls = [parse_function(f, tools) for f in _function_texts(text)]
    except (_Unreadable, RecursionError, MemoryError):  # vLLM's parser fails: no calls
        return text, []
    calls = [c for c in calls if c is not None]
    if not calls:
        return text, []
    start = text.find(TOOL_START)
    content = text[:start if start >= 0 else text.find(FUNCTION_START)]
    return (content if content.strip() else None), calls


class Qwen3CoderSplit:
    """An answer, fed as it grows, split as ToolCallSplit does but by parse_qwen3_coder's rules.
    Content: what is sent stops before the first <tool_call> or <function= (either may start the
    calls), and leading whitespace waits for the first other character (content that is only
    whitespace is none where calls follow). Calls stream (`events`, read by ChatOutput) from
    the <tool_call> blocks, as vLLM's parser streams them: a function's name with "{" once its
    ">" came, then each parameter as '"name": value' (", " before all but the first) once a
    </parameter> or the next <parameter= ends it, typed as the whole parse types it, then the
    rest of the function's arguments (its last parameters, "}") once </function> or the block's
    </tool_call> ends it, from parse_function of its whole text. A <function= before any
    <tool_call> waits for finish() (it is a call only if no block ever comes). finish() parses
    the whole answer and sends what its content has beyond what was sent, so a streamed answer
    ends as the whole one does."""

    def __init__(self, tools: list[dict] | None):
        self.tools = tools
        self.text = ""
        self.sent = 0  # the length of the content sent: never past a tag's start
        self.started = False  # a tag came: the rest waits for finish()
        # The calls as they come: (index, name, arguments piece), name None after the first.
        self.events: list[tuple[int, str | None, str]] = []
        self._mode = "out"  # "out" of blocks, in a "block", a function's "head" or "body"
        self._pos = 0  # how far into text the calls were read
        self._index = -1  # the current function's call index
        self._fstart = 0  # where the current function's text (after "<function=") starts
        self._end: tuple[int, str] | None = None  # the function's end (index, tag), once seen
        self._end_from = 0  # where to look for it next
        self._given = ""  # the current function's arguments given out
        self._keys: set[str] = set()  # its parameters given out
        self._stopped = False  # the answer went where a stream cannot follow: finish() decides

    def feed(self, text: str) -> str:
        self.text += text
        if not self._stopped:
            self._read_calls()
        if self.started:
            return ""
        starts = [i for i in (self.text.find(tag, self.sent) for tag in (TOOL_START,
                                                                        FUNCTION_START)) if i >= 0]
        if starts:
            self.started, end = True, min(starts)
        else:
            end = len(self.text) - max(partial_tag(self.text, TOOL_START),
                                       partial_tag(self.text, FUNCTION_START))
        if self.sent == 0 and not self.text[:end].strip():
            return ""
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return piece

    def _read_calls(self) -> None:
        text = self.text
        while not self._stopped:
            if self._mode == "out":
                start = text.find(TOOL_START, self._pos)
                if start < 0:
                    self._pos = max(self._pos, len(text) - len(TOOL_START) + 1)
                    return
                self._pos, self._mode = start + len(TOOL_START), "block"
            elif self._mode == "block":  # the block's next function, or its end
                f, e = text.find(FUNCTION_START, self._pos), text.find(TOOL_END, self._pos)
                if e >= 0 and (f < 0 or e < f):
                    self._pos, self._mode = e + len(TOOL_END), "out"
                elif f < 0:
                    self._pos = max(self._pos, len(text) - len(TOOL_END) + 1)
                    return
                else:
                    self._fstart = self._pos = self._end_from = f + len(FUNCTION_START)
                    self._end, self._mode = None, "head"
            elif self._mode == "head":  # the name, to its ">" inside the function
                close, end = text.find(">", self._fstart), self._function_end()
                if end is not None and not 0 <= close < end[0]:
                    self._after_function()  # no name: parse_function drops it
                elif close < 0:
                    return
                else:
                    self._index += 1
                    self._given, self._keys = "{", set()
                    self.events.append((self._index, text[self._fstart:close], "{"))
                    self._pos, self._mode = close + 1, "body"
            else:
                self._read_body()
                if self._mode == "body":
                    return

    def _function_end(self) -> tuple[int, str] | None:
        """Where the current function's text ends (the first </function>, or the block's
        </tool_call>, after its start), once that came."""
        if self._end is None:
            found = [(i, tag) for tag in (FUNCTION_END, TOOL_END)
                     if (i := self.text.find(tag, self._end_from)) >= 0]
            if found:
                self._end = min(found)
            else:
                self._end_from = max(self._end_from, len(self.text) - len(TOOL_END) + 1)
        return self._end

    def _after_function(self) -> None:
        """Past the current function's end: on in its block, or out of it."""
        i, tag = self._end
        self._pos, self._mode = i + len(tag), "block" if tag == FUNCTION_END else "out"

    def _give(self, piece: str) -> None:
        self._given += piece
        self.events.append((self._index, None, piece))

    def _read_body(self) -> None:
        """The function's parameters that a </parameter> or a next <parameter= ended; all of
        it once its end came."""
        text, end = self.text, self._function_end()
        limit = end[0] if end is not None else len(text)
        properties = tool_properties(self.tools, text[self._fstart:text.find(">", self._fstart)])
        while True:
            start = text.find(PARAMETER_START, self._pos, limit)
            if start < 0:
                break
            value_start = start + len(PARAMETER_START)
            ends = [i for i in (text.find(PARAMETER_END, value_start, limit),
                                text.find(PARAMETER_START, value_start, limit)) if i >= 0]
            if not ends:
                break
            stop = min(ends)
            key, close, value = text[value_start:stop].partition(">")
            if not close or key in self._keys:  # unreadable, or a value the last one replaces
                self._stopped = True
                return
            try:
                value = json.dumps(convert_value(_strip_newlines(value), key, properties),
                                   ensure_ascii=False)
            except (_Unreadable, TypeError, ValueError, RecursionError, MemoryError):
                self._stopped = True
                return
            self._give((", " if self._keys else "") + json.dumps(key, ensure_ascii=False) +
                       ": " + value)
            self._keys.add(key)
            self._pos = stop + len(PARAMETER_END) if text.startswith(PARAMETER_END, stop) \
                else stop
        if end is None:
            return
        try:
            call = parse_function(text[self._fstart:end[0]], self.tools)
        except (_Unreadable, RecursionError, MemoryError):
            call = None
        if call is None or not call["arguments"].startswith(self._given):
            self._stopped = True
            return
        if len(call["arguments"]) > len(self._given):
            self._give(call["arguments"][len(self._given):])
        self._after_function()

    def finish(self) -> tuple[str, list[dict]]:
        """(content still to send, calls): all the answer's calls, those streamed too (the
        stream sends what they lack, runtime/chat_output.py)."""
        content, calls = parse_qwen3_coder(self.text, self.tools)
        content = content or ""
        assert content.startswith(self.text[:self.sent]), "sent content the answer lacks"
        return content[self.sent:], calls
