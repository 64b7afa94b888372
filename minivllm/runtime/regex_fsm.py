"""Regular expressions as automata over characters, for structured outputs (runtime/guide.py).

A pattern (Python `re` syntax, the subset below) becomes a Thompson NFA, and its DFA is built
lazily: a DFA state is the set of NFA states reached, made when first reached, its transitions
made when first taken. The language is the pattern's under re.fullmatch: every string the DFA
accepts fullmatches the pattern with Python's re, which the tests check.

Supported: literals and escapes (\\. \\n \\t \\xhh \\uhhhh ...), `.` (any character but a newline),
classes `[a-z_]` and `[^...]`, \\d \\w \\s and their negations (Unicode-aware, as re's), groups
`(...)`, `(?:...)`, `(?P<name>...)`, alternation `|`, the quantifiers * + ? {m} {m,} {m,n} (lazy
forms alike: the language is the same), and ^ / $ at the ends of the pattern or of its
alternatives (^a$|^b$, where they hold under fullmatch). Anything else (look-arounds,
back-references, \\b, flags) is a ValueError naming it.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass, field

import numpy as np

MAX_NFA_STATES = 100_000  # {m,n} copies its operand: a bound on what a pattern may expand to
# The longest pattern taken: parsing costs some microseconds a character, and a pattern this long
# already expands past MAX_NFA_STATES for what guide.schema_regex writes (a JSON schema's regex
# grows as the product of its nested properties: it is cut off at this length as it is built).
MAX_PATTERN_CHARS = 200_000

_CLASS_ESCAPES = {
    "d": lambda c: c.isdecimal(),
    "w": lambda c: c.isalnum() or c == "_",
    "s": lambda c: c.isspace(),
}
_LITERAL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}


@dataclass(frozen=True)
class CharSet:
    """Characters: those in `ranges` ((lo, hi) inclusive) or `classes` (escape letters d / w / s
    and their negations D / W / S), or, negated, every character but those."""

    ranges: tuple[tuple[str, str], ...] = ()
    classes: tuple[str, ...] = ()
    negated: bool = False

    def __contains__(self, c: str) -> bool:
        hit = any(lo <= c <= hi for lo, hi in self.ranges) or any(
            _CLASS_ESCAPES[k.lower()](c) != k.isupper() for k in self.classes)
        return hit != self.negated


    def members(self, codes: np.ndarray, chars: list[str], escapes: dict) -> np.ndarray:
        """Which of `chars` (their code points `codes`) it holds, as a bool array. `escapes`: the
        caller's memo of each class escape's members among the same chars."""
        hit = np.zeros(len(codes), dtype=bool)
        for lo, hi in self.ranges:
            hit |= (codes >= ord(lo)) & (codes <= ord(hi))
        for k in self.classes:
            base = escapes.get(k.lower())
            if base is None:
                test = _CLASS_ESCAPES[k.lower()]
                base = escapes[k.lower()] = np.fromiter(map(test, chars), bool, len(chars))
            hit |= ~base if k.isupper() else base
        return ~hit if self.negated else hit

    def meets(self, lo: int, hi: int) -> bool:
        """Whether it holds a character of code point lo..hi (surrogates aside)."""
        if not self.classes:
            return any(self._meets_ranges(a, b) for a, b in ((lo, min(hi, 0xD7FF)),
                                                               (max(lo, 0xE000), hi)) if a <= b)
        return any(chr(c) in self for c in range(lo, hi + 1) if not 0xD800 <= c <= 0xDFFF)

    def _meets_ranges(self, lo: int, hi: int) -> bool:
        spans = sorted((ord(a), ord(b)) for a, b in self.ranges)
        if not self.negated:
            return any(a <= hi and b >= lo for a, b in spans)
        at = lo  # the first code point not yet known to be excluded
        for a, b in spans:
            if a > at:
                break
            at = max(at, b + 1)
        return at <= hi


ANY_BUT_NEWLINE = CharSet(ranges=(("\n", "\n"),), negated=True)


def _literal(c: str) -> CharSet:
    return CharSet(ranges=((c, c),))


# -- parsing: pattern -> tree of ("set", CharSet) / ("cat", [..]) / ("alt", [..]) / ("rep", node, lo, hi)


# Groups nested deeper are refused: the parser and the NFA's construction recurse per level, so
# without a bound of its own whether a pattern compiles would depend on the interpreter's
# recursion limit (which torch.compile raises to 2000 in the process that compiles).
MAX_GROUP_DEPTH = 100


class _Parser:
    def __init__(self, pattern: str):
        self.p = pattern
        self.i = 0
        self.depth = 0  # groups open at self.i

    def error(self, what: str):
        # The pattern's head only: a generated one (a grammar's, a schema's) may be 200,000
        # characters long.
        shown = repr(self.p) if len(self.p) <= 200 else f"{self.p[:200]!r}... ({len(self.p)} chars)"
        return ValueError(f"regex {shown}: {what} (at {self.i})")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        c = self.peek()
        if c is None:
            raise self.error("unexpected end")
        self.i += 1
        return c

    def parse(self):
        node = self.alternation()
        if self.peek() is not None:
            raise self.error(f"unbalanced {self.peek()!r}")
        return self.anchored(node, True, True)

    def anchored(self, node, first: bool, last: bool):
        """`node` with its anchors gone, each checked to hold wherever it is met: ^ where nothing
        can come before it (first), $ where nothing can come after it (last) under fullmatch, as
        at the ends of each of the pattern's alternatives (^a$|^b$, (^a|b$)); elsewhere (a^b,
        (a$)?, a$b: re's ^ and $ assert a position there, not matched here) a ValueError."""
        kind = node[0]
        if kind in ("bol", "eol"):
            if not (first if kind == "bol" else last):
                self.i = node[1]
                raise self.error(f"{'^' if kind == 'bol' else '$'} is supported only where "
                                 f"nothing can come {'before' if kind == 'bol' else 'after'} it "
                                 f"(the start or end of the pattern, or of one of its "
                                 f"alternatives)")
            return ("cat", [])
        if kind == "alt":
            return ("alt", [self.anchored(n, first, last) for n in node[1]])
        if kind == "cat":
            items = node[1]
            lead = next((k for k, n in enumerate(items) if n[0] != "bol"), len(items))
            trail = len(items) - 1 - next(
                (k for k, n in enumerate(reversed(items)) if n[0] != "eol"), len(items))
            return ("cat", [self.anchored(n, first and k <= lead, last and k >= trail)
                            for k, n in enumerate(items)])
        if kind == "rep":
            return ("rep", self.anchored(node[1], False, False), node[2], node[3])
        return node

    def alternation(self):
        parts = [self.concatenation()]
        while self.peek() == "|":
            self.i += 1
            parts.append(self.concatenation())
        return parts[0] if len(parts) == 1 else ("alt", parts)

    def concatenation(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.repetition())
        return ("cat", items)

    def repetition(self):
        node = self.atom()
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and (bounds := self.braces()) is not None:
                lo, hi = bounds
            else:
                return node
            if self.peek() == "?":  # lazy: the same language
                self.i += 1
            elif self.peek() == "+":
                raise self.error("possessive quantifiers are not supported")
            if node[0] in ("rep", "bol", "eol") or node == ("cat", []):
                raise self.error("a quantifier needs something to repeat")
            node = ("rep", node, lo, hi)

    def braces(self):
        """{m}, {m,}, {m,n} at self.i, consumed; None (nothing consumed) where `{` is a literal,
        as in re."""
        end = self.p.find("}", self.i)
        if end < 0:
            return None
        body = self.p[self.i + 1:end]
        lo, comma, hi = body.partition(",")
        digits = lambda t: t != "" and all(ch in "0123456789" for ch in t)  # noqa: E731 (ASCII, as re)
        if not (digits(lo) or (comma and not lo)) or (hi and not digits(hi)):
            return None  # {,n} and {,} are quantifiers too (re: a missing m is 0)
        self.i = end + 1
        lo_n = int(lo) if lo else 0
        hi_n = int(hi) if hi else (None if comma else lo_n)
        if hi_n is not None and hi_n < lo_n:
            raise self.error(f"bad repetition {{{body}}}")
        return lo_n, hi_n

    def atom(self):
        c = self.take()
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith("?P<", self.i):
                end = self.p.find(">", self.i)
                if end < 0:
                    raise self.error("unterminated group name")
                self.i = end + 1
            elif self.peek() == "?":
                raise self.error("(?...) groups other than (?:...) and (?P<name>...) are not "
                                 "supported")
            self.depth += 1
            if self.depth > MAX_GROUP_DEPTH:
                raise self.error(f"groups nested too deep (more than {MAX_GROUP_DEPTH})")
            node = self.alternation()
            if self.peek() != ")":
                raise self.error("missing )")
            self.i += 1
            self.depth -= 1
            return node
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", ANY_BUT_NEWLINE)
        if c == "\\":
            return ("set", self.escape(in_class=False))
        if c in "^$":  # an anchor: checked where it stands once the whole pattern is read
            return ("bol" if c == "^" else "eol", self.i - 1)
        if c in "*+?":
            raise self.error(f"nothing to repeat with {c!r}")
        if c == ")":
            raise self.error("unbalanced )")
        return ("set", _literal(c))

    def escape(self, *, in_class: bool) -> CharSet:
        c = self.take()
        octal = "01234567"
        after = self.p[self.i:self.i + 2]
        if c == "0" or (c in octal and len(after) == 2 and all(d in octal for d in after)):
            # \0, \0o, \0oo and \ooo are octal (re's); other \N are back-references
            digits = c
            while len(digits) < 3 and self.peek() is not None and self.peek() in octal:
                digits += self.take()
            return _literal(chr(int(digits, 8)))
        if c.lower() in _CLASS_ESCAPES:
            return CharSet(classes=(c,))
        if c in _LITERAL_ESCAPES:
            return _literal(_LITERAL_ESCAPES[c])
        if c == "b" and in_class:
            return _literal("\b")
        if c in "xu":
            digits = 2 if c == "x" else 4
            code = self.p[self.i:self.i + digits]
            if len(code) != digits or any(d not in "0123456789abcdefABCDEF" for d in code):
                raise self.error(f"bad \\{c} escape")
            self.i += digits
            return _literal(chr(int(code, 16)))
        if c.isalnum():
            raise self.error(f"\\{c} is not supported")
        return _literal(c)

    def char_class(self) -> CharSet:
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges, classes = [], []
        first = True
        while True:
            c = self.take()
            if c == "]" and not first:
                break
            first = False
            if c == "\\":
                item = self.escape(in_class=True)
                if item.classes:
                    classes += item.classes
                    continue
                c = item.ranges[0][0]
            if self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.take()
                if hi == "\\":
                    item = self.escape(in_class=True)
                    if item.classes:
                        raise self.error("a class escape cannot end a range")
                    hi = item.ranges[0][0]
                if hi < c:
                    raise self.error(f"bad range {c}-{hi}")
                ranges.append((c, hi))
            else:
                ranges.append((c, c))
        return CharSet(ranges=tuple(ranges), classes=tuple(classes), negated=negated)


