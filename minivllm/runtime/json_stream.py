"""A hermes call's JSON ({"name": ..., "arguments": ...}) read as it is generated, character by
character, for streaming (runtime/tool_calls.py's ToolCallSplit): the name once its string
closed, and the arguments as the text `json.dumps(arguments, ensure_ascii=False)` will be, each
piece written as soon as the text so far decides it. So the pieces join to exactly the
arguments the whole answer's parse (tool_calls.parse_hermes) gives: spacing is json.dumps's
(", " and ": "), escapes are decoded and written again as json.dumps writes them (a \\u00e9 is
"é", a \\/ is "/"), a number or literal is written when it ends (json.dumps(json.loads(it)):
1.50 is 1.5, 1e2 is 100.0). What no prefix decides waits: a number or literal until the
character after it, a \\u escape until its four hex digits, a high surrogate until the next
character says whether it pairs.

Python's json (the C scanner's rules, strict: no control characters inside strings) is followed;
text it would refuse, a call that is not an object, a name that is not a string, or a key given
twice in one object (json.loads keeps the last value, at the first one's place, which a stream
cannot have written) stop the scan (`failed`): nothing more is written for the call."""

from __future__ import annotations

import json
import re

_WS = " \t\n\r"
_SCALAR = frozenset("0123456789+-.eEtrufalsnNIiy")
_SCALAR_START = frozenset("-0123456789tfnNI")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


def _written(ch: str) -> str:
    """A decoded character as json.dumps(ensure_ascii=False) writes it inside a string."""
    if ch in '"\\' or ch < " ":
        return json.dumps(ch)[1:-1]
    return ch


class _Frame:
    __slots__ = ("obj", "state", "keys")

    def __init__(self, obj: bool):
        self.obj = obj
        # obj: "k0" (a key or "}"), "k" (a key), ":" (the colon), "v" (a value), "," (after one)
        # array: "v0" (a value or "]"), "v", ","
        self.state = "k0" if obj else "v0"
        self.keys: set[str] = set()


