"""json_object structured outputs (runtime/json_automaton.py): the pushdown automaton against
Python's json as the oracle (hypothesis draws JSON values, their dumps, and near-JSON strings),
its bounds, its masks against a walk of every token, and the engine's outputs on the demo model,
each a JSON object that json.loads reads. Bad combinations are refused before any work."""

from __future__ import annotations

import json
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import SamplingParams
from minivllm.runtime.demo import ensure_demo_model
from minivllm.runtime.guide import JSON_OBJECT, CompiledGuide, GuideCache, TokenIndex
from minivllm.runtime.json_automaton import MAX_DEPTH, MAX_WHITESPACE, JsonObjectAutomaton
from minivllm.runtime.sampling_params import StructuredOutputsParams

from engine_helpers import make_llm

# -- the oracle --------------------------------------------------------------------------------


def _refuse_constant(name):
    raise ValueError(f"{name} is not JSON")  # Python's json takes NaN / Infinity; JSON does not


def is_json_object(text: str) -> bool:
    """Whether `text` is one JSON object, nothing around it (json.loads takes whitespace there;
    the automaton, as documented, does not)."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except ValueError:
        return False
    return isinstance(value, dict) and text == text.strip(" \t\n\r")


def depth_and_whitespace(text: str) -> tuple[int, int]:
    """(deepest nesting, longest whitespace run outside strings) of a JSON text."""
    depth = deepest = run = longest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
            continue
        run = run + 1 if c in " \t\n\r" else 0
        longest = max(longest, run)
        if c in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "}]":
            depth -= 1
        in_string = c == '"'
    return deepest, longest


def within_bounds(text: str) -> bool:
    deepest, longest = depth_and_whitespace(text)
    return deepest <= MAX_DEPTH and longest <= MAX_WHITESPACE


def completion(fsm: JsonObjectAutomaton, state: int) -> str | None:
    """A shortest string that the automaton accepts after `state`, over closing characters only
    (no container opens but the top-level one, so the search is small); None if there is none."""
    if state == fsm.start:
        return "{" + (completion(fsm, fsm.step(state, "{")) or "")
    seen, todo = {state: ""}, deque([state])
    while todo:
        s = todo.popleft()
        if fsm.accepts(s):
            return seen[s]
        for c in '"0:}]truefalsn':
            t = fsm.step(s, c)
            if t != fsm.DEAD and t not in seen:
                seen[t] = seen[s] + c
                todo.append(t)
    return None


# -- the automaton against json ----------------------------------------------------------------

_KEYS = st.text(alphabet='ab "\\\u00e9\n\x7f/', max_size=4)
_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20),
                    st.floats(allow_nan=False, allow_infinity=False), _KEYS)


def json_values():
    return st.recursive(_LEAVES, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(_KEYS, inner, max_size=3)), max_leaves=12)


def dumps(value, style: int, ascii_only: bool) -> str:
    """value's JSON text in one of a few layouts (compact, json's default, indented)."""
    layouts = [dict(separators=(",", ":")), {}, dict(indent=1), dict(indent="\t"),
               dict(indent=0), dict(separators=(" ,\n", " :\r\n "))]
    return json.dumps(value, ensure_ascii=ascii_only, **layouts[style])


@settings(max_examples=300, deadline=None)
@given(value=json_values(), style=st.integers(0, 5), ascii_only=st.booleans())
def test_dumps_of_objects_are_accepted_and_every_prefix_is_live(value, style, ascii_only):
    fsm = JsonObjectAutomaton()
    for top in (value, {"k": value}):
        text = dumps(top, style, ascii_only)
        if not within_bounds(text):
            assert not fsm.fullmatch(text)
            continue
        assert fsm.fullmatch(text) == isinstance(top, dict), text
        state = fsm.start
        for i, c in enumerate(text):
            assert fsm.can_continue(state) and not fsm.accepts(state), text[:i]
            state = fsm.step(state, c)
            if not isinstance(top, dict):
                break  # the first character: no object starts so
        else:
            assert fsm.accepts(state) and not fsm.can_continue(state)
        if not isinstance(top, dict):
            assert state == fsm.DEAD


_JSONISH = '{}[]":,0123456789-+.eEtrufalsnNx \t\n\r\\/ubAF\u00e9\x01'


def _edited(draw_text: st.DrawFn) -> str:
    """A JSON object's text with one character deleted, inserted or replaced: near misses."""
    text = dumps(draw_text(st.dictionaries(_KEYS, json_values(), max_size=3)),
                 draw_text(st.integers(0, 5)), draw_text(st.booleans()))
    at = draw_text(st.integers(0, len(text)))
    c = draw_text(st.sampled_from(_JSONISH))
    edit = draw_text(st.sampled_from(["delete", "insert", "replace", "none"]))
    if edit == "delete":
        return text[:at] + text[at + 1:]
    if edit == "insert":
        return text[:at] + c + text[at:]
    return text[:at] + c + text[at + 1:] if edit == "replace" else text


