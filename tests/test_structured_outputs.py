"""Structured outputs (SamplingParams.structured_outputs, vLLM's): the regex automaton against
Python's re (hypothesis draws patterns and strings), each DFA state's allowed ids against a walk
of every token, and the engine's outputs on the demo model, sampled at temperature 1 with n > 1,
asynchronous steps and preemption: each fullmatches its choice / regex / JSON schema and ends
with EOS once complete. Bad constraints are refused before any work."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minivllm import SamplingParams
from minivllm.runtime.demo import ensure_demo_model
from minivllm.runtime.guide import JSON_OBJECT, CompiledGuide, TokenIndex, schema_regex
from minivllm.runtime.regex_fsm import RegexDFA
from minivllm.runtime.sampling_params import StructuredOutputsParams

from engine_helpers import make_llm

# -- the automaton against re ------------------------------------------------------------------

_ATOMS = st.sampled_from(["a", "b", ".", "[ab]", "[^a]", r"\d", r"\w", r"\s", r"\.", "[a-c1]",
                          r"[\d ]", r"\W", "{", "a{,2}"])


def _regexes():
    def extend(inner):
        return st.one_of(
            st.tuples(inner, inner).map("".join),
            st.tuples(inner, inner).map(lambda t: f"(?:{t[0]}|{t[1]})"),
            st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "{0,}", "*?"]))
            .map(lambda t: f"(?:{t[0]}){t[1]}"),
            inner.map(lambda r: f"({r})"))
    return st.recursive(_ATOMS, extend, max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(pattern=_regexes(), texts=st.lists(st.text(alphabet="ab1 .\nc_é", max_size=6), max_size=8))
def test_the_dfa_accepts_what_re_fullmatches(pattern, texts):
    dfa = RegexDFA(pattern)
    for text in texts:
        assert dfa.fullmatch(text) == bool(re.fullmatch(pattern, text)), (pattern, text)


@pytest.mark.parametrize("pattern, yes, no", [
    (r"^[A-Z][a-z]{2,4}$", ["Abc", "Xyzwv"], ["abc", "Ab", "Abcdef"]),
    (r"(?P<y>\d{4})-(?:0[1-9]|1[0-2])", ["2024-01", "1999-12"], ["2024-13", "24-01"]),
    (r"a{,2}b{,}", ["", "aab", "bbb"], ["aaa", "a{,2}"]),
    (r"a{x}b{}c{2", ["a{x}b{}c{2"], ["ab", "a"]),  # re: a brace that is no quantifier is a literal
    (r"[\]a-]+", ["]-a"], ["b"]),
    (r"\x41\u00e9\t", ["A\u00e9\t"], ["Ae\t"]),
    (r"\012\0\101[\01]", ["\n\0A\x01"], ["\x0012"]),  # octal escapes, as re
    ("a{\u0663}", ["a{\u0663}"], ["aaa"]),  # a non-ASCII digit is no count
    (r"x|", ["x", ""], ["xx"]),
])
def test_the_dfa_on_chosen_patterns(pattern, yes, no):
    dfa = RegexDFA(pattern)
    for text in yes + no:
        assert dfa.fullmatch(text) == bool(re.fullmatch(pattern, text)) == (text in yes)


@pytest.mark.parametrize("pattern, match", [
    ("a(?=b)", r"\(\?\.\.\.\)"), (r"(a)\1", r"\\1"), (r"\bword", r"\\b"), ("a**", "repeat"),
    ("(ab", r"missing \)"), ("ab)", "unbalanced"), ("a^b", r"\^"), ("[b-a]", "bad character range"),
    ("a{3,1}", "min repeat greater"), ("x{100000}", "states"), ("a++", "possessive"),
    # What re refuses, with re's reason.
    (r"[\d-z]", "bad character range"), ("{2}", "nothing to repeat"), ("(?P<1>a)", "group name"),
    ("(" * 300 + ")" * 300, "nested too deep"),
])
def test_unsupported_or_bad_patterns_are_named(pattern, match):
    with pytest.raises(ValueError, match=match):
        RegexDFA(pattern)


@pytest.mark.parametrize("limit", [1000, 5000])
def test_group_depth_bound_does_not_follow_the_recursion_limit(limit):
    """Groups nested MAX_GROUP_DEPTH deep compile and one more level is refused, whatever the
    interpreter's recursion limit (torch.compile raises it to 2000 in its process: before the
    bound, 300 levels compiled there and were refused elsewhere)."""
    import sys

    from minivllm.runtime.regex_fsm import MAX_GROUP_DEPTH

    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        deep = "(" * MAX_GROUP_DEPTH + "a" + ")" * MAX_GROUP_DEPTH
        dfa = RegexDFA(deep)
        assert dfa.fullmatch("a") and not dfa.fullmatch("aa")
        with pytest.raises(ValueError, match="nested too deep"):
            RegexDFA("(" + deep + ")")
    finally:
        sys.setrecursionlimit(before)


# -- the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))


@pytest.fixture(scope="module")
def llm(demo_dir, device):
    return make_llm(demo_dir, device, max_model_len=512)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b c"]}, "maxItems": 2},
    "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    "ok": {"type": "boolean"}}}


def check_person(value):
    assert list(value) == list(PERSON["properties"])
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    assert len(value["tags"]) <= 2 and set(value["tags"]) <= {"a", "b c"}
    assert value["score"] is None or isinstance(value["score"], (int, float))
    assert isinstance(value["ok"], bool)


CASES = {
    "choice": (StructuredOutputsParams(choice=["yes", "no", "not sure"]), None),
    "regex": (StructuredOutputsParams(regex=r"(?:[0-9]{3}-)?[a-z]{2,5}( [A-Z]\.)?"), None),
    "json": (StructuredOutputsParams(json=PERSON), check_person),
    # Most ids allowed (the packed mask mostly ones).
    "letters": (StructuredOutputsParams(regex=r"[a-zA-Z ]{1,12}"), None),
    "json text": (StructuredOutputsParams(json=json.dumps({"type": "array", "items": {
        "type": "integer"}, "minItems": 1, "maxItems": 3})), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_satisfy_their_constraint(llm, case):
    constraint, check = CASES[case]
    params = SamplingParams(temperature=1.0, max_tokens=80, n=4, seed=3,
                            structured_outputs=constraint)
    outs = llm.generate(["The quick brown fox", "Hello, my name is", "0"], params, use_tqdm=False)
    eos = set(llm.engine.eos_ids)
    for out in outs:
        for c in out.outputs:
            if c.finish_reason == "length":  # cut short: a prefix of an accepted text
                fsm = RegexDFA(constraint.pattern)
                assert fsm.walk(fsm.start, c.text) != fsm.DEAD
                continue
            assert c.finish_reason == "stop" and c.token_ids[-1] in eos
            assert re.fullmatch(constraint.pattern, c.text), c.text
            if constraint.json is not None:
                value = json.loads(c.text)
                if check:
                    check(value)
    if case == "choice":
        assert {c.text for o in outs for c in o.outputs} <= {"yes", "no", "not sure"}


def test_under_preemption_and_chunks_the_outputs_are_those_alone(demo_dir, device):
    """A cache that forces preemption, small steps and asynchronous scheduling change no token of
    a seeded constrained request."""
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=9,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    prompts = ["The quick brown fox", "Hello, my name is", "0", "Once"]
    roomy = make_llm(demo_dir, device, max_model_len=512, async_scheduling=False)
    tight = make_llm(demo_dir, device, max_model_len=64, num_kv_blocks=6, block_size=16,
                     max_num_batched_tokens=16)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert tight.stats.preemptions > 0


def test_each_states_allowed_ids_are_the_tokens_that_walk_it(llm):
    """Against a walk of every token's bytes from the state (EOS where the text is complete)."""
    tok = llm.get_tokenizer()
    vocab = llm.engine.vocab_size
    index = TokenIndex(tok, vocab)
    eos = set(llm.engine.eos_ids)
    pattern = schema_regex(PERSON)
    compiled = CompiledGuide(pattern, index, llm.engine.eos_ids)

    def brute(guide, state):
        want = {i for i, b in index.bytes.items() if guide.walk(state, b) is not None}
        return want | eos if guide.accepts(state) or not want else want

    for prefix in ["", "{", '{ "name"', '{"name":"ab', '{"name":"ab","age":-', '{"name":"","age":1,'
                   '"tags":["a"],"score":null,"ok":true']:
        state = compiled.walk(compiled.start, prefix.encode())
        assert state is not None
        assert set(compiled.allowed(state, vocab)) == brute(compiled, state)
    # A text that is complete yet may go on: EOS and the tokens that go on.
    short = CompiledGuide(r"[a-z]{2,5}", index, llm.engine.eos_ids)
    state = short.walk(short.start, b"ab")
    allowed = set(short.allowed(state, vocab))
    assert eos <= allowed
    assert allowed - eos == {i for i, t in index.text.items() if re.fullmatch("[a-z]{1,3}", t)}
    # The mask gives the shorter of the two lists.
    for state in (short.start, state):
        allowed, banned = short.mask(state, vocab)
        assert (allowed and not banned) or (banned and not allowed)
        assert set(allowed or set(range(vocab)) - set(banned)) == set(short.allowed(state, vocab))
    wide = CompiledGuide(r"[^0-9]{1,3}", index, llm.engine.eos_ids)
    allowed, banned = wide.mask(wide.start, vocab)
    assert not allowed and set(range(vocab)) - set(banned) == set(wide.allowed(wide.start, vocab))
    # Inside a character split over tokens: the tokens that go on with it.
    emoji = CompiledGuide("\u00e9x|\U0001F642x", index, llm.engine.eos_ids)
    for prefix in ("\U0001F642".encode()[:1], "\U0001F642".encode()[:3], "\u00e9".encode()[:1]):
        state = emoji.walk(emoji.start, prefix)
        assert state is not None and state[1] == prefix
        assert set(emoji.allowed(state, vocab)) == brute(emoji, state)
    assert emoji.walk(emoji.start, "\u00e8".encode()[:1]) is not None  # \xc3 begins e-acute too
    assert emoji.walk(emoji.start, "\u00e8".encode()) is None
    # Special tokens are never allowed.
    assert not set(tok.all_special_ids) & set(index.bytes)


