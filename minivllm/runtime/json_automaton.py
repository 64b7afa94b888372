"""vLLM's `json_object` constraint: the output is one JSON object (any keys, any values, any
nesting), as a deterministic pushdown automaton over characters with RegexDFA's interface
(`start`, `DEAD`, `step`, `walk`, `charsets`, `accepts`, `can_continue`), so that
guide.CompiledGuide masks tokens with it exactly as it does with a regex's DFA.

JSON objects are not a regular language; two bounds make this automaton's state set finite, and
so its states internable and their masks cacheable:

- MAX_DEPTH containers nested at most (the top-level object counts as one);
- MAX_WHITESPACE consecutive whitespace characters ([ \\t\\n\\r]) at most between two JSON
  tokens, so that a model cannot spend its whole budget on whitespace (vLLM's xgrammar takes any
  amount: a deviation).

The output starts with '{' and ends with its matching '}' (no whitespace before or after: the
sequence may only end there, through EOS). Strings and numbers may be of any length (max_tokens
bounds them); strings take JSON's escapes (\\u followed by any four hex digits) and no control
characters, numbers JSON's exact grammar -?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?, and
NaN / Infinity (which Python's json takes) are not JSON.

A state is (stack, lexer, whitespace run), interned to an int when first met:
- stack: one character per open container, saying where it is:
  object  '{' just opened (a key or '}'), 'k' after ',' (a key), ':' after a key (':'),
          'v' after ':' (a value), ',' after a value (',' or '}');
  array   '[' just opened (a value or ']'), 'a' after ',' (a value), ';' after a value (',' or ']');
  a container's frame stays in its value place ('v', '[' or 'a') while a nested one is open;
- lexer: '' between JSON tokens, '^' before the top-level '{', '$' after its '}', 's' inside a
  string ('e' after its backslash, 'u4'..'u1' the hex digits of a \\u escape still due), a number
  'n-' (after its minus), 'n0' (a leading zero), 'nd' (integer digits), 'n.' (after its point),
  'nf' (fraction digits), 'ne' (after e / E), 'ns' (after the exponent's sign), 'nx' (exponent
  digits), or 'l' + the rest of a literal (true / false / null) still due;
- whitespace run: the whitespace characters since the last JSON token.
Interned states are kept for the automaton's life (as RegexDFA's are): a long string or number is
one state, so their number follows the distinct nestings met, not the text's length.
"""

from __future__ import annotations

import numpy as np

from .regex_fsm import CharSet, LazyDFA

MAX_DEPTH = 16  # containers open at once, the top-level object included
MAX_WHITESPACE = 16  # consecutive whitespace characters between two JSON tokens

_WHITESPACE = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrt'
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_KEY_PLACES = "{k"  # frames whose next string is a key
_VALUE_PLACES = "v[a"  # frames whose next JSON token is a value
_NUMBER_ENDS = ("n0", "nd", "nf", "nx")  # number states a number may end in

_State = tuple[str, str, int]  # (stack, lexer, whitespace run)
_START: _State = ("", "^", 0)


def _value_done(stack: str) -> _State:
    """The state after a value ends in the container on top of `stack`."""
    top = stack[-1]
    return stack[:-1] + ("," if top == "v" else ";"), "", 0


def _close(stack: str) -> _State:
    """The state after the container on top of `stack` closes."""
    rest = stack[:-1]
    return (rest, "$", 0) if not rest else _value_done(rest)


def _between(stack: str, ws: int, c: str) -> _State | None:
    """The state after character c between JSON tokens (lexer ''), None where c cannot come."""
    top = stack[-1]
    if c in _WHITESPACE:
        return (stack, "", ws + 1) if ws < MAX_WHITESPACE else None
    if top in _KEY_PLACES:
        if c == '"':
            return stack, "s", 0
        return _close(stack) if c == "}" and top == "{" else None
    if top == ":":
        return (stack[:-1] + "v", "", 0) if c == ":" else None
    if top in ",;":
        if c == ",":
            return stack[:-1] + ("k" if top == "," else "a"), "", 0
        return _close(stack) if c == ("}" if top == "," else "]") else None
    # A value place.
    if c == "]" and top == "[":
        return _close(stack)
    if c in "{[":
        return (stack + c, "", 0) if len(stack) < MAX_DEPTH else None
    if c == '"':
        return stack, "s", 0
    if c == "-":
        return stack, "n-", 0
    if c in _DIGITS:
        return stack, "n0" if c == "0" else "nd", 0
    if c in _LITERALS:
        return stack, "l" + _LITERALS[c], 0
    return None