class CallScanner:
    """feed(text) -> None; then `name` (the call's name, once read whole), `args` (the
    arguments as written so far) and `failed`."""

    def __init__(self):
        self.stack: list[_Frame] = []
        self.done = False  # the call's object closed
        self.failed = False
        self.name: str | None = None
        self.args = ""
        self.member: str | None = None  # the call object's key whose value is being read
        self.in_member = False  # a value of the call object is being read
        self.tok: str | None = None  # "s" a string, "n" a number or literal
        self.buf = ""  # the number's characters, or the \u escape's digits
        self.esc: str | None = None  # None, "\\" (after a backslash), "u" (reading 4 digits)
        self.is_key = False  # the string being read is a key
        self.text: list[str] | None = None  # the string's characters, where kept (keys, name)
        self.high: str | None = None  # a high surrogate waiting for its pair

    def feed(self, text: str) -> None:
        for ch in text:
            if self.failed:
                return
            self._char(ch)

    # -- output ----------------------------------------------------------------------------

    def _emit(self, piece: str) -> None:
        if self.in_member and self.member == "arguments":
            self.args += piece

    def _fail(self) -> None:
        self.failed = True

    # -- the scan ----------------------------------------------------------------------------

    def _char(self, ch: str) -> None:
        if self.tok == "s":
            self._string_char(ch)
            return
        if self.tok == "n":
            if ch in _SCALAR:
                self.buf += ch
                return
            self._end_scalar()
            if self.failed:
                return
        if ch in _WS:
            return
        if self.done:
            self._fail()  # json.loads' "Extra data"
            return
        frame = self.stack[-1] if self.stack else None
        state = frame.state if frame is not None else "v"
        if state in ("v", "v0"):
            if state == "v0" and ch == "]":
                self._close()
            elif frame is None and ch != "{":
                self._fail()  # a call is an object
            elif ch in "{[":
                if len(self.stack) == 1 and self.member == "name":
                    self._fail()  # a name that is not a string
                    return
                self._begin_value()
                self._emit(ch)
                self.stack.append(_Frame(ch == "{"))
            elif ch == '"':
                self._begin_value()
                self._begin_string(key=False)
            elif ch in _SCALAR_START:
                self._begin_value()
                self.tok, self.buf = "n", ch
            else:
                self._fail()
        elif state in ("k0", "k"):
            if ch == '"':
                self._begin_string(key=True)
            elif ch == "}" and state == "k0":
                self._close()
            else:
                self._fail()
        elif state == ":":
            if ch == ":":
                frame.state = "v"
                self._emit(": ")
            else:
                self._fail()
        else:  # ","
            if ch == ",":
                frame.state = "k" if frame.obj else "v"
                self._emit(", ")
            elif ch == ("}" if frame.obj else "]"):
                self._close()
            else:
                self._fail()

    def _begin_value(self) -> None:
        if len(self.stack) == 1:  # a member of the call object
            self.in_member = True

    def _end_value(self) -> None:
        if not self.stack:
            self.done = True
            return
        self.stack[-1].state = ","
        if len(self.stack) == 1:
            self.in_member = False

    def _close(self) -> None:
        self._emit("}" if self.stack[-1].obj else "]")
        self.stack.pop()
        self._end_value()

    def _end_scalar(self) -> None:
        token, self.tok, self.buf = self.buf, None, ""
        if not (token in _LITERALS or _NUMBER.fullmatch(token)):
            self._fail()
            return
        if len(self.stack) == 1 and self.member == "name":
            self._fail()  # a name that is not a string
            return
        try:
            self._emit(json.dumps(json.loads(token), ensure_ascii=False))
        except ValueError:  # an integer past Python's digit limit
            self._fail()
            return
        self._end_value()

    def _begin_string(self, key: bool) -> None:
        self.tok, self.esc, self.is_key = "s", None, key
        keep = key or (len(self.stack) == 1 and self.member == "name")
        self.text = [] if keep else None
        if not key:
            self._emit('"')

    def _string_char(self, ch: str) -> None:
        if self.esc is None:
            if ch == '"':
                self._end_string()
            elif ch == "\\":
                self.esc = "\\"
            elif ch < " ":
                self._fail()  # strict: no control characters
            else:
                self._decoded(ch)
        elif self.esc == "\\":
            if ch in _ESCAPES:
                self.esc = None
                self._decoded(_ESCAPES[ch])
            elif ch == "u":
                self.esc, self.buf = "u", ""
            else:
                self._fail()
        else:  # "u"
            if ch not in _HEX:
                self._fail()
                return
            self.buf += ch
            if len(self.buf) == 4:
                code, self.esc, self.buf = int(self.buf, 16), None, ""
                if self.high is not None and 0xDC00 <= code <= 0xDFFF:
                    high, self.high = self.high, None
                    self._char_out(chr(0x10000 + ((ord(high) - 0xD800) << 10) + code - 0xDC00))
                    return
                self._flush_high()
                if 0xD800 <= code <= 0xDBFF:
                    self.high = chr(code)
                else:
                    self._char_out(chr(code))

    def _decoded(self, ch: str) -> None:
        self._flush_high()
        self._char_out(ch)

    def _flush_high(self) -> None:
        if self.high is not None:
            high, self.high = self.high, None
            self._char_out(high)

    def _char_out(self, ch: str) -> None:
        if self.text is not None:
            self.text.append(ch)
        if not self.is_key:
            self._emit(_written(ch))

    def _end_string(self) -> None:
        self._flush_high()
        self.tok = None
        text, self.text = self.text, None
        if self.is_key:
            key = "".join(text)
            frame = self.stack[-1]
            if key in frame.keys:
                self._fail()  # json.loads keeps the last value, at the first one's place
                return
            frame.keys.add(key)
            frame.state = ":"
            if len(self.stack) == 1:
                self.member = key
            else:
                self._emit(json.dumps(key, ensure_ascii=False))
            return
        self._emit('"')
        if text is not None:
            self.name = "".join(text)
        self._end_value()