def test_allowed_token_ids_narrow_the_constraint(llm):
    tok = llm.get_tokenizer()
    digits = [i for i in range(llm.engine.vocab_size) if tok.decode([i]) in set("0123456789")]
    allowed = digits + list(llm.engine.eos_ids)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=2, allowed_token_ids=allowed,
                            structured_outputs=StructuredOutputsParams(regex=r"[0-9a-z]{1,6}"))
    for out in llm.generate(["Hello", "The"], params, use_tqdm=False):
        c = out.outputs[0]
        assert re.fullmatch(r"[0-9]{1,6}", c.text) and c.finish_reason == "stop"


@pytest.mark.parametrize("kwargs, match", [
    (dict(regex="a(?<=b)"), "not supported"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice=["a"], regex="a"), "exactly one"),
    (dict(), "exactly one"),
    (dict(json={"type": "object"}), "properties"),
    (dict(json="{not json"), "not a JSON schema"),
    (dict(json={"$ref": "http://x"}), r"\$ref"),
    (dict(grammar="root ::= 'a'"), "unexpected character"),  # GBNF strings are double-quoted
    # Keywords an output would not be held to are refused, not ignored.
    (dict(json={"type": "object", "properties": {"a": {"type": "null"}},
                "patternProperties": {"^b": {"type": "null"}}}), r"\['patternProperties'\] not"),
    (dict(json={"type": "integer", "multipleOf": 2}), r"\['multipleOf'\] not supported"),
    (dict(json={"type": "integer", "format": "int32"}), r"\['format'\] not supported"),
    (dict(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (dict(json={"$ref": "#/$defs/A", "type": "string", "$defs": {"A": {"type": "null"}}}), "type"),
    (dict(json={"enum": []}), "non-empty"),
    (dict(json={"enum": [float("nan")]}), "not JSON"),
    (dict(json={"type": "string", "enum": [1]}), "not all of type"),
    (dict(json={"type": "string", "maxLength": True}), "maxLength"),
    (dict(json={"$ref": "#/$defs/A/b", "$defs": {"A": {"type": "null"}}}), r"\$ref"),
    (dict(json={"type": "object", "properties": {"a": {"type": "null"}}, "required": ["b"]}),
     "required"),
])
def test_bad_constraints_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("pattern, reason", [
    ("(" + "a" * 100_000, "missing ), unterminated subpattern"),  # re refuses it
    ("(" * 50_000 + ")" * 50_000, "nested too deep"),  # re takes it; the parser's recursion not
])
def test_a_refused_long_regex_is_quoted_by_its_head(pattern, reason):
    """A refused regex of up to 200,000 characters is quoted in the error by its first 80 and
    its length, not whole (the message goes back to a client), with the reason; a short one
    whole."""
    with pytest.raises(ValueError) as e:
        RegexDFA(pattern)
    message = str(e.value)
    assert reason in message and f"({len(pattern)} characters)" in message
    assert repr(pattern[:80]) in message and len(message) < 300
    with pytest.raises(ValueError, match=re.escape(repr("a(b") + ": missing )")):
        RegexDFA("a(b")


def test_a_constraint_needs_a_tokenizer(tmp_path, device):
    from hf_tiny import make_hf_model, save_checkpoint

    llm = make_llm(save_checkpoint(make_hf_model(), tmp_path / "m"), device)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]))
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.generate([{"prompt_token_ids": [1, 2]}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"choice": ["a"]})