# -- NFA and lazy DFA ------------------------------------------------------------------------


@dataclass
class _NFA:
    eps: list[list[int]] = field(default_factory=list)
    edges: list[list[tuple[CharSet, int]]] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # the counts of the {m,n} being built

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            # named by its largest count: a JSON schema's maxLength / maxItems is one, and the
            # user never wrote the regex
            count = max(self.counts, default=0)
            why = (f": a repetition {{m,n}} is n copies of what it repeats, and one here counts "
                   f"to {count} (a JSON schema's maxLength, maxItems, minLength or minItems is "
                   f"written as one)") if count > 1 else ""
            raise ValueError(f"the regex expands to more than {MAX_NFA_STATES} states{why}")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node) -> tuple[int, int]:
        """(start, end) of a fragment that matches `node`."""
        kind = node[0]
        if kind == "set":
            s, e = self.state(), self.state()
            self.edges[s].append((node[1], e))
            return s, e
        if kind == "cat":
            s = e = self.state()
            for item in node[1]:
                a, b = self.build(item)
                self.eps[e].append(a)
                e = b
            return s, e
        if kind == "alt":
            s, e = self.state(), self.state()
            for item in node[1]:
                a, b = self.build(item)
                self.eps[s].append(a)
                self.eps[b].append(e)
            return s, e
        _, item, lo, hi = node
        self.counts.append(max(lo, hi or 0))
        try:
            return self._repeat(item, lo, hi)
        finally:
            self.counts.pop()

    def _repeat(self, item, lo: int, hi: int | None) -> tuple[int, int]:
        s = e = self.state()
        for _ in range(lo):
            a, b = self.build(item)
            self.eps[e].append(a)
            e = b
        if hi is None:  # item*: a loop
            a, b = self.build(item)
            self.eps[e].append(a)
            self.eps[b].append(a)
            end = self.state()
            self.eps[e].append(end)
            self.eps[b].append(end)
            return s, end
        end = self.state()
        for _ in range(hi - lo):  # each optional copy may end the repetition
            self.eps[e].append(end)
            a, b = self.build(item)
            self.eps[e].append(a)
            e = b
        self.eps[e].append(end)
        return s, end


