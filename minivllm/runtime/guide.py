"""Structured outputs (vLLM's `StructuredOutputsParams`: choice, regex, json): each step a guided
sequence may sample only the tokens that keep its output a prefix of a string the constraint
accepts, and EOS once its output is one.

The constraint becomes a regex (a choice is an alternation of its strings; a JSON schema becomes
a regex as outlines builds one, for the subset `schema_regex` takes), the regex a lazily built
DFA over characters (runtime/regex_fsm.py), and a DFA state the set of vocabulary ids whose text
walks it without dying (computed when the state is first met, then kept). A token's text is its
own decoding; tokens whose text is not whole characters (a byte-level BPE token holding part of a
UTF-8 character) and special tokens are never allowed inside the output, which keeps the text
exactly the concatenation of the tokens' texts, so that it matches the constraint.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict, defaultdict

from .regex_fsm import RegexDFA


class TokenIndex:
    """A tokenizer's vocabulary as texts: the ids whose text the DFA walks, grouped by their
    first character (one DFA step rules a whole group out)."""

    def __init__(self, tokenizer, vocab_size: int):
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        ids = [i for i in range(min(len(tokenizer), vocab_size)) if i not in special]
        texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False)
        self.text: dict[int, str] = {}
        self.by_first: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for i, t in zip(ids, texts):
            if t and "\ufffd" not in t:
                self.text[i] = t
                self.by_first[t[0]].append((i, t[1:]))


class CompiledGuide:
    """A constraint's DFA over one TokenIndex, with each state's allowed ids kept."""

    def __init__(self, pattern: str, index: TokenIndex, eos_ids: tuple[int, ...]):
        self.fsm = RegexDFA(pattern)
        self.index = index
        self.eos_ids = tuple(eos_ids)
        self._allowed: dict[int, tuple[int, ...]] = {}
        self._masks: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def allowed(self, state: int) -> tuple[int, ...]:
        """The ids that may follow at `state`: those that keep the output a prefix of an
        accepted string, and the EOS ids where it is one (only them where nothing may follow).
        The EOS ids too where no token leads on (a constraint no token can spell), so that the
        sequence ends."""
        ids = self._allowed.get(state)
        if ids is None:
            fsm, out = self.fsm, []
            if state != fsm.DEAD and fsm.can_continue(state):
                for first, group in self.index.by_first.items():
                    after = fsm.step(state, first)
                    if after == fsm.DEAD:
                        continue
                    out += [i for i, rest in group if not rest or fsm.walk(after, rest) != fsm.DEAD]
            if fsm.accepts(state) or not out:
                out += self.eos_ids
            ids = self._allowed[state] = tuple(sorted(set(out)))
        return ids


    def mask(self, state: int, vocab_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(allowed, banned): the allowed ids as one of the two, the shorter, the other empty
        (inside a JSON string nearly every id is allowed: its few banned ones are the cheaper
        row for the sampler to build)."""
        masks = self._masks.get(state)
        if masks is None:
            allowed = self.allowed(state)
            if len(allowed) <= vocab_size // 2:
                masks = (allowed, ())
            else:
                keep = set(allowed)
                masks = ((), tuple(i for i in range(vocab_size) if i not in keep))
            self._masks[state] = masks
        return masks


