"""Session 51's mutation round (dbg/s51/mut_report.md): behaviour of the new modules that no other
test pinned down. Each test checks against an expectation of its own (brute force over code
points, Python's re and json, transformers, hand-built vocabularies and scripted models), not
against outputs of the code under test."""

from __future__ import annotations

import json
import math
import random
import re

import numpy as np
import pytest
import torch

from minivllm.runtime import guide as guide_mod
from minivllm.runtime import openai_api as api
from minivllm.runtime.beam_search import beam_search
from minivllm.runtime.guide import (CompiledGuide, Guide, GuideCache, TokenIndex, _code_points,
                                    schema_regex, token_bytes)
from minivllm.runtime.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.runtime.regex_fsm import CharSet, RegexDFA
from minivllm.runtime.sampling_params import StructuredOutputsParams

from hf_tiny import hf_config

# -- regex_fsm ----------------------------------------------------------------------------------


def _brute_meets(cs: CharSet, lo: int, hi: int) -> bool:
    return any(chr(c) in cs for c in range(lo, hi + 1) if not 0xD800 <= c <= 0xDFFF)


def test_charset_meets_equals_a_walk_of_its_code_points():
    """meets(lo, hi) (whether some character of lo..hi is in the set; the guide asks it of the
    code points a partial UTF-8 character may still become) against a test of each one."""
    rng = random.Random(51)
    for region in ((0x20, 0x80), (0xB0, 0x130)):
        for _ in range(1500):
            ranges = []
            for _ in range(rng.randint(0, 3)):
                a = rng.randint(*region)
                b = min(a + rng.choice([0, 0, 1, 3, 10, 40]), region[1])
                ranges.append((chr(a), chr(b)))
            classes = tuple(rng.sample("dwsDWS", rng.choice([0, 0, 1]))) if region[0] < 0x80 else ()
            cs = CharSet(ranges=tuple(ranges), classes=classes, negated=rng.random() < 0.5)
            lo = rng.randint(*region)
            hi = min(lo + rng.choice([0, 1, 2, 5, 30, 90]), region[1])
            assert cs.meets(lo, hi) == _brute_meets(cs, lo, hi), (cs, lo, hi)
    # The edges, one by one: a range ending at the span's top, a negation that covers all of it
    # (in two overlapping pieces), a class that holds only the span's last code point.
    assert CharSet(ranges=(("\xff", "\xff"),)).meets(0xC0, 0xFF)
    assert not CharSet(ranges=(("\xc0", "\xff"),), negated=True).meets(0xC0, 0xFF)
    assert not CharSet(ranges=(("\xc0", "\xf0"), ("\xd0", "\xd0"), ("\xe0", "\xff")),
                       negated=True).meets(0xC0, 0xFF)
    assert CharSet(ranges=(("\xc0", "\xfe"),), negated=True).meets(0xC0, 0xFF)
    assert CharSet(classes=("d",)).meets(0x2F, 0x30)


@pytest.mark.parametrize("pattern, texts", [
    ("[]a]+", ["]", "a", "]a]", "", "b", "[]"]),  # re: a ] first in a class is a literal
    ("[^]a]", ["]", "a", "b", ""]),
])
def test_patterns_as_re_reads_them(pattern, texts):
    dfa = RegexDFA(pattern)
    for text in texts:
        assert dfa.fullmatch(text) == bool(re.fullmatch(pattern, text)), (pattern, text)


@pytest.mark.parametrize("pattern", ["a$b", "(a$)b", "a$|b"])
def test_a_dollar_before_the_end_is_refused_or_read_as_re(pattern):
    """re takes "a$b" (matching nothing); the automaton refuses a $ before the end rather than
    read it as an empty string (which would accept "ab")."""
    try:
        dfa = RegexDFA(pattern)
    except ValueError as e:
        assert "$" in str(e)
        return
    for text in ("ab", "a", "b", "a$b"):
        assert dfa.fullmatch(text) == bool(re.fullmatch(pattern, text)), (pattern, text)


def test_a_back_reference_past_nine_groups_is_refused():
    r"""\12 after twelve groups is re's back-reference to group 12 (not the octal \012)."""
    pattern = "(a)(b)(c)(d)(e)(f)(g)(h)(i)(j)(k)(l)\\12"
    assert re.fullmatch(pattern, "abcdefghijkll")
    with pytest.raises(ValueError, match="not supported"):
        RegexDFA(pattern)


# -- guide: token bytes, partial characters, masks ---------------------------------------------


def _gpt2_alphabet() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return bytes_to_unicode()


class _ByteLevelDecoder:
    def __repr__(self):
        return "ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)"


class ByteLevelTok:
    """A byte-level BPE vocabulary as a tokenizer shows it: each id's piece is its bytes written
    in GPT-2's alphabet (transformers' bytes_to_unicode); the special tokens come last."""

    def __init__(self, vocab: list[bytes], special=("<|im_end|>",)):
        b2u = _gpt2_alphabet()
        self.raw = list(vocab) + [s.encode() for s in special]
        self.pieces = ["".join(b2u[b] for b in v) for v in vocab] + list(special)
        self.all_special_ids = list(range(len(vocab), len(self.raw)))
        self.backend_tokenizer = type("Backend", (), {"decoder": _ByteLevelDecoder()})()

    def __len__(self):
        return len(self.raw)

    def id(self, b: bytes) -> int:
        return self.raw.index(b)

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]

    def encode(self, text, add_special_tokens=False):
        return [self.raw.index(text.encode())]

    def decode(self, ids, **kw):
        return b"".join(self.raw[i] for i in ids).decode("utf-8", errors="replace")

    def batch_decode(self, batch, **kw):
        return [self.decode(ids) for ids in batch]


# No "q" (test_a_constraint_no_token_can_spell_ends_the_sequence); bytes of characters split
# over tokens (e-acute, the registered sign, the euro sign, U+1F642).
VOCAB = [bytes([c]) for c in b"abcdefghijklmnoprstuvwxyz0123456789 \"{}[],:-.\\"] + [
    b"ab", b" the", b"a\xf0",  # a whole character, then the lead byte of a 4-byte one
    b"\xf0", b"\x9f", b"\x99", b"\x82", b"\xc3", b"\xa9", b"\xc3\xa9", b"\xc2", b"\xae",
    b"\xe2\x82", b"\xac", "\u00ae".encode()]