class LazyDFA(abc.ABC):
    """A deterministic automaton over characters whose states are built as they are walked: each
    state's key (whatever a subclass computes states as) is interned to an int when first
    reached, and each move is computed once (_successor) and kept. `DEAD` (0): no accepted text
    goes on from it; `start`. RegexDFA and json_automaton.JsonObjectAutomaton share this."""

    DEAD = 0

    def __init__(self, start_key, dead_key=None):
        self._keys: list = [dead_key]
        self._ids: dict = {} if dead_key is None else {dead_key: self.DEAD}
        self._moves: list[dict[str, int]] = [{}]
        self.start = self._intern(start_key)

    @abc.abstractmethod
    def _successor(self, key, c: str):
        """The key of the state after character c from state `key` (never DEAD's), or None where
        nothing accepted goes on."""

    def _intern(self, key) -> int:
        sid = self._ids.get(key)
        if sid is None:
            sid = self._ids[key] = len(self._keys)
            self._keys.append(key)
            self._moves.append({})
        return sid

    def step(self, state: int, c: str) -> int:
        """The state after character c (DEAD when nothing accepted can follow)."""
        moves = self._moves[state]
        nxt = moves.get(c)
        if nxt is None:
            after = self._successor(self._keys[state], c) if state != self.DEAD else None
            nxt = moves[c] = self.DEAD if after is None else self._intern(after)
        return nxt

    @abc.abstractmethod
    def char_classes(self, state: int, codes: np.ndarray, chars: list[str],
                     escapes: dict) -> np.ndarray:
        """For each of `chars` (code points `codes`) a class id, such that characters of one
        class move from `state` to one state: the caller asks step() once a class.
        `escapes`: the caller's memo for CharSet.members."""

    def walk(self, state: int, text: str) -> int:
        for c in text:
            state = self.step(state, c)
            if state == self.DEAD:
                break
        return state

    @abc.abstractmethod
    def accepts(self, state: int) -> bool:
        """Whether the text that led to `state` is accepted."""

    def fullmatch(self, text: str) -> bool:
        return self.accepts(self.walk(self.start, text))