# JSON's tokens and near misses, joined: texts near the grammar's edges (numbers, escapes,
# literals, separators) that characters drawn one by one rarely reach.
_PIECES = ['{', '}', '[', ']', ':', ',', '"a"', '"', '\\', '\\u', '\\x', '\\n', "x", "u",
           "12", "0", "01", "-", ".", "e", "E+", "+", "5", "true", "tru", "nul", "null", "false",
           " ", "\n", "\t", "\x01", "\u00e9", "AF", "g"]
_STRINGS = st.one_of(st.text(alphabet=_JSONISH, max_size=12), st.composite(_edited)(),
                     st.text(alphabet=" {}[]", max_size=40),
                     st.lists(st.sampled_from(_PIECES), max_size=16).map("".join),
                     st.lists(st.sampled_from(_PIECES), max_size=12)
                     .map(lambda p: '{"a":' + "".join(p)))
_TAILS = ["", "}", '"}', "]}", "0}", '"]}', "}}", "]}}", ':0}', '":0}', "0]}", '0"}', "e}",
          "1}", '"}}', "ue}", "l}", "se}"]


@settings(max_examples=800, deadline=None)
@given(text=_STRINGS)
def test_the_automaton_accepts_what_json_loads_as_an_object(text):
    fsm = JsonObjectAutomaton()
    end = fsm.walk(fsm.start, text)
    want = is_json_object(text) and within_bounds(text)
    assert fsm.accepts(end) == want, text
    if want:  # every prefix of an accepted text is live
        state = fsm.start
        for c in text:
            assert fsm.can_continue(state)
            state = fsm.step(state, c)
    if end != fsm.DEAD:  # live: some completion is a JSON object
        rest = completion(fsm, end)
        assert rest is not None and is_json_object(text + rest), (text, rest)
    else:  # dead: none of these closings repairs it (bounds aside)
        for tail in _TAILS:
            assert not (is_json_object(text + tail) and within_bounds(text + tail)), (text, tail)


def test_chosen_texts():
    fsm = JsonObjectAutomaton()
    yes = ['{}', '{"a":1}', '{"a":-0.5E+10,"b":[true,false,null,{}],"c":"\\u00e9\\n\\"x"}',
           '{ "a" : [ ] }', '{"\U0001F642":"\u00e9"}', '{"a":0e0}', '{"a":"\x7f"}',
           '{"a":1.5e3}', '{"a":-2.25E-07}', '{"a":10.0e+1}']
    no = ['[]', '1', '"a"', 'null', ' {}', '{} ', '{"a":01}', '{"a":1.}', '{"a":.5}', '{"a":+1}',
          '{"a":NaN}', '{"a":Infinity}', '{"a":tru}', "{'a':1}", '{"a":1,}', '{a:1}',
          '{"a":"\x01"}', '{"a":"\\x"}', '{"a":"\\u12g4"}', '{"a" 1}', '{}{}', '{"a":[1 2]}',
          '{"a":1e}', '{"a":1e+}', '{"a":1.e1}', '{"a":-}', '{"a":1.5.5}', '{"a":[1,]}']
    for text in yes + no:
        assert fsm.fullmatch(text) == (text in yes) == is_json_object(text), text


def test_the_bounds():
    """MAX_DEPTH containers nest, one more is dead; MAX_WHITESPACE spaces between tokens, one
    more is dead; whitespace inside strings is not counted."""
    fsm = JsonObjectAutomaton()
    deepest = '{"a":' + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "}"
    assert fsm.fullmatch(deepest) and is_json_object(deepest)
    too_deep = '{"a":' + "[" * MAX_DEPTH
    assert fsm.walk(fsm.start, too_deep) == fsm.DEAD
    assert fsm.walk(fsm.start, too_deep[:-1]) != fsm.DEAD
    spaced = "{" + " " * MAX_WHITESPACE + '"a"' + "\n" * MAX_WHITESPACE + ":1}"
    assert fsm.fullmatch(spaced)
    assert fsm.walk(fsm.start, "{" + " " * (MAX_WHITESPACE + 1)) == fsm.DEAD
    assert fsm.fullmatch('{"a":"' + " " * 100 + '"}')
    # The state set stays small: a long string and a long number are one state each.
    before = len(fsm._keys)
    fsm.walk(fsm.start, '{"a":"' + "x" * 1000 + '","b":' + "9" * 1000)
    assert len(fsm._keys) - before < 20