EOS = 999  # no id of the vocabulary: EOS here is only what _allowed adds


@pytest.fixture(scope="module")
def fake_tok():
    return ByteLevelTok(VOCAB)


@pytest.fixture(scope="module")
def fake_index(fake_tok):
    return TokenIndex(fake_tok, len(fake_tok))


def test_the_byte_level_alphabet_is_gpt2s():
    assert guide_mod._byte_decoder() == {c: b for b, c in _gpt2_alphabet().items()}


def test_token_bytes_of_a_byte_level_vocabulary_are_its_bytes(fake_tok):
    """Every piece (whole characters, and bytes of a character split over tokens) is the bytes
    it stands for; special tokens are left to the caller (TokenIndex drops them)."""
    got = token_bytes(fake_tok, list(range(len(VOCAB))))
    assert got == dict(enumerate(VOCAB))


def test_textual_tokens_that_are_not_whole_text_are_left_out():
    """A token read as text (no byte-level alphabet, no <0xHH> piece) whose text after the anchor
    holds a replacement character (a byte of a character it cannot show) or nothing at all has
    no known bytes: it is not in the index (rather than taken as U+FFFD, or as b"")."""
    pieces = {0: "a", 1: "\ufffd", 2: "b", 3: "", 4: "x\ufffd"}

    class Tok:
        backend_tokenizer = None

        def convert_ids_to_tokens(self, ids):
            return [f"p{i}" for i in ids]

        def encode(self, text, add_special_tokens=False):
            return [0]

        def decode(self, ids, **kw):
            return "".join(pieces[i] for i in ids)

        def batch_decode(self, batch, **kw):
            return [self.decode(ids) for ids in batch]

    assert token_bytes(Tok(), [0, 1, 2, 3, 4]) == {0: b"a", 2: b"b"}


def test_the_index_holds_only_ids_the_model_has(fake_tok):
    """A model's vocab_size below the tokenizer's length (ids it has no logits for): no id past
    it is ever allowed."""
    index = TokenIndex(fake_tok, 20)
    assert set(index.bytes) == set(range(20))
    guide = CompiledGuide(r"[a-z ]+", index, (EOS,))
    assert max(set(guide.allowed(guide.start, 20)) - {EOS}) < 20


def _cp_brute(prefix: bytes) -> set[int]:
    """The code points whose UTF-8 (strict: no overlong form, no surrogate, none past
    U+10FFFF) begins with `prefix`, by decoding every completion."""
    lead = prefix[0]
    n = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 0
    out = set()
    if not n or len(prefix) >= n:
        return out
    rest = n - len(prefix)
    for k in range(64 ** rest):
        tail = bytes(0x80 | ((k >> (6 * j)) & 0x3F) for j in reversed(range(rest)))
        try:
            out.add(ord((prefix + tail).decode("utf-8")))
        except UnicodeDecodeError:
            pass
    return out


@pytest.mark.parametrize("prefix", [b"\xc3", b"\xd0", b"\xdf", b"\xc2", b"\xe0", b"\xe0\xa0",
                                    b"\xe2\x82",
                                    b"\xed", b"\xed\x9f", b"\xef\xbf", b"\xf0", b"\xf0\x9f",
                                    b"\xf0\x90\x80", b"\xf4", b"\xf4\x8f", b"\xf0\x9f\x99",
                                    b"\xc0", b"\xe0\x80", b"\xf4\x90", b"\xed\xa0"])
def test_the_code_points_a_partial_character_may_become(prefix):
    """Against a decode of each completion of the bytes. (A prefix the strict decoder already
    refuses, split_utf8 refuses, and begins no character.)"""
    want = _cp_brute(prefix)
    if guide_mod.split_utf8(prefix) is None:
        assert not want
        return
    lo, hi = _code_points(prefix)
    assert {c for c in range(lo, hi + 1) if not 0xD800 <= c <= 0xDFFF} == want


def test_partial_characters_are_walked_only_where_one_may_follow(fake_index):
    guide = CompiledGuide("[a-z]\u00e9|[a-z]\u00ff", fake_index, (EOS,))
    after_a = guide.walk(guide.start, b"a")
    assert guide.walk(after_a, b"\xc3") is not None  # e-acute and y-diaeresis begin with \xc3
    for prefix in (b"\xc2", b"\xf0", b"\xe2\x82", b"\xc1", b"\xc0"):  # no such character follows
        assert guide.walk(after_a, prefix) is None, prefix
    # Any character but a newline: an overlong lead or one past U+10FFFF begins none of them.
    anything = CompiledGuide("[^\n]x", fake_index, (EOS,))
    for prefix in (b"\xc0", b"\xc1", b"\xe0\x80", b"\xf0\x80", b"\xf4\x90", b"\xf5", b"\xff",
                   b"\x80"):
        assert anything.walk(anything.start, prefix) is None, prefix
    for prefix in (b"\xc2", b"\xe0\xa0", b"\xf0\x9f", b"\xf4\x8f"):
        assert anything.walk(anything.start, prefix) is not None, prefix
    # A lead byte alone: the characters it may begin are past ASCII (\xe0: U+0800..U+0FFF,
    # \xf0: U+10000..U+3FFFF), and at most U+10FFFF (\xf4: U+100000..U+10FFFF).
    ascii_ = CompiledGuide("[a-z]x", fake_index, (EOS,))
    for prefix in (b"\xe0", b"\xf0", b"\xf4", b"\xc2"):
        assert ascii_.walk(ascii_.start, prefix) is None, prefix
    digits = CompiledGuide(r"\dx", fake_index, (EOS,))
    assert not any(chr(c).isdecimal() for c in range(0x100000, 0x110000))
    assert digits.walk(digits.start, b"\xf4") is None
    assert digits.walk(digits.start, b"\xe0") is not None  # U+0966, Devanagari zero, say