SHOWN_PATTERN_CHARS = 80  # an error quotes at most this much of a pattern (it may be 200,000)


def shown_pattern(pattern: str) -> str:
    """The pattern as an error message quotes it: repr'd, cut to its first SHOWN_PATTERN_CHARS
    characters (with the length it has) when longer."""
    if len(pattern) <= SHOWN_PATTERN_CHARS:
        return repr(pattern)
    return f"{pattern[:SHOWN_PATTERN_CHARS]!r}... ({len(pattern)} characters)"


def check_pattern_length(pattern: str, what: str = "the regex") -> None:
    """ValueError if `pattern` is longer than MAX_PATTERN_CHARS (before any parsing)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"{what} is too large: {len(pattern)} characters, more than "
                         f"{MAX_PATTERN_CHARS}")


def parse_pattern(pattern: str):
    """`pattern`'s tree as RegexDFA reads it, anchors gone (their places checked): ("set",
    CharSet), ("cat", [node, ..]), ("alt", [node, ..]) or ("rep", node, lo, hi) (hi None: no
    most). ValueError for what RegexDFA refuses. Public for runtime/schema_strings.py, which
    rewrites a JSON schema's pattern as a regex over its JSON text."""
    if not isinstance(pattern, str):
        raise ValueError(f"a regex is a string, got {type(pattern).__name__}")
    check_pattern_length(pattern)
    try:  # what re refuses is refused here too, with re's reason
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"regex {shown_pattern(pattern)}: {e}") from None
    except RecursionError:  # re's parser recurses per group: ~1,000 nested groups
        raise ValueError(f"regex {shown_pattern(pattern)}: nested too deep") from None
    try:
        return _Parser(pattern).parse()
    except RecursionError:
        raise ValueError(f"regex {shown_pattern(pattern)}: nested too deep") from None