def test_constraints_refuse_ignore_eos_and_min_tokens():
    """A complete constrained output may only take EOS: a request that must go on past it could
    not (min_tokens bans EOS) or would take EOS over and over (ignore_eos)."""
    constraint = StructuredOutputsParams(choice=["yes", "no"])
    for kw in (dict(ignore_eos=True), dict(min_tokens=3)):
        with pytest.raises(ValueError, match="ignore_eos and min_tokens"):
            SamplingParams(structured_outputs=constraint, **kw)


def test_row_constraints_combine_with_the_requests_own():
    from minivllm.runtime.guide import bits_constraint, pack_ids

    vocab = 20
    bits = pack_ids(np.array([1, 2, 3, 19, 25]), vocab)  # 25: past the vocabulary, dropped
    assert bits.shape == (3,) and np.flatnonzero(
        np.unpackbits(bits, bitorder="little")).tolist() == [1, 2, 3, 19]
    # The constraint within allowed_token_ids (the ids alone then); alone where they share none.
    assert bits_constraint(bits, (2, 3, 9)) == (None, (2, 3))
    got, allowed = bits_constraint(bits, (8, 9))
    assert got is bits and allowed == ()
    got, allowed = bits_constraint(bits, ())
    assert got is bits and allowed == ()
    # No constraint (None: inside the reasoning, or nothing allowed): the request's own ids.
    assert bits_constraint(None, (4, 5)) == (None, (4, 5))