def test_a_token_that_ends_inside_a_character_is_allowed_only_where_that_character_may_follow(
        fake_tok, fake_index):
    a_lead = fake_tok.id(b"a\xf0")
    assert a_lead not in fake_index.text  # not text: its last byte begins a character
    plain = CompiledGuide("ab", fake_index, (EOS,))
    allowed = set(plain.allowed(plain.start, len(fake_tok)))
    assert allowed == {fake_tok.id(b"a"), fake_tok.id(b"ab")}
    emoji = CompiledGuide("a\U0001F642", fake_index, (EOS,))
    assert set(emoji.allowed(emoji.start, len(fake_tok))) == {fake_tok.id(b"a"), a_lead}
    state = emoji.walk(emoji.start, b"a")
    # At a state with no unfinished character: the tokens that begin the next one.
    assert set(emoji.allowed(state, len(fake_tok))) == {fake_tok.id(b"\xf0")}


def test_a_text_is_complete_only_at_a_whole_character(fake_tok, fake_index):
    """"a" and "a\u00e9" are accepted; "a" then the first byte of e-acute is not: EOS may not
    follow it."""
    guide = CompiledGuide("a(?:\u00e9)?", fake_index, (EOS,))
    assert guide.accepts(guide.walk(guide.start, b"a"))
    mid = guide.walk(guide.start, b"a\xc3")
    assert mid is not None and not guide.accepts(mid)
    assert set(guide.allowed(mid, len(fake_tok))) == {fake_tok.id(b"\xa9")}
    assert EOS in guide.allowed(guide.walk(guide.start, "a\u00e9".encode()), len(fake_tok))


def test_a_constraint_no_token_can_spell_ends_the_sequence(fake_tok, fake_index):
    """No token of this vocabulary begins "q": EOS alone, so the sequence ends (an empty mask
    would leave every id allowed)."""
    guide = CompiledGuide("q+", fake_index, (EOS,))
    assert guide.allowed(guide.start, len(fake_tok)) == (EOS,)
    assert guide.mask(guide.start, len(fake_tok)) == ((EOS,), ())


def test_the_masks_kept_are_the_most_recently_used(fake_tok, fake_index, monkeypatch):
    monkeypatch.setattr(CompiledGuide, "MAX_STATES", 2)
    guide = CompiledGuide("[a-z]{0,6}", fake_index, (EOS,))
    s = [guide.walk(guide.start, b"a" * k) for k in range(3)]
    guide.bits(s[0], len(fake_tok))
    guide.bits(s[1], len(fake_tok))
    guide.bits(s[0], len(fake_tok))  # used again: s[1] is now the least recently used
    guide.bits(s[2], len(fake_tok))
    assert set(guide._bits) == {s[0], s[2]}


def test_a_guide_keeps_its_state_past_a_token_it_could_not_take(fake_tok, fake_index):
    """A token the sampler had to take though the constraint could not (nothing allowed was
    left) leaves the state where it was: the mask stays that of the text so far."""
    compiled = CompiledGuide("a+", fake_index, (EOS,))
    guide = Guide(compiled)
    ids = [fake_tok.id(b"a"), fake_tok.id(b"z")]
    assert guide.advance(ids) == compiled.walk(compiled.start, b"a")
    assert np.array_equal(guide.bits(ids + [fake_tok.id(b"a")], len(fake_tok)),
                          compiled.bits(compiled.walk(compiled.start, b"aa"), len(fake_tok)))


def test_the_guide_cache_keeps_the_most_recently_used_patterns(fake_tok):
    cache = GuideCache(fake_tok, len(fake_tok), (EOS,), size=2)
    p1, p2, p3 = cache.get("a"), cache.get("b"), cache.get("a")
    assert p3 is p1
    cache.get("c")  # evicts "b", the least recently used
    assert cache.get("a") is p1
    assert cache.get("b") is not p2
    assert cache.get("b") is cache.get("b")


# -- guide: JSON schema regexes against json.loads ------------------------------------------------


def _strict_json(text):
    def refuse(name):
        raise ValueError(name)
    return json.loads(text, parse_constant=refuse)


def _valid(text, check) -> bool:
    try:
        value = _strict_json(text)
    except ValueError:
        return False
    return check(value)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


ENUM = ["a", 1, None, {"k": [1, 2]}, 2.5, True]
# (schema, what a value it admits is, candidate texts). A candidate is accepted iff it is JSON
# (strict: no NaN) and its value passes the check. The candidates keep to the texts the regexes
# are meant to write: no \uXXXX escape, at most one space between tokens (outlines' default).
SCHEMA_CASES = {
    "string 2..3": ({"type": "string", "minLength": 2, "maxLength": 3},
                    lambda v: isinstance(v, str) and 2 <= len(v) <= 3,
                    ['"ab"', '"abc"', '"a"', '""', '"abcd"', '"a\\n"', '"a\\tb"', '"\\t\\t\\t\\t"',
                     '"a\nb"', '"a\tb"', '"\x01b"', '"\\x"', '"a\\"', '"\u00e9\u20ac"', '"a/"',
                     '"\\/\\b\\f"', '"\\r\\""', '"ab', 'ab']),
    "empty string": ({"type": "string", "maxLength": 0}, lambda v: v == "", ['""', '"a"', "''"]),
    "integer": ({"type": "integer"}, _is_int,
                ["0", "-7", "120", "01", "-01", "1.0", "+1", "", "-", "00", "1e3"]),
    "number": ({"type": "number"},
               lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
               ["1", "-1.5", "2e-3", "1E+2", "0.0", "1.", ".5", "01.5", "1e", "--1", "NaN", "1e-",
                "-0.25e10", "3.e2"]),
    "boolean": ({"type": "boolean"}, lambda v: isinstance(v, bool),
                ["true", "false", "True", "fals", "null", "1"]),
    "null": ({"type": "null"}, lambda v: v is None, ["null", "None", "nul", '"null"']),
    "array 1..2": ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
                   lambda v: isinstance(v, list) and 1 <= len(v) <= 2 and all(map(_is_int, v)),
                   ["[1]", "[1,2]", "[ 1, 2 ]", "[1 ,2]", "[]", "[ ]", "[1,2,3]", "[1,]", "[,1]",
                    '["1"]']),
    "array 0..": ({"type": "array", "items": {"type": "null"}},
                  lambda v: isinstance(v, list) and all(x is None for x in v),
                  ["[]", "[ ]", "[null]", "[null,null,null,null]", "[1]", "[null,]"]),
    "array 2..2": ({"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
                   lambda v: isinstance(v, list) and len(v) == 2,
                   ["[true,false]", "[true]", "[true,true,true]", "[]"]),
    "array none": ({"type": "array", "maxItems": 0}, lambda v: v == [],
                   ["[]", "[ ]", '[""]', '["a"]']),
    "object": ({"properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 1}}},
               lambda v: isinstance(v, dict) and list(v) == ["a", "b"] and _is_int(v["a"])
               and isinstance(v["b"], str) and len(v["b"]) <= 1,
               ['{"a":1,"b":""}', '{ "a" : -3, "b": "x" }', '{"a":1}', '{"b":"","a":1}',
                '{"a":1,"b":"xy"}', '{"a":1,"b":"",}', '{}']),
    "enum": ({"enum": ENUM}, lambda v: any(v == e and type(v) is type(e) for e in ENUM),
             ['"a"', "1", "null", '{"k": [1, 2]}', "2.5", "true", "a", "None", "True",
              "{'k': [1, 2]}", '"1"', "false"]),
    "const": ({"const": "x.y"}, lambda v: v == "x.y", ['"x.y"', '"xzy"', "x.y"]),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "null"}]},
              lambda v: v is None or _is_int(v), ["1", "null", '"1"', "1.5"]),
    "types": ({"type": ["string", "boolean"]}, lambda v: isinstance(v, (bool, str)),
              ['"a"', "true", '"ab"', "1"]),
}