class RegexDFA(LazyDFA):
    """The DFA of `pattern` under fullmatch, built as it is walked. A state is the set of NFA
    states it stands for (the empty set: DEAD)."""

    def __init__(self, pattern: str):
        tree = parse_pattern(pattern)
        self.pattern = pattern
        self._nfa = _NFA()
        try:
            start, self._final = self._nfa.build(tree)
        except RecursionError:
            raise ValueError(f"regex {shown_pattern(pattern)}: nested too deep") from None
        super().__init__(self._closure({start}), dead_key=frozenset())

    def _closure(self, states) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            for t in self._nfa.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)

    def _successor(self, states: frozenset[int], c: str) -> frozenset[int] | None:
        targets = {t for s in states for cs, t in self._nfa.edges[s] if c in cs}
        return self._closure(targets) if targets else None

    def charsets(self, state: int) -> list[CharSet]:
        """The character sets of the moves out of `state`."""
        return [cs for s in self._keys[state] for cs, _ in self._nfa.edges[s]]

    def char_classes(self, state: int, codes: np.ndarray, chars: list[str],
                     escapes: dict) -> np.ndarray:
        # A character's successor is the closure of the NFA moves whose sets hold it: which of
        # the state's sets hold it decides it.
        sets = list(dict.fromkeys(self.charsets(state)))
        if not sets:
            return np.zeros(len(codes), dtype=np.int64)
        held = np.stack([cs.members(codes, chars, escapes) for cs in sets], axis=1)
        if len(sets) < 63:  # the sets holding a character as the bits of one integer
            return held @ (np.int64(1) << np.arange(len(sets), dtype=np.int64))
        _, classes = np.unique(np.packbits(held, axis=1), axis=0, return_inverse=True)
        return classes.reshape(-1)

    def accepts(self, state: int) -> bool:
        return self._final in self._keys[state]

    def can_continue(self, state: int) -> bool:
        """Whether some character leads on from `state` (an accepting state may still)."""
        return any(self._nfa.edges[s] for s in self._keys[state])
