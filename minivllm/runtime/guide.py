"""Structured outputs (vLLM's `StructuredOutputsParams`: choice, regex, json, grammar,
json_object): each step a guided sequence may sample only the tokens that keep its output a
prefix of a string the constraint accepts, and EOS once its output is one.

The constraint becomes an automaton over characters: a regex's lazily built DFA
(runtime/regex_fsm.py; a choice is an alternation of its strings, a JSON schema a regex as
outlines builds one, for the subset `schema_regex` takes, a GBNF grammar without recursion the
regex of its rules inlined, runtime/gbnf.py), or for json_object a bounded pushdown
automaton (runtime/json_automaton.py) with the DFA's interface. Constraints are named by a key,
("regex", pattern) or ("json_object",) (`automaton` builds each). A guide state is the pair
(automaton state, the bytes of a character begun but not finished): tokens are walked as the
UTF-8 bytes they add to the text, so that a character split over several tokens (an emoji in a
byte-level BPE vocabulary) can be generated, each of its tokens allowed while some character the
automaton takes begins with the bytes so far. A state's allowed ids are computed when it is
first met, then kept: the whole vocabulary walked at once (CompiledGuide._text_allowed), the
automaton asked each move once per class of characters it moves alike (char_classes). Special
tokens are never allowed inside the output.
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from . import gbnf
from .json_automaton import JsonObjectAutomaton
from .reasoning import ANSWER, REASONING, UNDECIDED
from .regex_fsm import RegexDFA, check_pattern_length
from .schema_bounds import (BOUNDS, bounds_of, describe_bounds, holds, integer_bounds_regex,
                            number_bounds_regex)
from .schema_strings import string_regex

State = tuple[int, bytes]  # (automaton state, the bytes of an unfinished character)

# A constraint's key: ("regex", pattern) or JSON_OBJECT. Tuples of a kind and its argument, so
# that no regex's key is json_object's (a bare string key could be either).
ConstraintKey = tuple
JSON_OBJECT: ConstraintKey = ("json_object",)


def automaton(key: ConstraintKey):
    """The character automaton (RegexDFA's interface) of a constraint's key; ValueError for a
    pattern regex_fsm does not take."""
    if key == JSON_OBJECT:
        return JsonObjectAutomaton()
    if len(key) == 2 and key[0] == "regex":
        return RegexDFA(key[1])
    raise ValueError(f"no constraint is keyed {key!r:.80}")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (Qwen's tokenizer uses it): a token's characters -> its
    bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer, ids: list[int]) -> dict[int, bytes]:
    """Each id's bytes in the text: through the byte-level alphabet where the tokenizer decodes
    with it, `<0xHH>` byte-fallback pieces as their byte, and otherwise the text the token adds
    after another token (not alone: SentencePiece drops a lone token's leading space)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    out: dict[int, bytes] = {}
    rest = ids
    if decoder is not None and "ByteLevel" in repr(decoder):
        alphabet = _byte_decoder()
        rest = []
        for i, piece in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
            if piece and all(c in alphabet for c in piece):
                out[i] = bytes(alphabet[c] for c in piece)
            else:
                rest.append(i)
    fallback = re.compile(r"<0x([0-9A-Fa-f]{2})>")
    pieces = tokenizer.convert_ids_to_tokens(rest) if rest else []
    textual = []
    for i, piece in zip(rest, pieces):
        m = fallback.fullmatch(piece or "")
        if m:
            out[i] = bytes([int(m.group(1), 16)])
        else:
            textual.append(i)
    if textual:
        anchor = tokenizer.encode("a", add_special_tokens=False)[-1]
        head = tokenizer.decode([anchor])
        texts = tokenizer.batch_decode([[anchor, i] for i in textual], skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False)
        for i, t in zip(textual, texts):
            if t.startswith(head) and "\ufffd" not in t[len(head):]:
                out[i] = t[len(head):].encode()
    return {i: b for i, b in out.items() if b}


def split_utf8(data: bytes) -> tuple[str, bytes] | None:
    """data as (its whole characters, the bytes of a last one unfinished); None if it is not
    UTF-8 (a stray continuation byte, say)."""
    try:
        return data.decode(), b""
    except UnicodeDecodeError as e:
        if e.reason != "unexpected end of data" or e.end != len(data):
            return None
        try:
            return data[:e.start].decode(), data[e.start:]
        except UnicodeDecodeError:
            return None


def _code_points(prefix: bytes) -> tuple[int, int] | None:
    """The code points whose UTF-8 begins with `prefix` (an unfinished character), as a range."""
    lead = prefix[0]
    n = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 0
    if not n or len(prefix) >= n:
        return None
    value = lead & (0x7F >> n)
    for b in prefix[1:]:
        value = (value << 6) | (b & 0x3F)
    free = 6 * (n - len(prefix))
    lo, hi = value << free, ((value + 1) << free) - 1
    lo = max(lo, (0x80, 0x800, 0x10000)[n - 2])  # no overlong forms
    hi = min(hi, 0x10FFFF)
    return (lo, hi) if lo <= hi else None


class TokenIndex:
    """A tokenizer's vocabulary as the bytes each id adds to the text. `text`: the ids whose
    bytes are whole characters, by their text; `partial`: the others (part of a character), by
    their bytes. The text ids also as arrays, for CompiledGuide to walk all of them at once:
    `text_ids` longest text first (so that the ids still walking at character p are the first
    `longer[p]`), `codes` their characters' indices in `chars`, each id's from `offsets[j]`."""

    def __init__(self, tokenizer, vocab_size: int):
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        ids = [i for i in range(min(len(tokenizer), vocab_size)) if i not in special]
        self.bytes = token_bytes(tokenizer, ids)
        self.text: dict[int, str] = {}
        self.partial: list[tuple[int, bytes]] = []
        for i, b in self.bytes.items():
            split = split_utf8(b)
            if split is not None and not split[1]:
                self.text[i] = split[0]
            else:
                self.partial.append((i, b))
        longest_first = sorted(self.text.items(), key=lambda item: -len(item[1]))
        self.text_ids = np.array([i for i, _ in longest_first], dtype=np.int64)
        self.chars = sorted({c for _, t in longest_first for c in t})
        code = {c: k for k, c in enumerate(self.chars)}
        self.codes = np.array([code[c] for _, t in longest_first for c in t], dtype=np.int64)
        self.code_points = np.array([ord(c) for c in self.chars], dtype=np.int64)
        lengths = np.array([len(t) for _, t in longest_first], dtype=np.int64)
        self.offsets = np.cumsum(lengths) - lengths
        most = int(lengths[0]) if len(lengths) else 0
        self.longer = [int(n) for n in np.searchsorted(-lengths, -np.arange(most), side="left")]


class CompiledGuide:
    """A constraint's automaton over one TokenIndex, with the masks of the states met kept (the
    most recently used MAX_STATES of them: a string of maxLength n is n states). `constraint`: a
    regex, or a constraint's key (see `automaton`)."""

    MAX_STATES = 4096

    def __init__(self, constraint: str | ConstraintKey, index: TokenIndex,
                 eos_ids: tuple[int, ...]):
        self.fsm = automaton(("regex", constraint) if isinstance(constraint, str) else constraint)
        self.index = index
        self.eos_ids = tuple(eos_ids)
        self.start: State = (self.fsm.start, b"")
        self._bits: OrderedDict[State, np.ndarray | None] = OrderedDict()  # bits(), by state
        self._begins: dict[tuple[int, bytes], bool] = {}
        # an automaton state's moves on index.chars; the class escapes' members among them
        self._rows: dict[int, np.ndarray] = {}
        self._escapes: dict[str, np.ndarray] = {}

    def _can_begin(self, s: int, prefix: bytes) -> bool:
        """Whether some character the DFA takes at state s begins with these bytes."""
        key = (s, prefix)
        ok = self._begins.get(key)
        if ok is None:
            span = _code_points(prefix)
            ok = span is not None and any(cs.meets(*span) for cs in self.fsm.charsets(s))
            self._begins[key] = ok
        return ok

    def walk(self, state: State | None, data: bytes) -> State | None:
        """The state after the bytes `data`; None where no accepted text goes that way."""
        if state is None:
            return None
        s, pending = state
        split = split_utf8(pending + data)
        if split is None:
            return None
        s = self.fsm.walk(s, split[0])
        if s == self.fsm.DEAD or (split[1] and not self._can_begin(s, split[1])):
            return None
        return s, split[1]

    def accepts(self, state: State) -> bool:
        return not state[1] and self.fsm.accepts(state[0])

    def _allowed(self, state: State) -> np.ndarray:
        """The ids that may follow at `state`, sorted: those that keep the output a prefix of an
        accepted string, and the EOS ids where it is one (only them where nothing may follow).
        The EOS ids too where no token leads on (a constraint no token can spell), so that the
        sequence ends."""
        fsm, (s, pending), out = self.fsm, state, []
        if not pending and fsm.can_continue(s):
            out.append(self._text_allowed(s))
        if pending or fsm.can_continue(s):
            out.append(np.array([i for i, b in self.index.partial
                                 if self.walk(state, b) is not None], dtype=np.int64))
        if self.accepts(state) or not sum(len(ids) for ids in out):
            out.append(np.array(self.eos_ids, dtype=np.int64))
        ids = np.concatenate(out)
        if not ids.size:  # nothing leads on and no EOS id to end with
            return ids
        marked = np.zeros(int(ids.max()) + 1, dtype=bool)  # sorted and unique without a sort
        marked[ids] = True
        return np.flatnonzero(marked)

    # States whose moves are kept: a row is 4 bytes a character of the vocabulary (~100 KB at
    # 25,000 characters), a server keeps 64 compiled guides, and a row is rebuilt in ~1 ms.
    MAX_ROWS = 64

    def _text_allowed(self, s: int) -> np.ndarray:
        """The text ids whose characters the automaton walks from state s without dying. All
        ids at once, character by character over those still walking: one walk an id in Python
        was ~70-140 ms a state over a 151,000-id vocabulary (session 62), paid the first time a
        sequence reaches the state, with every sequence of the batch waiting."""
        index, dead = self.index, self.fsm.DEAD
        states = np.full(len(index.text_ids), s, dtype=np.int64)
        live = np.arange(len(index.text_ids))  # ascending: the ids still walking, a prefix cut
        for p, walking in enumerate(index.longer):
            live = live[:np.searchsorted(live, walking)]  # those with a character p
            if not live.size:
                break
            after = self._moves(states[live], index.codes[index.offsets[live] + p])
            states[live] = after
            live = live[after != dead]
        return index.text_ids[states != dead]

    def _moves(self, states: np.ndarray, chars: np.ndarray) -> np.ndarray:
        """The automaton's state after index.chars[chars[j]] from states[j], for every j."""
        distinct = np.flatnonzero(np.bincount(states))
        where = np.zeros(int(distinct[-1]) + 1, dtype=np.int64)
        where[distinct] = np.arange(len(distinct))
        table = np.stack([self._row(int(u)) for u in distinct])  # [distinct states, chars]
        return table[where[states], chars]

    def _row(self, state: int) -> np.ndarray:
        """The state's move on each of index.chars: step() asked once for each class of
        characters the automaton moves alike (char_classes), not once a character (the
        vocabulary of Qwen3's tokenizer holds thousands)."""
        row = self._rows.get(state)
        if row is None:
            index = self.index
            classes = self.fsm.char_classes(state, index.code_points, index.chars, self._escapes)
            _, first, inverse = np.unique(classes, return_index=True, return_inverse=True)
            after = np.array([self.fsm.step(state, index.chars[j]) for j in first.tolist()],
                             dtype=np.int32)
            if len(self._rows) >= self.MAX_ROWS:
                self._rows.clear()  # the automaton keeps its moves: rows are rebuilt cheaply
            row = self._rows[state] = after[inverse.reshape(-1)]
        return row

    def mask(self, state: State, vocab_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(allowed, banned): the allowed ids as one of the two, the shorter, the other empty
        (inside a JSON string nearly every id is allowed). A state's constraint as id lists, for
        reading it (tests, benchmarks); computed anew each call: the engine's rows take bits(),
        which keeps them."""
        allowed = self._allowed(state)
        if len(allowed) <= vocab_size // 2:
            return tuple(allowed.tolist()), ()
        banned = np.ones(vocab_size, dtype=bool)
        banned[allowed[allowed < vocab_size]] = False
        return (), tuple(np.flatnonzero(banned).tolist())

    def bits(self, state: State, vocab_size: int) -> np.ndarray | None:
        """The allowed ids as a packed bitmask (pack_ids: ~19 KB at a 151,936-id vocabulary, a
        copy for the sampling batch every step, where mask's ids are chained an id at a time),
        read-only; None where no id is allowed (as mask's two empty lists: no restriction)."""
        if state in self._bits:
            self._bits.move_to_end(state)
            return self._bits[state]
        allowed = self._allowed(state)
        bits = pack_ids(allowed, vocab_size) if (allowed < vocab_size).any() else None
        if bits is not None:
            bits.flags.writeable = False
        self._bits[state] = bits
        if len(self._bits) > self.MAX_STATES:
            self._bits.popitem(last=False)
        return bits

    def allowed(self, state: State, vocab_size: int) -> tuple[int, ...]:
        """The ids that may follow at `state` (see mask), as one list."""
        allowed, banned = self.mask(state, vocab_size)
        if allowed:
            return allowed
        bans = set(banned)
        return tuple(i for i in range(vocab_size) if i not in bans)


class Guide:
    """One sequence's place in its constraint: the state its generated ids lead to. With a
    reasoning parser (runtime/reasoning.py) the constraint starts after the reasoning: `phase`
    is where the completion starts (ThinkTags.prompt_phase), `tags` the ThinkTags; nothing is
    constrained inside the reasoning, and an undecided start also allows <think>."""

    def __init__(self, compiled: CompiledGuide, phase: str = ANSWER, tags=None):
        if phase != ANSWER and tags is None:
            raise ValueError("a guide that starts before the answer needs the reasoning tags")
        self.compiled = compiled
        self.state: State = compiled.start
        self.consumed = 0
        self.phase, self.tags = phase, tags

    def advance(self, output_ids: list[int]) -> State:
        """The state after `output_ids` (the sequence's generated ids; those not seen before
        are walked)."""
        data = self.compiled.index.bytes
        for token in output_ids[self.consumed:]:
            if self.phase == UNDECIDED:
                self.phase = REASONING if token == self.tags.start else ANSWER
            if self.phase == REASONING:
                if token == self.tags.end:
                    self.phase = ANSWER
                continue
            b = data.get(token)  # None: EOS or another id the constraint ends with
            if b is not None:
                # A token the sampler could not but take (nothing allowed was left): the
                # state stays, the constraint cannot be met past it.
                self.state = self.compiled.walk(self.state, b) or self.state
        self.consumed = len(output_ids)
        return self.state

    def bits(self, output_ids: list[int], vocab_size: int) -> np.ndarray | None:
        """CompiledGuide.bits after `output_ids` (None: no restriction, as inside the
        reasoning); an undecided start also allows <think>."""
        state = self.advance(output_ids)
        if self.phase == REASONING:
            return None
        bits = self.compiled.bits(state, vocab_size)
        start = self.tags.start if self.phase == UNDECIDED else None
        if bits is not None and start is not None and start < vocab_size:
            bits = bits.copy()
            bits[start >> 3] |= 1 << (start & 7)
        return bits


def pack_ids(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """The ids below vocab_size as a packed bitmask: uint8 [ceil(vocab_size / 8)], id i at bit
    i % 8 of byte i // 8 (numpy's little bit order; functional.penalties unpacks it so)."""
    mask = np.zeros(vocab_size, dtype=bool)
    ids = np.asarray(ids, dtype=np.int64)
    mask[ids[ids < vocab_size]] = True
    return np.packbits(mask, bitorder="little")


def bits_constraint(bits: np.ndarray | None, allowed: Sequence[int]
                    ) -> tuple[np.ndarray | None, Sequence[int]]:
    """A sampling row's (allowed_bits, allowed_ids) with a guide's bitmask over the request's
    own allowed_token_ids: the allowed ids inside the constraint where any is, else the
    constraint alone (it wins: an empty allowed list would allow everything)."""
    if bits is None or not len(allowed):
        return bits, allowed
    inside = tuple(i for i in allowed if i < 8 * len(bits) and bits[i >> 3] >> (i & 7) & 1)
    return (None, inside) if inside else (bits, ())


class GuideCache:
    """Compiled constraints by key (a regex stands for its key ("regex", regex)), the most
    recently used kept (a server's requests often repeat one)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, size: int = 64):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, tuple(eos_ids)
        self.size = size
        self._index: TokenIndex | None = None
        self._compiled: OrderedDict[ConstraintKey, CompiledGuide] = OrderedDict()

    def get(self, constraint: str | ConstraintKey) -> CompiledGuide:
        """ValueError for a pattern regex_fsm does not take."""
        key = ("regex", constraint) if isinstance(constraint, str) else tuple(constraint)
        compiled = self._compiled.get(key)
        if compiled is None:
            if self._index is None:
                self._index = TokenIndex(self.tokenizer, self.vocab_size)
            compiled = CompiledGuide(key, self._index, self.eos_ids)
            self._compiled[key] = compiled
            if len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return compiled


# -- constraints as regexes --------------------------------------------------------------------

WHITESPACE = r"[ ]?"  # between JSON tokens: at most one space (outlines' default)
_STRING_CHAR = r'(?:[^"\\\x00-\x1f\x7f]|\\["\\/bfnrt])'
_INTEGER = r"-?(?:0|[1-9][0-9]*)"
_NUMBER = _INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"


def grammar_regex(grammar) -> str:
    """The regex of a GBNF grammar (vLLM's `grammar`, in xgrammar's syntax): its root rule with
    every rule it refers to written in place (runtime/gbnf.py). ValueError for a malformed or a
    recursive grammar, named by its line and column or its rule cycle, before any regex is
    built."""
    return gbnf.grammar_regex(grammar)


def choice_regex(choices) -> str:
    if not isinstance(choices, (list, tuple)) or not choices or \
            not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"choice must be a non-empty list of non-empty strings, got {choices!r:.80}")
    return "|".join(re.escape(c) for c in choices)


# Keywords that hold an output to nothing: "discriminator" (OpenAPI's, pydantic writes it beside
# a tagged union's oneOf) only names the property whose const already tells the branches apart.
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
                "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "discriminator"}
_KEYWORDS = {  # what each kind of schema may say here; any other keyword is refused
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": set(BOUNDS), "number": set(BOUNDS), "boolean": set(), "null": set(),
    "array": {"items", "minItems", "maxItems"},
    "object": {"properties", "required", "additionalProperties"},
}
_PYTHON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
                 "null": type(None), "array": list, "object": dict}


def _of_type(value, kind: str) -> bool:
    """Whether a JSON value is of a JSON Schema type: booleans are no numbers, and an integer
    is a number whose fraction is zero (JSON Schema's, from draft 6: 1.0 is the integer 1)."""
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()  # False for inf / nan too
    return isinstance(value, _PYTHON_TYPES.get(kind, ()))


def _count(schema: dict, key: str, default):
    value = schema.get(key, default)
    if value is not default and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"JSON schema {key} must be an integer >= 0, got {value!r}")
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def _literal(value) -> str:
    """The regex of one JSON text: `value` as json.dumps writes it, a string's characters as
    themselves (an e-acute as itself, not as \\u00e9: as xgrammar writes them, and as a model
    would) but for JSON's escapes and lone surrogates (no UTF-8 text spells one:
    \\ud800-\\udfff)."""
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError):
        raise ValueError(f"JSON schema value {value!r:.60} is not JSON") from None
    return re.escape(_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text))


def _json_equal(a, b) -> bool:
    """Whether two JSON values are equal as JSON Schema compares them (const against enum):
    numbers by value (1 is 1.0), booleans only to booleans (true is not 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _check_keywords(schema: dict, allowed: set, where: str) -> None:
    extra = sorted(set(schema) - allowed - _ANNOTATIONS)
    if extra:
        raise ValueError(f"JSON schema {where}: {extra} not supported (supported: type, enum, "
                         f"const, anyOf, oneOf, a one-schema allOf, $ref, and per type "
                         f"{ {k: sorted(v) for k, v in _KEYWORDS.items() if v} })")


def _resolve(ref, defs: dict) -> dict:
    """The schema a local $ref names: #/$defs/NAME or #/definitions/NAME, NAME a JSON pointer's
    token in a URI fragment (percent-escapes decoded, then ~1 is / and ~0 is ~)."""
    for prefix, section in defs.items():
        if isinstance(ref, str) and ref.startswith(prefix) and "/" not in ref[len(prefix):]:
            name = urllib.parse.unquote(ref[len(prefix):]).replace("~1", "/").replace("~0", "~")
            if name in section:
                return section[name]
    raise ValueError(f"JSON schema $ref {ref!r:.80}: only local #/$defs/NAME (or "
                     f"#/definitions/NAME) refs to a schema there are taken")


def schema_regex(schema, defs: dict | None = None, depth: int = 0) -> str:
    """schema's regex (_schema_regex), ValueError once any part of it is longer than
    regex_fsm.MAX_PATTERN_CHARS: nested properties multiply (4 $refs a level over 12 levels
    would write 4^12 copies of the innermost schema), so each part is checked as it is built."""
    pattern = _schema_regex(schema, defs, depth)
    check_pattern_length(pattern, "the JSON schema's regex")
    return pattern


def _schema_regex(schema, defs: dict | None = None, depth: int = 0) -> str:
    """A regex for the JSON texts `schema` admits, for a subset of JSON Schema: types string
    (minLength / maxLength; pattern or format, see runtime/schema_strings.py), integer and
    number (minimum, maximum, exclusiveMinimum, exclusiveMaximum: exactly the texts within
    them, a bounded number without exponent, as xgrammar writes it), boolean, null, array
    (items, minItems / maxItems), object (its properties, every one written, in order;
    additionalProperties false, true or a schema, as only the listed ones are written; empty
    properties: {}), enum, const (an integer's 1.0 is 1, written so; bounds beside them keep the
    values within), anyOf, oneOf (as anyOf), a one-schema allOf, a list of types, and local $ref
    to $defs / definitions; annotations (title, description, discriminator, ...) are ignored.
    Any other keyword is a ValueError that names it (multipleOf, uniqueItems, ...: an output
    would not be held to it), as is an object without properties (any JSON object is not a
    regular language)."""
    if depth > 32:
        raise ValueError("the JSON schema nests too deep (a recursive $ref?)")
    if schema is True:  # JSON Schema's "anything", as {}: any JSON value is no regular language
        raise ValueError("JSON schema true (any JSON value) is not supported: give a type, "
                         "enum, const, anyOf or $ref")
    if schema is False:
        raise ValueError("JSON schema false admits no value")
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is an object, got {schema!r:.80}")
    if defs is None:  # each $ref's own place: #/$defs/A is not #/definitions/A
        for key in ("definitions", "$defs"):
            if not isinstance(schema.get(key, {}), dict):
                raise ValueError(f"JSON schema {key} must be an object of named schemas, got "
                                 f"{schema[key]!r:.60}")
        defs = {f"#/{key}/": schema.get(key, {}) for key in ("$defs", "definitions")}
    sub = lambda s: schema_regex(s, defs, depth + 1)  # noqa: E731
    if "$ref" in schema:
        _check_keywords(schema, {"$ref"}, "$ref")
        return sub(_resolve(schema["$ref"], defs))
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [] if kind is None else [kind]
    if "type" in schema and (not kinds or not all(isinstance(k, str) and k in _KEYWORDS
                                                  for k in kinds)):
        raise ValueError(f"JSON schema type {kind!r:.60} is no JSON type or list of them "
                         f"(string, integer, number, boolean, null, array, object)")
    if "const" in schema or "enum" in schema:
        _check_keywords(schema, {"const", "enum", "type", *BOUNDS}, "enum / const")
        values = schema.get("enum", [])
        if "enum" in schema and (not isinstance(values, list) or not values):
            raise ValueError("JSON schema enum must be a non-empty list")
        if "const" in schema:  # with an enum too, the value must be among its values
            const = schema["const"]
            if "enum" in schema and not any(_json_equal(const, v) for v in values):
                raise ValueError(f"JSON schema const {const!r:.60} is not among the enum "
                                 f"values {values!r:.60}: no value is admitted")
            values = [const]
        if kinds and not all(any(_of_type(v, k) for k in kinds) for v in values):
            raise ValueError(f"JSON schema enum / const values {values!r:.60} are not all of "
                             f"type {kind}")
        bounds = bounds_of(schema)  # numbers beyond them are no values of the schema
        kept = [v for v in values if not _of_type(v, "number") or
                isinstance(v, float) and not math.isfinite(v) or  # refused as no JSON below
                all(holds(v, key, b) for key, b in bounds.items())]
        if not kept:
            raise ValueError(f"JSON schema enum / const values {values!r:.60} are all outside "
                             f"{describe_bounds(bounds)}: no value is admitted")
        values = kept
        if "integer" in kinds:  # 1.0 of an integer enum written 1 (a draft 4 integer too),
            # where the float is that integer exactly (1e30 is not 10**30: written 1e+30)
            values = [int(v) if isinstance(v, float) and v.is_integer() and abs(v) <= 2 ** 53
                      else v for v in values]
        return "(?:" + "|".join(_literal(v) for v in values) + ")"
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            _check_keywords(schema, {key}, key)
            options = schema[key]
            if not isinstance(options, list) or not options or (key == "allOf" and len(options) != 1):
                raise ValueError(f"JSON schema {key} must be a non-empty list"
                                 + (" of one schema here" if key == "allOf" else ""))
            return "(?:" + "|".join(sub(s) for s in options) + ")"
    if isinstance(kind, list):
        _check_keywords(schema, set().union(*(_KEYWORDS[k] for k in kind)) | {"type"},
                        f"type {kind}")
        # Each type with its own keywords ({"type": ["string", "null"], "maxLength": 5}).
        return "(?:" + "|".join(sub({key: v for key, v in schema.items()
                                     if key in _KEYWORDS[k] or key in _ANNOTATIONS} | {"type": k})
                                for k in kind) + ")"
    if kind is None and "properties" in schema:
        kind = "object"
    if kind not in _KEYWORDS:
        raise ValueError(f"JSON schema {schema!r:.80}: give a type (string, integer, number, "
                         f"boolean, null, array, object), enum, const, anyOf or $ref")
    _check_keywords(schema, _KEYWORDS[kind] | {"type"}, kind)
    if kind == "string":
        lo, hi = _count(schema, "minLength", 0), _count(schema, "maxLength", None)
        if hi is not None and hi < lo:
            raise ValueError(f"JSON schema maxLength {hi} < minLength {lo}")
        if "pattern" in schema or "format" in schema:
            return string_regex(schema, lo, hi)
        return f'"{_STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'
    if kind in ("integer", "number"):
        bounds = bounds_of(schema)
        if not bounds:
            return _INTEGER if kind == "integer" else _NUMBER
        return (integer_bounds_regex if kind == "integer" else number_bounds_regex)(bounds)
    if kind == "boolean":
        return "(?:true|false)"
    if kind == "null":
        return "null"
    if kind == "array":
        item = sub(schema.get("items", {"type": "string"}))
        lo, hi = _count(schema, "minItems", 0), _count(schema, "maxItems", None)
        if hi is not None and hi < lo:
            raise ValueError(f"JSON schema maxItems {hi} < minItems {lo}")
        if hi == 0:
            return rf"\[{WHITESPACE}\]"
        more = f"(?:{WHITESPACE},{WHITESPACE}{item}){{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
        items = f"{item}{more}"
        return rf"\[{WHITESPACE}" + (items if lo > 0 else f"(?:{items})?") + rf"{WHITESPACE}\]"
    props = schema.get("properties")
    if not isinstance(props, dict):
        raise ValueError("JSON schema objects need 'properties' (any JSON object is not a "
                         "regular language)")
    # Only the listed properties are written: any additionalProperties holds (a schema too).
    if not isinstance(schema.get("additionalProperties", False), (bool, dict)):
        raise ValueError(f"JSON schema additionalProperties must be true, false or a schema, "
                         f"got {schema['additionalProperties']!r:.60}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"JSON schema required must be a list of property names, got "
                         f"{required!r:.60}")
    if not props:  # {"properties": {}}: the empty object (a function without arguments)
        if schema.get("required"):
            raise ValueError(f"JSON schema required {schema['required']} are not among the "
                             f"properties")
        return rf"\{{{WHITESPACE}\}}"
    missing = sorted(set(schema.get("required", ())) - set(props))
    if missing:
        raise ValueError(f"JSON schema required {missing} are not among the properties")
    fields = [f"{WHITESPACE}{_literal(name)}{WHITESPACE}:{WHITESPACE}{sub(s)}"
              for name, s in props.items()]
    return r"\{" + ",".join(fields) + rf"{WHITESPACE}\}}"