def test_characters_split_over_tokens_are_generated(llm):
    """The demo vocabulary has no token for e-acute or the emoji: their UTF-8 bytes come from
    several tokens, each allowed while the bytes so far begin a character the constraint takes."""
    choices = ["caf\u00e9", "th\u00e9", "\U0001F642 ok"]
    tok = llm.get_tokenizer()
    assert all(len(tok.encode(c, add_special_tokens=False)) > 1 for c in ("\u00e9", "\U0001F642"))
    params = SamplingParams(temperature=1.0, max_tokens=20, n=6, seed=5,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    texts = [c.text for o in llm.generate(["Hello", "The"], params, use_tqdm=False)
             for c in o.outputs if c.finish_reason == "stop"]
    assert texts and set(texts) <= set(choices)


def test_a_sentencepiece_tokenizers_spaces_are_kept(demo_dir, device, tmp_path):
    """A Metaspace (SentencePiece-style) tokenizer drops a lone token's leading space when it
    decodes it; the guide reads each token's text as it follows another, as the output has it."""
    import os
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from minivllm.runtime import demo

    path = str(tmp_path / "spm")
    shutil.copytree(demo_dir, path)
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.train_from_iterator([demo._TEXT], trainers.BpeTrainer(
        vocab_size=500, special_tokens=[*demo.SPECIAL_TOKENS, "<unk>"], show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="<unk>")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(path, name))
    tok.save_pretrained(path)
    spm = make_llm(path, device, max_model_len=256)
    pattern = r"[a-z]{1,12}"
    params = SamplingParams(temperature=1.0, max_tokens=12, n=6, seed=3,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    outs = [c for o in spm.generate(["The quick brown fox", "Hello"], params, use_tqdm=False)
            for c in o.outputs]
    for c in outs:
        fsm = RegexDFA(pattern)
        assert (re.fullmatch(pattern, c.text) if c.finish_reason == "stop"
                else fsm.walk(fsm.start, c.text) != fsm.DEAD), c.text


def test_a_guides_packed_mask_allows_its_ids_and_nothing_else(llm):
    """CompiledGuide.bits, the engine's form of a state's constraint, unpacks to the ids mask()
    allows (given as the allowed ids or as the vocabulary less the banned), state by state
    through a JSON object; None (no restriction) exactly where mask() gives two empty lists."""
    vocab = llm.engine.vocab_size
    index = TokenIndex(llm.get_tokenizer(), vocab)
    guide = CompiledGuide(JSON_OBJECT, index, llm.engine.eos_ids)
    text = b'{"name": "x", "age": 42}'
    for k in range(len(text) + 1):
        state = guide.walk(guide.start, text[:k])
        allowed, banned = guide.mask(state, vocab)
        bits = guide.bits(state, vocab)
        if not allowed and not banned:
            assert bits is None
            continue
        want = set(allowed) if allowed else set(range(vocab)) - set(banned)
        assert set(np.flatnonzero(np.unpackbits(bits, bitorder="little"))) == want, text[:k]


def test_a_guide_keeps_a_bounded_number_of_states(llm, monkeypatch):
    """A string of maxLength n is n states: the masks of the most recently used are kept, and a
    state met again after its mask was dropped gets the same one."""
    monkeypatch.setattr(CompiledGuide, "MAX_STATES", 3)
    index = TokenIndex(llm.get_tokenizer(), llm.engine.vocab_size)
    guide = CompiledGuide(r"[a-z]{0,8}", index, llm.engine.eos_ids)
    states = [guide.walk(guide.start, b"a" * k) for k in range(6)]
    first = [guide.bits(st, llm.engine.vocab_size).copy() for st in states]
    assert len(guide._bits) == 3
    again = [guide.bits(st, llm.engine.vocab_size) for st in states]
    assert all(np.array_equal(a, b) for a, b in zip(again, first))


def test_byte_fallback_pieces_are_their_bytes():
    """SentencePiece's byte fallback writes a byte it has no piece for as <0xHH>; the rest of
    its pieces are read after an anchor token, which keeps their leading space."""
    from minivllm.runtime.guide import token_bytes

    pieces = {0: "a", 1: "<0xF0>", 2: "<0x9F>", 3: "\u2581the", 4: "x"}

    class Tok:  # a Metaspace decoder's behaviour: a leading ▁ is a space, dropped at the start
        backend_tokenizer = None

        def convert_ids_to_tokens(self, ids):
            return [pieces[i] for i in ids]

        def encode(self, text, add_special_tokens=False):
            return [0]

        def decode(self, ids, **kw):
            return "".join(pieces[i] for i in ids).replace("\u2581", " ").lstrip(" ")

        def batch_decode(self, batch, **kw):
            return [self.decode(ids) for ids in batch]

    assert token_bytes(Tok(), [0, 1, 2, 3, 4]) == {0: b"a", 1: b"\xf0", 2: b"\x9f", 3: b" the",
                                                   4: b"x"}


def test_a_list_of_types_takes_each_types_keywords():
    regex = schema_regex({"type": ["string", "null"], "maxLength": 2})
    for text, ok in (('"ab"', True), ("null", True), ('"abc"', False), ("1", False)):
        assert bool(re.fullmatch(regex, text)) == ok
    with pytest.raises(ValueError, match="minimum"):
        schema_regex({"type": ["string", "null"], "minimum": 2})


def test_surrogates_begin_no_character():
    """No UTF-8 text holds a surrogate: a class of them alone begins with no byte."""
    from minivllm.runtime.regex_fsm import CharSet

    assert not CharSet(ranges=(("\ud800", "\udfff"),)).meets(0xD000, 0xDFFF)
    assert CharSet(ranges=(("\ud800", "\ue000"),)).meets(0xD000, 0xE000)


# Characters of 1-4 UTF-8 bytes, digits, spaces, quotes and escapes' classes, for the vocabularies
# below; a token is 1-6 of them, or a lone byte of a multi-byte one (part of a character).
_CHARS = list("ab z09_\"{}:,.-\\") + ["\u00e9", "\u4e2d", "\U0001F642", "\u00a0", "\u0663"]
_PATTERNS = [r"[a-z ]{2,9}", r"(ab|a\u4e2d)+\"?", r"\d{1,3}(\.\d+)?", r"[^\"\\]{0,5}\"",
             "\u00e9+|\U0001F642{2}", r"\w+\s\W", r"[^a-z0-9]*z", r"[\d\-]{1,4}|[^\sa]+",
             ("json_object",),
             # 65 character sets out of the start: more than one integer's bits (char_classes)
             "|".join(chr(0x100 + i) for i in range(63)) + "|[ab z]+|\u00e9+",
             schema_regex({"type": "object", "properties": {"a": {"type": "string"},
                                                             "b": {"type": "integer"}}})]


@settings(max_examples=40, deadline=None)
@example(["ab", "a0", " z", "0", "\"", "\u00e9", "\u00e9".encode()[:1]], _PATTERNS[-2], [1, 2, 3])
@given(st.lists(st.one_of(st.lists(st.sampled_from(_CHARS), min_size=1, max_size=6).map("".join),
                          st.sampled_from(_CHARS).map(lambda c: c.encode()[:1])),
                min_size=1, max_size=60, unique=True),
       st.sampled_from(_PATTERNS), st.lists(st.integers(0, 10_000), max_size=12))
def test_allowed_ids_of_a_random_vocabulary_are_the_tokens_that_walk_it(tokens, pattern, picks):
    """The whole vocabulary walked at once (CompiledGuide._text_allowed, by classes of
    characters the automaton moves alike) against each token's bytes walked one by one, at each
    state of a random walk through allowed tokens: random byte-level vocabularies, regexes with
    class escapes, negated sets and multi-byte characters, json_object, a schema."""
    from test_session51_mutants import ByteLevelTok

    vocab = [t.encode() if isinstance(t, str) else t for t in tokens]
    if len(set(vocab)) < len(vocab):
        return
    index = TokenIndex(ByteLevelTok(vocab), len(vocab))
    eos = (len(vocab) + 5,)
    guide = CompiledGuide(pattern, index, eos)
    state = guide.start
    for pick in [*picks, None]:
        want = {i for i, b in index.bytes.items() if guide.walk(state, b) is not None}
        if guide.accepts(state) or not want:
            want |= set(eos)
        got = guide.allowed(state, len(vocab) + 10)
        assert list(got) == sorted(want)
        nexts = sorted(want - set(eos))
        if pick is None or not nexts:
            break
        state = guide.walk(state, index.bytes[nexts[pick % len(nexts)]])


def test_a_state_with_no_token_and_no_eos_id_gives_an_empty_mask():
    """Nothing leads on and the model names no EOS id: the mask is empty both ways (as before
    the vocabulary was walked at once, when an empty list came back), not an error."""
    from test_session51_mutants import ByteLevelTok

    index = TokenIndex(ByteLevelTok([b"a", b"b"]), 2)
    guide = CompiledGuide("q", index, ())
    assert guide.mask(guide.start, 4) == ((), ())