@pytest.mark.parametrize("case", list(SCHEMA_CASES))
def test_schema_regexes_accept_the_json_the_schema_admits(case):
    schema, check, texts = SCHEMA_CASES[case]
    pattern = schema_regex(schema)
    dfa = RegexDFA(pattern)
    for text in texts:
        want = _valid(text, check)
        assert bool(re.fullmatch(pattern, text)) == want, (case, text, want)
        assert dfa.fullmatch(text) == want, (case, text)


def test_whitespace_between_json_tokens_is_at_most_one_space():
    """outlines' default (guide.WHITESPACE): a guided model cannot spend its tokens on spaces."""
    pattern = schema_regex({"type": "array", "items": {"type": "integer"}})
    assert re.fullmatch(pattern, "[ 1, 2 ]")
    for text in ("[  1]", "[1,  2]", "[1  ]", "[\n1]"):
        assert not re.fullmatch(pattern, text), text


def test_an_empty_array_schema_leads_nowhere_past_its_bracket():
    dfa = RegexDFA(schema_regex({"type": "array", "items": {"type": "integer"}, "maxItems": 0}))
    for prefix in ("[1", "[ 1", '["', "[{"):
        assert dfa.walk(dfa.start, prefix) == dfa.DEAD, prefix


@pytest.mark.parametrize("schema, match", [
    ({"type": "integer", "enum": [True]}, "not all of type"),
    ({"type": "number", "const": False}, "not all of type"),
    ({"allOf": [{"type": "integer"}, {"type": "null"}]}, "allOf"),
    ({"type": "object", "properties": {"a": {"type": "null"}},
      "additionalProperties": "string"}, "additionalProperties"),  # a schema is taken
    ({"type": "array", "minItems": 3, "maxItems": 2}, "maxItems"),
    ({"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/A"}}}, "nests too deep"),
    ({"$ref": "#/$defs/L", "$defs": {"L": {"type": "array", "items": {"$ref": "#/$defs/L"}}}},
     "nests too deep"),
    ({"type": "string", "minLength": -1}, "minLength"),
])
def test_schemas_the_regexes_cannot_hold_to_are_refused(schema, match):
    with pytest.raises(ValueError, match=match):
        schema_regex(schema)


def test_zero_counts_and_booleans_of_their_type_are_taken():
    assert re.fullmatch(schema_regex({"type": "string", "minLength": 0, "maxLength": 0}), '""')
    assert re.fullmatch(schema_regex({"type": "array", "minItems": 0, "maxItems": 0}), "[]")
    assert re.fullmatch(schema_regex({"type": "boolean", "enum": [True]}), "true")


@pytest.mark.parametrize("choices", [["1+1", "a.b", "(x)", "x|y"], ["[a]", "\\d", "?"]])
def test_choices_are_their_strings_literally(choices):
    pattern = StructuredOutputsParams(choice=choices).pattern
    for text in choices + ["11+1", "aXb", "x", "y", "a", "0", "", "1+11"]:
        assert bool(re.fullmatch(pattern, text)) == (text in choices), text


def test_an_empty_choice_is_refused():
    with pytest.raises(ValueError, match="non-empty strings"):
        StructuredOutputsParams(choice=["yes", ""])


# -- beam search on a scripted model ------------------------------------------------------------


def scripted(table, calls=None):
    """A step function: a beam's candidates by its last token ({last: {id: logprob}}), in the
    table's order; `calls` records each step's beams. A step with no beam is an error (the
    engine refuses an empty batch)."""
    def step(beams, prompt_of):
        assert beams, "a step with no beam"
        assert len(prompt_of) == len(beams)
        if calls is not None:
            calls.append([list(b) for b in beams])
        return [{t: Logprob(lp, k + 1) for k, (t, lp) in enumerate(table[b[-1]].items())}
                for b in beams]
    return step


def test_the_search_stops_once_every_beam_has_ended():
    """Every candidate is EOS (0): after one step no beam is open, and no empty step runs."""
    calls = []
    out = beam_search(scripted({5: {0: -0.1}}, calls), [[5]], beam_width=2, max_tokens=4,
                      eos_ids=[0])
    assert len(calls) == 1
    assert [(b.tokens, b.finish_reason) for b in out[0].sequences] == [([5, 0], "stop")]
    # Beams that reach max_model_len end there: the later steps run none.
    calls = []
    out = beam_search(scripted({5: {6: -0.5, 7: -1.0}, 6: {6: -0.5, 7: -1.0},
                                7: {6: -0.5, 7: -1.0}}, calls),
                      [[5, 5]], beam_width=2, max_tokens=6, eos_ids=[0], max_model_len=4)
    assert len(calls) == 2 and {len(b.tokens) for b in out[0].sequences} == {4}
    assert all(b.finish_reason == "length" for b in out[0].sequences)