def test_charsets_are_the_moves():
    """charsets(s) holds exactly the characters with a live move (CompiledGuide asks it whether a
    character split over tokens may begin), non-ASCII ones only inside strings."""
    fsm = JsonObjectAutomaton()
    for prefix in ["", "{", '{"', '{"a"', '{"a":', '{"a":1', '{"a":"\\', '{"a":"\\u1', '{"a":t',
                   '{"a":[', '{"a":[1', "{}"]:
        state = fsm.walk(fsm.start, prefix)
        sets = fsm.charsets(state)
        for c in [chr(i) for i in range(128)] + ["\u00e9", "\U0001F642", "\u4e2d"]:
            live = fsm.step(state, c) != fsm.DEAD
            assert any(c in cs for cs in sets) == live, (prefix, c)
        assert any(cs.meets(0x80, 0x10FFFF) for cs in sets) == (prefix == '{"')


# -- the guide over a vocabulary ---------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))


@pytest.fixture(scope="module")
def llm(demo_dir, device):
    return make_llm(demo_dir, device, max_model_len=512)


def test_each_states_allowed_ids_are_the_tokens_that_walk_it(llm):
    """Against a walk of every token's bytes from the state (EOS where the text is complete),
    a character split over tokens inside a string included."""
    vocab = llm.engine.vocab_size
    index = TokenIndex(llm.get_tokenizer(), vocab)
    eos = set(llm.engine.eos_ids)
    compiled = CompiledGuide(JSON_OBJECT, index, llm.engine.eos_ids)

    def brute(state):
        want = {i for i, b in index.bytes.items() if compiled.walk(state, b) is not None}
        return want | eos if compiled.accepts(state) or not want else want

    emoji = "\U0001F642".encode()
    for prefix in [b"", b"{", b'{"a', b'{"a": ', b'{"a":1', b'{"a":[tr', b'{"a":"x\\',
                   b'{"' + emoji[:2], b"{}"]:
        state = compiled.walk(compiled.start, prefix)
        assert state is not None, prefix
        assert set(compiled.allowed(state, vocab)) == brute(state), prefix
    assert set(compiled.allowed(compiled.walk(compiled.start, b"{}"), vocab)) == eos
    assert compiled.walk(compiled.start, b"{" + emoji[:2]) is None  # not outside a string


def test_the_cache_keeps_json_object_apart_from_regexes(llm):
    cache = GuideCache(llm.get_tokenizer(), llm.engine.vocab_size, llm.engine.eos_ids)
    as_object = cache.get(JSON_OBJECT)
    as_regex = cache.get("json_object")  # the regex that spells the word
    assert as_object is not as_regex and as_object is cache.get(JSON_OBJECT)
    assert isinstance(as_object.fsm, JsonObjectAutomaton)
    assert as_regex.fsm.fullmatch("json_object") and not as_object.fsm.fullmatch("json_object")
    assert cache.get(("regex", "json_object")) is as_regex


@pytest.mark.parametrize("temperature, seed", [(1.0, 1), (1.0, 7), (0.7, 3), (0.0, None)])
def test_outputs_are_json_objects(llm, temperature, seed):
    """Each finished output is a JSON object json.loads reads; one cut short is a live prefix.
    A bias toward the closing characters makes most outputs finish within max_tokens."""
    tok = llm.get_tokenizer()
    closers = {i: 4.0 for i in range(llm.engine.vocab_size) if tok.decode([i]).strip() in
               ('"', "}", "]", '"}', "},", "}]", '",')}
    params = SamplingParams(temperature=temperature, max_tokens=60, n=3 if temperature else 1,
                            seed=seed, logit_bias=closers,
                            structured_outputs=StructuredOutputsParams(json_object=True))
    outs = llm.generate(["The quick brown fox", "Hello, my name is", "{"], params, use_tqdm=False)
    fsm, eos, done = JsonObjectAutomaton(), set(llm.engine.eos_ids), 0
    for out in outs:
        for c in out.outputs:
            if c.finish_reason == "length":
                assert fsm.walk(fsm.start, c.text) != fsm.DEAD, c.text
                continue
            assert c.finish_reason == "stop" and c.token_ids[-1] in eos
            assert isinstance(json.loads(c.text), dict) and fsm.fullmatch(c.text), c.text
            done += 1
    assert done > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(json_object=True, regex="a"), "exactly one"),
    (dict(json_object=True, choice=["a"]), "exactly one"),
    (dict(json_object=True, json={"type": "null"}), "exactly one"),
    (dict(json_object=False), "exactly one"),  # False asks for nothing, as vLLM's
    (dict(json_object="yes"), "must be a bool"),
    (dict(json_object=1), "must be a bool"),
    (dict(json_object=True, grammar='root ::= "a"'), "exactly one"),
])
def test_bad_json_object_constraints_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_json_object_params():
    params = StructuredOutputsParams(json_object=True)
    assert params.key == JSON_OBJECT and params.pattern is None
    assert StructuredOutputsParams(regex="a").key == ("regex", "a")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=params)