class Guide:
    """One sequence's place in its constraint: the DFA state its generated ids lead to."""

    def __init__(self, compiled: CompiledGuide):
        self.compiled = compiled
        self.state = compiled.fsm.start
        self.consumed = 0

    def advance(self, output_ids: list[int]) -> int:
        """The state after `output_ids` (the sequence's generated ids; those not seen before
        are walked)."""
        fsm, texts = self.compiled.fsm, self.compiled.index.text
        for token in output_ids[self.consumed:]:
            text = texts.get(token)  # None: EOS or another id the constraint ends with
            if text is not None:
                self.state = fsm.walk(self.state, text)
        self.consumed = len(output_ids)
        return self.state

    def allowed(self, output_ids: list[int]) -> tuple[int, ...]:
        """The ids the next token may be, after `output_ids`."""
        return self.compiled.allowed(self.advance(output_ids))

    def mask(self, output_ids: list[int], vocab_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """CompiledGuide.mask after `output_ids`."""
        return self.compiled.mask(self.advance(output_ids), vocab_size)


def row_constraint(guided: tuple[int, ...], guide_bans: tuple[int, ...],
                   allowed: tuple[int, ...], banned: tuple[int, ...]
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A sampling row's (allowed_ids, banned_ids) with a guide's mask ((guided, guide_bans),
    CompiledGuide.mask) over the request's own: the constraint within allowed_token_ids, the
    constraint alone where the two share no id (it wins: an empty allowed list would allow
    everything); min_tokens' EOS ban lifted where only EOS may follow (the output is complete)."""
    if guided and banned and set(guided) <= set(banned):
        banned = tuple(i for i in banned if i not in guided)
    if guided:
        both = tuple(sorted(set(guided) & set(allowed))) if allowed else ()
        return both or guided, banned
    if allowed:
        bans = set(guide_bans)
        both = tuple(i for i in allowed if i not in bans)
        if both:
            return both, banned
    return (), banned + guide_bans


class GuideCache:
    """Compiled constraints by regex, the most recently used kept (a server's requests often
    repeat one)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, size: int = 64):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, tuple(eos_ids)
        self.size = size
        self._index: TokenIndex | None = None
        self._compiled: OrderedDict[str, CompiledGuide] = OrderedDict()

    def get(self, pattern: str) -> CompiledGuide:
        """ValueError for a pattern regex_fsm does not take."""
        compiled = self._compiled.get(pattern)
        if compiled is None:
            if self._index is None:
                self._index = TokenIndex(self.tokenizer, self.vocab_size)
            compiled = CompiledGuide(pattern, self._index, self.eos_ids)
            self._compiled[pattern] = compiled
            if len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(pattern)
        return compiled


# -- constraints as regexes --------------------------------------------------------------------

WHITESPACE = r"[ ]?"  # between JSON tokens: at most one space (outlines' default)
_STRING_CHAR = r'(?:[^"\\\x00-\x1f\x7f]|\\["\\/bfnrt])'
_INTEGER = r"-?(?:0|[1-9][0-9]*)"
_NUMBER = _INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"


def choice_regex(choices) -> str:
    if not isinstance(choices, (list, tuple)) or not choices or \
            not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"choice must be a non-empty list of non-empty strings, got {choices!r:.80}")
    return "|".join(re.escape(c) for c in choices)


def schema_regex(schema, defs: dict | None = None, depth: int = 0) -> str:
    """A regex for the JSON texts `schema` admits, for a subset of JSON Schema: types string
    (enum, const, minLength / maxLength, pattern), integer, number, boolean, null, array (items,
    minItems / maxItems), object (its properties, every one written, in order), anyOf / oneOf,
    a list of types, and local $ref to $defs / definitions. ValueError names what is not taken
    (an object without properties, say: any JSON object is not a regular language)."""
    if depth > 32:
        raise ValueError("the JSON schema nests too deep (a recursive $ref?)")
    if isinstance(schema, bool) or not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is an object, got {schema!r:.80}")
    if defs is None:
        defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    sub = lambda s: schema_regex(s, defs, depth + 1)  # noqa: E731
    if "$ref" in schema:
        ref = schema["$ref"]
        name = ref.rsplit("/", 1)[-1]
        if not isinstance(ref, str) or not ref.startswith(("#/$defs/", "#/definitions/")) or \
                name not in defs:
            raise ValueError(f"JSON schema $ref {ref!r}: only local #/$defs/... refs are taken")
        return sub(defs[name])
    if "const" in schema:
        return re.escape(json.dumps(schema["const"]))
    if "enum" in schema:
        return "(?:" + "|".join(re.escape(json.dumps(v)) for v in schema["enum"]) + ")"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return "(?:" + "|".join(sub(s) for s in schema[key]) + ")"
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return sub(schema["allOf"][0])
    kind = schema.get("type")
    if isinstance(kind, list):
        return "(?:" + "|".join(sub({**schema, "type": k}) for k in kind) + ")"
    if kind == "string":
        if "pattern" in schema:
            return '"(?:' + schema["pattern"].removeprefix("^").removesuffix("$") + ')"'
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        return f'"{_STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'
    if kind == "integer":
        return _INTEGER
    if kind == "number":
        return _NUMBER
    if kind == "boolean":
        return "(?:true|false)"
    if kind == "null":
        return "null"
    if kind == "array":
        item = sub(schema.get("items", {"type": "string"}))
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if hi == 0:
            return rf"\[{WHITESPACE}\]"
        more = f"(?:{WHITESPACE},{WHITESPACE}{item}){{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
        items = f"{item}{more}"
        return rf"\[{WHITESPACE}" + (items if lo > 0 else f"(?:{items})?") + rf"{WHITESPACE}\]"
    if kind == "object" or "properties" in schema:
        props = schema.get("properties")
        if not props:
            raise ValueError("JSON schema objects need 'properties' (any JSON object is not a "
                             "regular language)")
        fields = [f"{WHITESPACE}{re.escape(json.dumps(name))}{WHITESPACE}:{WHITESPACE}{sub(s)}"
                  for name, s in props.items()]
        return r"\{" + ",".join(fields) + rf"{WHITESPACE}\}}"
    raise ValueError(f"JSON schema {schema!r:.80}: not a schema this server turns into a regex")