def test_equal_scores_keep_the_candidates_order():
    """Ties go as vLLM's stable sorts order them: among open beams the step's candidate order;
    between a complete beam and an open one, the complete one (listed first)."""
    out = beam_search(scripted({5: {3: -1.0, 4: -1.0}}), [[5]], beam_width=1, max_tokens=1,
                      eos_ids=[0])
    assert out[0].sequences[0].tokens == [5, 3]
    out = beam_search(scripted({5: {4: -1.0, 3: -1.0}}), [[5]], beam_width=1, max_tokens=1,
                      eos_ids=[0])
    assert out[0].sequences[0].tokens == [5, 4]
    # Length penalty 0: the score is the cumulative logprob; EOS (0) and 4 tie at -1.
    out = beam_search(scripted({5: {4: -1.0, 0: -1.0}}), [[5]], beam_width=1, max_tokens=1,
                      eos_ids=[0], length_penalty=0.0)
    assert [(b.tokens, b.finish_reason) for b in out[0].sequences] == [([5, 0], "stop")]


def test_prompts_are_searched_concurrency_limit_at_a_time():
    calls = []
    table = {t: {1: -0.1, 2: -0.2, 3: -0.3, 4: -0.4} for t in range(10)}
    prompts = [[7], [8], [9]]
    beam_search(scripted(table, calls), prompts, beam_width=2, max_tokens=2, eos_ids=[0],
                concurrency_limit=2)
    firsts = [{b[0] for b in step} for step in calls]
    assert firsts == [{7, 8}, {7, 8}, {9}, {9}]


# -- the OpenAI API's requests and responses ------------------------------------------------------

CHAT = [{"role": "user", "content": "hi"}]


def _completion(**fields):
    return api.parse_completion({"prompt": "x", **fields}, {})


def _chat(defaults=None, **fields):
    return api.parse_chat({"messages": CHAT, **fields}, defaults or {})


def test_integer_fields_are_int64():
    for seed in (2**63 - 1, -2**63):
        assert _completion(seed=seed).params.seed == seed
    for seed in (2**63, -2**63 - 1):
        with pytest.raises(api.RequestError, match="64 bits"):
            _completion(seed=seed)
    with pytest.raises(api.RequestError, match="'n' must be an integer"):
        _completion(n=True)  # JSON's true is no number


def test_openai_fields_that_change_nothing_are_taken():
    _completion(user="u", metadata={"k": "v"}, store=False, service_tier="auto", suffix=None)
    _chat(user="u", parallel_tool_calls=True, tools=[], tool_choice="none")
    for choice in ("auto", "required"):  # vLLM's words
        with pytest.raises(api.RequestError, match="`tools` must be set"):
            _chat(tool_choice=choice)


def test_constraints_by_each_of_their_names():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    for fields in ({"guided_json": schema}, {"guided_json": json.dumps(schema)},
                   {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
                   {"structured_outputs": {"json": schema}}):
        pattern = _chat(**fields).params.structured_outputs.pattern
        assert re.fullmatch(pattern, '{"n": 12}') and not re.fullmatch(pattern, '{"n": "12"}')
    assert _chat(response_format={"type": "text"}).params.structured_outputs is None
    for fields in ({"response_format": {"type": "json_object"}},
                   {"structured_outputs": {"json_object": True}}):
        assert _chat(**fields).params.structured_outputs.key == ("json_object",)
        assert _completion(**fields).params.structured_outputs.key == ("json_object",)
    with pytest.raises(api.RequestError, match="takes choice, regex, json or json_object"):
        _chat(structured_outputs={"grammer": "x"})


def test_best_of_equal_to_n_is_taken():
    assert _completion(n=2, best_of=2).params.n == 2
    with pytest.raises(api.RequestError, match="best_of"):
        _completion(n=2, best_of=3)


def test_max_tokens_defaults():
    """A completion's is OpenAI's 16; a chat's the model's generation_config (none: unbounded
    but for max_model_len); max_tokens 0 is only for echo (the prompt scored)."""
    assert _completion().params.max_tokens == 16
    assert _chat({"max_tokens": 7}).params.max_tokens == 7
    assert _chat({"max_tokens": 7}, max_tokens=3).params.max_tokens == 3
    assert _chat().params.max_tokens is None
    with pytest.raises(api.RequestError, match="max_tokens"):
        _completion(max_tokens=0)
    only = _completion(max_tokens=0, echo=True)
    assert only.echo_only and only.params.max_tokens == 1


def test_echo_scores_the_prompt_at_prompt_logprobs_else_at_logprobs():
    assert _completion(echo=True, logprobs=1, prompt_logprobs=3).params.prompt_logprobs == 3
    # An explicit prompt_logprobs wins, even the smaller: vLLM's to_sampling_params.
    assert _completion(echo=True, logprobs=4, prompt_logprobs=2).params.prompt_logprobs == 2
    assert _completion(echo=True, logprobs=2).params.prompt_logprobs == 2
    assert _completion(logprobs=2).params.prompt_logprobs is None


def test_chat_logprobs_without_top_logprobs_are_the_tokens_own():
    assert _chat(logprobs=True).params.logprobs == 0
    assert _chat(logprobs=True, top_logprobs=3).params.logprobs == 3
    assert _chat(logprobs=False).params.logprobs is None


def test_continue_final_message_needs_no_generation_prompt():
    """vLLM's validator refuses both given true; add_generation_prompt left to its default
    (true) is refused by transformers' template call, which vLLM answers 400."""
    with pytest.raises(api.RequestError, match="continue_final_message and add_generation_prompt"):
        _chat(continue_final_message=True)
    with pytest.raises(api.RequestError, match="Cannot set both `continue_final_message` and "
                                               "`add_generation_prompt` to True."):
        _chat(continue_final_message=True, add_generation_prompt=True)
    for field in ({"messages": CHAT}, {"messages": CHAT, "add_generation_prompt": True}):
        with pytest.raises(api.RequestError, match="continue_final_message"):
            api.parse_tokenize({**field, "continue_final_message": True})
    assert api.parse_tokenize({"messages": CHAT, "continue_final_message": True,
                               "add_generation_prompt": False}).chat_options[
                                   "continue_final_message"]
    req = _chat(continue_final_message=True, add_generation_prompt=False)
    options = req.chat_options
    assert options["continue_final_message"] and not options["add_generation_prompt"]


def test_message_contents():
    """Text parts are joined by newlines (vLLM's); a null content is the empty string."""
    req = api.parse_chat({"messages": [
        {"role": "system", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "text", "text": "b"}]}]},
        {})
    assert [m["content"] for m in req.messages] == ["", "a\nb"]