def _number(stack: str, lex: str, c: str) -> _State | None:
    """The state after character c inside a number; a character that cannot go on with it ends
    the number (where it may end) and is then read between JSON tokens."""
    digit = c in _DIGITS
    if lex == "n-":
        return (stack, "n0" if c == "0" else "nd", 0) if digit else None
    if lex == "nd" and digit:
        return stack, "nd", 0
    if lex in ("n0", "nd") and c == ".":
        return stack, "n.", 0
    if lex in ("n.", "nf") and digit:
        return stack, "nf", 0
    if lex in ("n0", "nd", "nf") and c in "eE":
        return stack, "ne", 0
    if lex == "ne" and c in "+-":
        return stack, "ns", 0
    if lex in ("ne", "ns", "nx") and digit:
        return stack, "nx", 0
    if lex not in _NUMBER_ENDS:
        return None
    after, _, _ = _value_done(stack)
    return _between(after, 0, c)


def next_state(state: _State, c: str) -> _State | None:
    """The automaton's move: the state after character c, None where no JSON object goes on."""
    stack, lex, ws = state
    if lex == "^":
        return ("{", "", 0) if c == "{" else None
    if lex == "$":
        return None
    if lex == "":
        return _between(stack, ws, c)
    if lex == "s":
        if c == '"':
            return (stack[:-1] + ":", "", 0) if stack[-1] in _KEY_PLACES else _value_done(stack)
        if c == "\\":
            return stack, "e", 0
        return None if ord(c) < 0x20 else (stack, "s", 0)
    if lex == "e":
        return (stack, "s", 0) if c in _ESCAPES else (stack, "u4", 0) if c == "u" else None
    if lex[0] == "u":
        if c not in _HEX:
            return None
        due = int(lex[1]) - 1
        return stack, f"u{due}" if due else "s", 0
    if lex[0] == "n":
        return _number(stack, lex, c)
    # A literal: its next character, the value done after its last.
    if c != lex[1]:
        return None
    return (stack, "l" + lex[2:], 0) if len(lex) > 2 else _value_done(stack)


def _ranges(chars: list[str]) -> tuple[tuple[str, str], ...]:
    """Sorted characters as runs (lo, hi) of consecutive code points."""
    out: list[list[str]] = []
    for c in chars:
        if out and ord(c) == ord(out[-1][1]) + 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return tuple((lo, hi) for lo, hi in out)


class JsonObjectAutomaton(LazyDFA):
    """next_state's automaton with its states interned to ints as met (regex_fsm.LazyDFA, as
    RegexDFA): `DEAD` (0) is where no JSON object goes on, `start` before the first character."""

    # Every character but those is alike to the automaton: it goes on with a string, or with
    # nothing else (charsets covers them as one range).
    _ASCII = [chr(i) for i in range(128)]

    def __init__(self):
        self._charsets: dict[int, list[CharSet]] = {}
        super().__init__(_START)

    def _successor(self, key: _State, c: str) -> _State | None:
        return next_state(key, c)

    def charsets(self, state: int) -> list[CharSet]:
        """The characters with a move out of `state`, as one set (CompiledGuide asks it whether
        a character split over tokens may begin here): the ASCII ones found by trying each, and
        every other character inside a string, where any may come."""
        sets = self._charsets.get(state)
        if sets is None:
            live = [c for c in self._ASCII if self.step(state, c) != self.DEAD]
            ranges = _ranges(live)
            if state != self.DEAD and self._keys[state][1] == "s":
                ranges += (("\x80", "\U0010ffff"),)
            sets = self._charsets[state] = [CharSet(ranges=ranges)] if ranges else []
        return sets

    def char_classes(self, state: int, codes: np.ndarray, chars: list[str],
                     escapes: dict) -> np.ndarray:
        # each ASCII character its own class, every other character one (see _ASCII)
        return np.minimum(codes, len(self._ASCII))

    def accepts(self, state: int) -> bool:
        return state != self.DEAD and self._keys[state][1] == "$"

    def can_continue(self, state: int) -> bool:
        """Whether some character leads on from `state`: every live state but the accepting one
        (the top-level object closed: only EOS follows)."""
        return state != self.DEAD and self._keys[state][1] != "$"