def test_a_prompt_of_token_id_lists_is_one_prompt_each():
    assert _completion(prompt=[[1, 2], [3]]).prompts == [{"prompt_token_ids": [1, 2]},
                                                         {"prompt_token_ids": [3]}]
    assert _completion(prompt=[4, 5]).prompts == [{"prompt_token_ids": [4, 5]}]


def test_logprobs_in_json_are_finite_and_tokens_have_a_text():
    """JSON has no -inf (vLLM writes -9999.0); a token with no text is vLLM's "token_id:N"."""
    entry = {7: Logprob(float("-inf"), 2, None), 5: Logprob(-0.5, 1, "a"),
             6: Logprob(float("nan"), 3, "b")}
    out = api.completion_logprobs([7, 6], [entry, entry], 2, 0)
    json.dumps(out, allow_nan=False)
    assert out["token_logprobs"] == [-9999.0, -9999.0]
    assert out["tokens"] == ["token_id:7", "b"]
    assert out["top_logprobs"][0] == {"a": -0.5, "token_id:7": -9999.0}
    chat = api.chat_logprobs([7], [entry], 1)
    json.dumps(chat, allow_nan=False)
    assert chat["content"][0]["logprob"] == -9999.0


def test_stop_reason_is_in_each_choice():
    c = CompletionOutput(index=0, text="ab", token_ids=[1, 2], finish_reason="stop",
                         stop_reason="###")
    out = RequestOutput("r", "p", [9], [c], True)
    for req in (_completion(), _chat()):
        assert api.completion_choice(out, c, req, None, index=0)["stop_reason"] == "###"
        for delta in (True, False):
            parser = api.chat_output(req, None)
            assert api.chat_choice(c, req, parser, delta=delta)["stop_reason"] == "###"


def test_stream_options_defaults():
    assert api.parse_completion({"prompt": "x", "stream": True, "stream_options": {}}, {}) \
        .include_usage
    req = api.parse_completion({"prompt": "x", "stream": True}, {})
    assert not req.include_usage and not req.continuous_usage


# -- YaRN against transformers' own computation --------------------------------------------------


def _transformers_yarn(params: dict, omit=(), **config):
    """transformers' YaRN (inv_freq, attention scale) and our ModelConfig, for one config.
    omit: keys left out of our config.json, for our defaults to fill (transformers' validation
    wants a factor, which its computation then takes as None)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minivllm.state.config import ModelConfig

    cfg = hf_config(**{"max_position_embeddings": 512, **config},
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     **params})
    ours_dict = cfg.to_dict()
    for key in omit:
        del ours_dict["rope_parameters"][key]
        if key == "factor":
            cfg.rope_parameters["factor"] = None
    assert "original_max_position_embeddings" in cfg.rope_parameters
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    return inv_freq, scale, ModelConfig.from_dict(ours_dict)


# The number of rotations at which dimension 2.995 turns over 200 positions (head_dim 16, base 1e4).
_B = 200 / (2 * math.pi * math.exp(2.995 * 2 * math.log(10000.0) / 16))


@pytest.mark.parametrize("params, kw", [
    # The ramp's top past dim - 1 (clamped to it), its bottom below 0.
    ({"original_max_position_embeddings": 64, "beta_fast": 1000, "beta_slow": 1e-7}, {}),
    ({"original_max_position_embeddings": 64, "beta_fast": 1000, "beta_slow": 1e-7,
      "truncate": False}, {}),
    ({"original_max_position_embeddings": 10**9}, {}),
    # Defaults: original_max_position_embeddings is max_position_embeddings (transformers writes
    # it into its config), the factor max_position_embeddings / original.
    ({}, {"omit": ["original_max_position_embeddings"]}),
    ({"original_max_position_embeddings": 64}, {"omit": ["factor"]}),
    ({"original_max_position_embeddings": 64, "mscale": 2.0}, {}),  # mscale alone: unused
    ({"original_max_position_embeddings": 64, "mscale_all_dim": 2.0}, {}),
    ({"original_max_position_embeddings": 128, "factor": 1.0}, {}),
    # A zero-width ramp at a dimension 0.005 below an integer (beta_fast = beta_slow, untruncated):
    # transformers widens it by 0.001, so dimension 3 sits on the ramp's top.
    ({"original_max_position_embeddings": 200, "beta_fast": _B, "beta_slow": _B,
      "truncate": False}, {}),
])
def test_yarn_equals_transformers(params, kw):
    from minivllm.functional.rope import rope_attention_scale, rope_inv_freq

    inv_freq, scale, ours = _transformers_yarn(params, **kw)
    assert torch.equal(rope_inv_freq(ours), inv_freq)
    assert rope_attention_scale(ours) == pytest.approx(scale, rel=1e-12)


def test_yarns_context_is_original_times_factor():
    """vLLM's: original_max_position_embeddings x factor, whatever max_position_embeddings says."""
    _, _, ours = _transformers_yarn({"original_max_position_embeddings": 64})
    assert ours.max_position_embeddings == 512 and ours.max_context_len == 256
    _, _, ours = _transformers_yarn({"original_max_position_embeddings": 100, "factor": 2.5})
    assert ours.max_context_len == 250


def test_the_legacy_type_key_names_yarn():
    from minivllm.functional.rope import rope_inv_freq
    from minivllm.state.config import ModelConfig

    inv_freq, _, _ = _transformers_yarn({"original_max_position_embeddings": 64})
    d = hf_config(max_position_embeddings=512).to_dict()
    del d["rope_parameters"]
    d["rope_theta"] = 10000.0  # transformers 4's layout, with an older checkpoint's "type"
    d["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    legacy = ModelConfig.from_dict(d)
    assert legacy.rope_scaling_dict["rope_type"] == "yarn"
    assert torch.equal(rope_inv_freq(legacy), inv_freq)


@pytest.mark.parametrize("key, value", [("beta_slow", -1), ("mscale", "2"), ("mscale_all_dim", 0),
                                        ("beta_fast", float("nan"))])
def test_each_yarn_number_is_checked(key, value):
    from minivllm.state.config import ModelConfig

    d = hf_config().to_dict()
    d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64, key: value}
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict(d)


def test_overrides_merge_into_the_files_objects(tmp_path):
    from minivllm.state.config import ModelConfig, merge_overrides

    base = {"a": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    override = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 64}, "a": {"x": 1}}
    merged = merge_overrides(base, override)
    assert merged == {"a": {"x": 1}, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
        "original_max_position_embeddings": 64}}
    assert base == {"a": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    d = hf_config().to_dict()
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(d))
    config = ModelConfig.from_json(tmp_path, {"rope_parameters": override["rope_parameters"]})
    assert config.rope_theta == 500000.0 and config.rope_scaling_dict["factor"] == 4.0
    assert "rope_theta" not in config.rope_scaling_dict
    with pytest.raises(ValueError, match="hf_overrides"):
        merge_overrides(base, {1: 2})


# -- LLM.beam_search and the server on a tiny checkpoint (no tokenizer) ----------------------------


@pytest.fixture(scope="module")
def tiny_model():
    from hf_tiny import make_hf_model

    return make_hf_model(seed=1, std=0.3)


@pytest.fixture(scope="module")
def tiny_dir(tiny_model, tmp_path_factory):
    from hf_tiny import save_checkpoint

    return save_checkpoint(tiny_model, tmp_path_factory.mktemp("s51") / "model")


def test_a_beam_width_of_half_max_logprobs_is_taken(tiny_dir, tiny_model, device):
    """beam_width 10 asks 20 logprobs a step, max_logprobs: taken, and one step's 10 beams are
    the model's 10 most likely next tokens (transformers')."""
    from engine_helpers import make_llm

    from minivllm import BeamSearchParams

    llm = make_llm(tiny_dir, device, max_model_len=128, max_logprobs=20)
    prompt = [3, 14, 15, 92]
    out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=10,
                                                                           max_tokens=1))
    with torch.no_grad():
        lps = torch.log_softmax(tiny_model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    eos = set(llm.engine.eos_ids)
    want = [t for t in lps.argsort(descending=True).tolist() if t not in eos][:10]
    assert [b.tokens[-1] for b in out[0].sequences] == want
    with pytest.raises(ValueError, match="max_logprobs=20"):
        llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=11,
                                                                         max_tokens=1))


def test_a_beam_that_could_outgrow_the_cache_is_refused_before_any_step(tiny_dir, device):
    from engine_helpers import make_llm

    from minivllm import BeamSearchParams

    llm = make_llm(tiny_dir, device, block_size=4, num_kv_blocks=4, max_model_len=64)  # 16 tokens
    before = llm.stats.generation_tokens
    with pytest.raises(ValueError, match="never fit the KV cache"):
        llm.beam_search([{"prompt_token_ids": [1, 2, 3, 4, 5]}],
                        BeamSearchParams(beam_width=1, max_tokens=13))  # 5 + 12 cached
    assert llm.stats.generation_tokens == before and not llm.engine.requests


@pytest.fixture(scope="module")
def server(tiny_dir, device):
    from engine_helpers import make_llm, serving

    from minivllm.runtime.server import OpenAIServer

    srv = OpenAIServer(make_llm(tiny_dir, device, max_model_len=256), port=0, model_name="t",
                       api_key="k")
    with serving(srv):
        yield srv


def _raw(server, request: bytes) -> tuple[int, dict, bytes]:
    """One HTTP exchange on a fresh connection: (status, headers, body)."""
    import socket

    with socket.create_connection(server.address, timeout=60) as s:
        s.sendall(request)
        f = s.makefile("rb")
        status = int(f.readline().split()[1])
        headers = {}
        while (line := f.readline()) not in (b"\r\n", b""):
            k, v = line.decode().split(":", 1)
            headers[k.strip().lower()] = v.strip()
        n = int(headers.get("content-length", 0))
        body = f.read(n) if n else (f.read() if "content-length" not in headers else b"")
    return status, headers, body


def _post(server, path: str, body: bytes, extra: bytes = b"") -> tuple[int, dict, bytes]:
    return _raw(server, b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: Bearer k\r\nContent-Type: application/json\r\n" + extra +
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def test_the_servers_small_routes(server):
    for path, status in (("/ping", 200), ("/health", 200), ("/nowhere", 404)):
        got, _, _ = _raw(server, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert got == status, path
    # Under /v1 the key is asked for; elsewhere not.
    got, _, body = _raw(server, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got == 401
    got, _, body = _raw(server, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                        b"Authorization: Bearer k\r\n\r\n")
    card = json.loads(body)["data"][0]
    assert got == 200 and card["id"] == "t" and card["root"] == server.llm.config.model


def test_bodies_the_server_cannot_delimit_are_refused(server):
    body = json.dumps({"prompt": [1, 2], "max_tokens": 1}).encode()
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n" + hex(len(body))[2:].encode() + b"\r\n" +
               body + b"\r\n0\r\n\r\n")
    status, headers, answer = _raw(server, chunked)
    assert status == 411 and headers.get("connection") == "close"
    assert "Content-Length" in json.loads(answer)["error"]["message"]
    status, headers, answer = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                   b"Authorization: Bearer k\r\nContent-Length: -5\r\n\r\n")
    assert status == 400 and "Content-Length" in json.loads(answer)["error"]["message"]
    assert _post(server, "/v1/completions", body)[0] == 200


def _events(body: bytes) -> list:
    events = [e[len(b"data: "):] for e in body.split(b"\n\n") if e.strip()]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_a_stream_has_a_usage_chunk_only_when_asked(server):
    base = {"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True, "stream": True}
    _, _, body = _post(server, "/v1/completions", json.dumps(base).encode())
    events = _events(body)
    assert all(ev["choices"] for ev in events) and all("usage" not in ev for ev in events)
    # Each step's token is its own chunk (the stream does not wait for the end).
    assert len(events) == 4
    _, _, body = _post(server, "/v1/completions", json.dumps(
        {**base, "stream_options": {"include_usage": True}}).encode())
    events = _events(body)
    assert events[-1]["choices"] == [] and events[-1]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_a_cache_one_block_short_of_max_model_len_is_refused(tiny_dir, device):
    from engine_helpers import make_llm

    from minivllm.runtime.server import OpenAIServer

    llm = make_llm(tiny_dir, device, block_size=16, num_kv_blocks=8, max_model_len=129)
    with pytest.raises(ValueError, match="holds 128 tokens, less than max_model_len=129"):
        OpenAIServer(llm, port=0)


class _RecordingLLM:
    """What render_chat / detokenize use of an LLM, recorded."""

    def __init__(self, vocab_size=10):
        self.engine = type("E", (), {"vocab_size": vocab_size})()
        self.calls = []

    def chat_prompts(self, messages, **kw):
        self.calls.append(kw)
        return [{"prompt": "p", "prompt_token_ids": [1]}]

    def get_tokenizer(self):
        return type("T", (), {"decode": staticmethod(lambda ids: ",".join(map(str, ids)))})()


def test_chat_options_reach_the_template():
    """The request's continue_final_message goes to the template; the same keys in
    chat_template_kwargs give way to the request's own fields (vLLM's)."""
    llm = _RecordingLLM()
    req = api.parse_chat({"messages": CHAT, "continue_final_message": True,
                          "add_generation_prompt": False, "chat_template_kwargs": {
                              "add_generation_prompt": True, "enable_thinking": False,
                              "tokenize": True}}, {})
    api.render_chat(llm, req.messages, req.chat_options)
    assert llm.calls == [{"chat_template": None, "add_generation_prompt": False,
                          "continue_final_message": True,
                          "chat_template_kwargs": {"enable_thinking": False}, "tools": None}]


def test_detokenize_takes_only_the_vocabularys_ids():
    llm = _RecordingLLM(vocab_size=10)
    assert api.detokenize(llm, [0, 9]) == {"prompt": "0,9"}
    for bad in ([10], [-1], [3, 10**6]):
        with pytest.raises(api.RequestError, match="outside the vocabulary"):
            api.detokenize(llm, bad)


def test_tokenize_needs_a_prompt_or_messages():
    for body in ({}, {"prompt": "x", "messages": CHAT}):
        with pytest.raises(api.RequestError, match="'prompt' or 'messages'"):
            api.parse_tokenize(body)
    assert api.parse_tokenize({"prompt": "x"}).add_special_tokens
    assert not api.parse_tokenize({"messages": CHAT}).add_special_tokens


def test_a_whole_responses_choices_follow_the_prompts_not_their_finishing_order(server, tiny_model):
    """The second prompt stops at its first token (a stop id), the first runs 4 tokens: the
    choices are still in prompt order."""
    def greedy(prompt, n):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(tiny_model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt):]

    p1, p2 = [5, 6, 7], [40, 41]
    stop = greedy(p2, 1)[0]
    assert stop not in greedy(p1, 4)
    status, _, body = _post(server, "/v1/completions", json.dumps({
        "prompt": [p1, p2], "max_tokens": 4, "temperature": 0, "stop_token_ids": [stop],
        "ignore_eos": True}).encode())
    choices = json.loads(body)["choices"]
    assert status == 200 and [c["index"] for c in choices] == [0, 1]
    assert [(c["finish_reason"], c["stop_reason"]) for c in choices] == [("length", None),
                                                                         ("stop", stop)]


def test_stream_options_and_roles_are_checked():
    for options, match in (({"include_usage": "yes"}, "include_usage"),
                           ({"include_usage": True, "usage": True}, "unknown stream_options")):
        with pytest.raises(api.RequestError, match=match):
            api.parse_completion({"prompt": "x", "stream": True, "stream_options": options}, {})
    with pytest.raises(api.RequestError, match="role"):
        api.parse_chat({"messages": [{"content": "hi"}]}, {})


def test_object_schemas_with_no_properties_are_refused_and_names_are_json():
    with pytest.raises(ValueError, match="properties"):
        schema_regex({"type": "object"})  # any object: not a regular language
    empty = schema_regex({"type": "object", "properties": {}})  # the empty object (no arguments)
    assert re.fullmatch(empty, "{}") and re.fullmatch(empty, "{ }")
    assert not re.fullmatch(empty, '{"a":1}')
    with pytest.raises(ValueError, match="required"):
        schema_regex({"type": "object", "properties": {}, "required": ["a"]})
    pattern = schema_regex({"type": "object", "properties": {"a.b": {"type": "null"},
                                                             'q"': {"type": "null"}}})
    assert re.fullmatch(pattern, '{"a.b":null,"q\\"":null}')
    assert not re.fullmatch(pattern, '{"axb":null,"q\\"":null}')


def test_a_guide_walks_every_id_it_has_not_seen(fake_tok, fake_index):
    compiled = CompiledGuide("[a-z]{3}", fake_index, (EOS,))
    guide = Guide(compiled)
    ids = [fake_tok.id(b"a"), fake_tok.id(b"b"), fake_tok.id(b"c")]
    assert guide.advance(ids[:1]) == compiled.walk(compiled.start, b"a")
    assert guide.advance(ids) == compiled.walk(compiled.start, b"abc")
    assert compiled.accepts(guide.state)
