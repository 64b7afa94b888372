"""vLLM's StructuredOutputsParams(grammar=...) (server: structured_outputs.grammar and the older
guided_grammar): a GBNF grammar in xgrammar's syntax, vLLM's default backend (vLLM's
docs/features/structured_outputs.md and its simplified SQL grammar, root ::= select_statement;
vllm/v1/structured_output/backend_xgrammar.py hands the text to xgrammar's compile_grammar;
xgrammar's cpp/grammar_parser.cc is the syntax). Grammars without recursion are written as one
regex (runtime/gbnf.py) for the DFA every other constraint takes.

The oracle is independent of gbnf.py and of the regex it writes: GBNF read here by a tokenizer and
recursive descent of its own, and membership decided by brute force over the parsed rules (every
end position each element can reach). Random grammars (escapes, classes, ranges, repetitions,
rule references, comments) are checked both ways: strings derived from the grammar are accepted
by the DFA, and mutated / random strings are accepted exactly when the oracle says so. Outputs
sampled on the demo model (random weights: any allowed token may come) through LLM.generate and
the server are in the language and complete with EOS. Recursive grammars are refused by their
rule cycle, malformed ones by what is wrong and where (line and column, as xgrammar's), before
any work. The xgrammar behaviours pinned below (\\x takes every hex digit that follows, a '-'
after a range is itself, [^] is any character, a rule name begins its line) were compared
against xgrammar 0.2.9's own parser while writing this file; it is not installed here."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from minivllm import SamplingParams
from minivllm.runtime.demo import ensure_demo_model
from minivllm.runtime.regex_fsm import RegexDFA
from minivllm.runtime.sampling_params import StructuredOutputsParams

from engine_helpers import make_llm
from test_audit_s75_server import assert_refused, baseline, request, server  # noqa: F401
from test_server import model_dir  # noqa: F401

# vLLM's docs/features/structured_outputs.md, verbatim (its indentation and blank lines too).
SQL = """
    root ::= select_statement

    select_statement ::= "SELECT " column " from " table " where " condition

    column ::= "col_1 " | "col_2 "

    table ::= "table_1 " | "table_2 "

    condition ::= column "= " number

    number ::= "1 " | "2 "
"""
SQL_LANGUAGE = {f"SELECT {c} from {t} where {d}= {n}"
                for c, t, d, n in itertools.product(["col_1 ", "col_2 "], ["table_1 ", "table_2 "],
                                                    ["col_1 ", "col_2 "], ["1 ", "2 "])}


# -- the oracle: GBNF read and matched here, by brute force -----------------------------------

_TOKEN = re.compile(r"""
    (?P<space>[ \t\r\n]+|\#[^\r\n]*)
  | (?P<define>[A-Za-z_.-][A-Za-z0-9_.-]*)[ \t]*::=
  | (?P<string>"(?:[^"\\\r\n]|\\.)*")
  | (?P<cls>\[(?:[^\]\\\r\n]|\\.)*\])
  | (?P<name>[A-Za-z_.-][A-Za-z0-9_.-]*)
  | \{[ ]*(?P<lo>[0-9]+)[ ]*(?P<comma>,[ ]*(?P<hi>[0-9]+)?[ ]*)?\}
  | (?P<op>[()|*+?])
""", re.X)
_SIMPLE = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "a": "\a", "b": "\b", "f": "\f",
           "v": "\v", "e": "\x1b"}


def _chars(body: str) -> list[tuple[str, bool]]:
    """A literal's or class's characters, each with whether it is a bare '-'."""
    out, i = [], 0
    while i < len(body):
        if body[i] != "\\":
            out.append((body[i], body[i] == "-"))
            i += 1
            continue
        hexa = re.match(r"x([0-9a-fA-F]+)|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})", body[i + 1:])
        if hexa:
            out.append((chr(int(next(g for g in hexa.groups() if g), 16)), False))
            i += 1 + hexa.end()
        else:
            out.append((_SIMPLE.get(body[i + 1], body[i + 1]), False))
            i += 2
    return out


class Oracle:
    """A GBNF grammar's language, decided by enumerating every way its rules match."""

    def __init__(self, grammar: str):
        tokens, at = [], 0
        while at < len(grammar):
            m = _TOKEN.match(grammar, at)
            assert m, f"the oracle cannot read {grammar[at:at + 20]!r}"
            at = m.end()
            if m.lastgroup != "space":
                tokens.append(m)
        self.tokens, self.k, self.rules = tokens, 0, {}
        while self.k < len(tokens):
            name = tokens[self.k].group("define")
            self.k += 1
            self.rules[name] = self.alternation()

    def peek(self):
        return self.tokens[self.k] if self.k < len(self.tokens) else None

    def alternation(self):
        options = [self.sequence()]
        while (m := self.peek()) is not None and m.group("op") == "|":
            self.k += 1
            options.append(self.sequence())
        return ("alt", options)

    def sequence(self):
        items = []
        while (m := self.peek()) is not None and m.group("op") not in ("|", ")") \
                and not m.group("define"):
            items.append(self.item())
        return ("seq", items)

    def item(self):
        m = self.peek()
        self.k += 1
        if m.group("string"):
            node = ("lit", "".join(c for c, _ in _chars(m.group("string")[1:-1])))
        elif m.group("cls"):
            body = m.group("cls")[1:-1]
            negated = body.startswith("^")
            items = _chars(body[negated:])
            ranges, k = [], 0
            while k < len(items):  # xgrammar: a '-' between two members makes a range
                if k + 2 < len(items) and items[k + 1][1]:
                    ranges.append((items[k][0], items[k + 2][0]))
                    k += 3
                else:
                    ranges.append((items[k][0], items[k][0]))
                    k += 1
            node = ("cls", ranges, negated)
        elif m.group("name"):
            node = ("ref", m.group("name"))
        else:
            assert m.group("op") == "("
            node = ("seq", []) if self.peek().group("op") == ")" else self.alternation()
            self.k += 1
        m = self.peek()
        if m is not None and m.group("op") in ("*", "+", "?"):
            self.k += 1
            return ("rep", node, {"*": 0, "+": 1, "?": 0}[m.group("op")],
                    1 if m.group("op") == "?" else None)
        if m is not None and m.group("lo") is not None:
            self.k += 1
            lo = int(m.group("lo"))
            hi = lo if not m.group("comma") else int(m.group("hi")) if m.group("hi") else None
            return ("rep", node, lo, hi)
        return node

    def ends(self, node, s: str, i: int, memo: dict) -> frozenset[int]:
        """Every position after a match of `node` in s from i."""
        key = (id(node), i)
        if key not in memo:
            memo[key] = frozenset(self._ends(node, s, i, memo))
        return memo[key]

    def _ends(self, node, s, i, memo):
        kind = node[0]
        if kind == "lit":
            return {i + len(node[1])} if s.startswith(node[1], i) else set()
        if kind == "cls":
            hit = i < len(s) and any(lo <= s[i] <= hi for lo, hi in node[1])
            return {i + 1} if i < len(s) and hit != node[2] else set()
        if kind == "ref":
            return self.ends(self.rules[node[1]], s, i, memo)
        if kind == "alt":
            return set().union(*(self.ends(o, s, i, memo) for o in node[1]))
        if kind == "seq":
            at = {i}
            for item in node[1]:
                at = set().union(*(self.ends(item, s, j, memo) for j in at))
            return at
        _, item, lo, hi = node
        at, out, seen = {i}, set(), set()
        for count in itertools.count():
            if count >= lo:
                at -= seen  # positions met before go nowhere new: the loop ends
                seen |= at
                out |= at
            if not at or count == hi:
                return out
            at = set().union(*(self.ends(item, s, j, memo) for j in at))

    def accepts(self, s: str) -> bool:
        return len(s) in self.ends(self.rules["root"], s, 0, {})

    def derive(self, rnd: random.Random, node=None, alphabet: str = "") -> str | None:
        """A random string of the language (None where a part has none)."""
        node = self.rules["root"] if node is None else node
        kind = node[0]
        if kind == "lit":
            return node[1]
        if kind == "cls":
            pool = [c for c in alphabet + "".join(lo for lo, _ in node[1])
                    if any(lo <= c <= hi for lo, hi in node[1]) != node[2]]
            return rnd.choice(pool) if pool else None
        if kind == "ref":
            return self.derive(rnd, self.rules[node[1]], alphabet)
        if kind == "alt":
            for option in rnd.sample(node[1], len(node[1])):
                if (got := self.derive(rnd, option, alphabet)) is not None:
                    return got
            return None
        items = node[1] if kind == "seq" else \
            [node[1]] * rnd.randint(node[2], node[2] + 2 if node[3] is None else node[3])
        parts = [self.derive(rnd, item, alphabet) for item in items]
        return None if None in parts else "".join(parts)


def dfa(grammar: str) -> RegexDFA:
    return RegexDFA(StructuredOutputsParams(grammar=grammar).pattern)


# -- random grammars, both ways ----------------------------------------------------------------

_LITERAL_CHARS = ["a", "b", "-", " ", "]", "#", r"\n", r"\"", r"\\", r"\x62", r"\u00e9",
                  r"\U0001F600", r"\t", "é"]
_CLASS_ITEMS = ["a", "b", "a-b", r"\-", r"\]", r"\n", r"\\", "é", r"\^", "0-9", r"\x41-\x43", "😀"]
_QUANTIFIERS = ["", "", "", "*", "+", "?", "{2}", "{0,2}", "{1,}", "{ 1 , 2 }", "{0}"]
ALPHABET = "ab- ]#\n\"\\éA0😀\t^"


def random_grammar(rnd: random.Random) -> str:
    names = ["r-1", "r.2", "r_3"][:rnd.randint(0, 3)]

    def element(depth, refs):
        r = rnd.random()
        if r < 0.3:
            e = '"' + "".join(rnd.choice(_LITERAL_CHARS) for _ in range(rnd.randint(0, 3))) + '"'
        elif r < 0.55:
            # a bare '-' only first: between two members it would make a range, maybe reversed
            e = "[" + rnd.choice(["", "", "^"]) + rnd.choice(["", "", "-"]) + "".join(
                rnd.choice(_CLASS_ITEMS) for _ in range(rnd.randint(0, 3))) + "]"
        elif r < 0.75 and refs:
            e = rnd.choice(refs)
        elif depth < 2:
            e = "(" + alternation(depth + 1, refs) + ")" if rnd.random() < 0.9 else "()"
        else:
            e = '"a"'
        return e + rnd.choice(_QUANTIFIERS)

    def alternation(depth, refs):
        return rnd.choice([" | ", "\n    | "]).join(
            " ".join(element(depth, refs) for _ in range(rnd.randint(1, 3)))
            for _ in range(rnd.randint(1, 2)))

    lines = [f"root ::= {alternation(0, names)}"]
    for k, name in enumerate(names):  # each refers only to those after it: no recursion
        lines.append(f"{name} ::= {alternation(0, names[k + 1:])}" +
                     rnd.choice(["", "  # a comment ::= x"]))
    rnd.shuffle(lines)  # root need not come first
    return rnd.choice(["\n", "\r\n", "\n\n"]).join(lines)


def mutations(rnd: random.Random, s: str) -> list[str]:
    out = []
    for _ in range(6):
        i = rnd.randint(0, len(s))
        c = rnd.choice(ALPHABET)
        out += [s[:i] + c + s[i:], s[:i] + s[i + 1:], s[:i] + c + s[i + 1:]]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_random_grammars_the_dfa_takes_exactly_the_oracles_strings(seed):
    rnd = random.Random(seed)
    inside = outside = 0
    for _ in range(25):
        grammar = random_grammar(rnd)
        oracle, automaton = Oracle(grammar), dfa(grammar)
        derived = [d for _ in range(12)
                   if (d := oracle.derive(rnd, alphabet=ALPHABET)) is not None]
        for text in derived:  # in the language: accepted
            assert oracle.accepts(text), (grammar, text)  # the oracle's own sanity
            assert automaton.fullmatch(text), (grammar, text)
        others = [t for d in derived for t in mutations(rnd, d)] + [
            "".join(rnd.choice(ALPHABET) for _ in range(rnd.randint(0, 5))) for _ in range(20)]
        for text in others:  # either way: accepted exactly when the oracle derives it
            want = oracle.accepts(text)
            assert automaton.fullmatch(text) == want, (grammar, text, want)
            inside, outside = inside + want, outside + (not want)
    assert inside > 50 and outside > 500


@pytest.mark.parametrize("grammar, yes, no", [
    # xgrammar's \x reads every hex digit that follows: "\x41BC" is U+41BC, not "ABC".
    (r'root ::= "\x41BC" "\x41" "-"', ["\u41bcA-"], ["ABCA-"]),
    (r'root ::= "\u00e9\U0001F600\t\"\\\/\e\0"', ["é😀\t\"\\/\x1b\0"], ["é😀"]),
    # A '-' first, last or after a range is itself; \- \] \^ \\ are themselves.
    (r"root ::= [a-b-d]", ["a", "b", "-", "d"], ["c"]),
    (r"root ::= [--/] [\]\-\^\\]", ["-]", ".-", "/^", "-\\"], ["+]", "-a"]),
    (r"root ::= [^a-c\n]", ["d", "😀", " "], ["a", "b", "\n"]),
    ("root ::= [^] []?", ["a", "\n", "😀"], ["", "ab"]),  # [^]: any character; []: none
    ('root ::= () "a"{0} ("b" "c"){2} "d"{2,} "e"{ 0 , 1 }', ["bcbcdd", "bcbcddde"],
     ["bcdd", "bcbcd", "abcbcdd", "bcbcddee"]),
    # A body may go on over lines; a comment ends at its line; \r\n ends lines too.
    ('root ::= "a"   # root ::= "x"\r\n  | b\r\nb ::= "b"+ # c', ["a", "b", "bbb"], ["x", ""]),
    ('root ::= a-b.c\na-b.c ::= "x" [0-9]', ["x0", "x9"], ["a-b.c", "x"]),
    # A recursive rule root does not reach changes nothing (xgrammar takes it too).
    ('root ::= "x"\nunused ::= "(" unused ")" | "y"', ["x"], ["y", "(y)"]),
    ('root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+ | "-" [0-9]+',
     ["1", "1+-2+30"], ["1+", "+1", "(1)"]),
])
def test_chosen_grammars(grammar, yes, no):
    oracle, automaton = Oracle(grammar), dfa(grammar)
    for text in yes + no:
        assert oracle.accepts(text) == (text in yes), (grammar, text)
        assert automaton.fullmatch(text) == (text in yes), (grammar, text)


def test_the_docs_sql_grammar_takes_its_16_queries_and_nothing_else():
    automaton, oracle = dfa(SQL), Oracle(SQL)
    rnd = random.Random(0)
    for text in SQL_LANGUAGE:
        assert automaton.fullmatch(text) and oracle.accepts(text)
        for other in mutations(rnd, text) + [text.strip(), text + " "]:
            assert automaton.fullmatch(other) == (other in SQL_LANGUAGE), other


# -- refusals, before any work -----------------------------------------------------------------

@pytest.mark.parametrize("grammar, match", [
    ('root ::= "a" expr\nexpr ::= "(" expr ")" | "x"',
     r"rule 'expr' is recursive \(expr -> expr\)"),
    ('root ::= a\na ::= b\nb ::= "x" a?', r"rule 'a' is recursive \(a -> b -> a\)"),
    ('root ::= "x" root?', r"rule 'root' is recursive \(root -> root\)"),
    ("root ::= r0\n" + "\n".join(f"r{i} ::= r{i + 1}" for i in range(50)) + "\nr50 ::= r0",
     r"\(r0 -> r1 -> r2 -> r3 -> r4 -> \.\.\. \(44 more\) -> r49 -> r50 -> r0\)"),
])
def test_a_recursive_grammar_is_refused_by_its_cycle(grammar, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(grammar=grammar)


def test_the_cycle_is_named_before_any_regex_is_written():
    """A grammar that is both recursive and huge once inlined (2^40 copies of a rule): named by
    its cycle at once, not by the size of a regex that was never written."""
    huge = "\n".join(f"r{i} ::= r{i + 1} r{i + 1}" for i in range(40)) + '\nr40 ::= "ab"'
    with pytest.raises(ValueError, match=r"recursive \(loop -> loop\)"):
        StructuredOutputsParams(grammar=f'root ::= r0 | loop\nloop ::= "(" loop ")"\n{huge}')
    with pytest.raises(ValueError, match="longer than 200000 characters"):
        StructuredOutputsParams(grammar=f"root ::= r0\n{huge}")
    # The bound is regex_fsm's on a pattern: 20,001 copies of a 10-character rule pass it.
    with pytest.raises(ValueError, match="grammar: written as a regex it is longer than 200000"):
        StructuredOutputsParams(grammar="root ::= " + "r " * 20_001 + '\nr ::= "abcdefghij"')


@pytest.mark.parametrize("grammar, match", [
    # The places xgrammar 0.2.9 names for these, line and column alike.
    ('root ::= "a" missing', "line 1, column 14: rule 'missing' is not defined"),
    ('root ::= "x"\nunused ::= nope', "line 2, column 12: rule 'nope' is not defined"),
    ('root ::= "a" |', "line 1, column 15: expected a string"),
    ("root ::= 'a'", "line 1, column 10: unexpected character \"'\""),
    ('root ::= "a" b ::= "c"', "line 1, column 14: rule 'b' must begin its line"),
    ("root ::= [z-a]", "line 1, column 11: bad range 'z'-'a'"),
    ('root ::= ("a"', r"line 1, column 14: expected \)"),
    ('root ::= "a"**', "line 1, column 14: expected a string"),
    ('root ::= "\\q"', r"line 1, column 11: invalid escape \\q"),
    (r"root ::= [\d]", r"line 1, column 11: invalid escape \\d \(character class escapes"),
    ('root ::= "a\nb"', 'line 1, column 12: missing "'),
    ('root ::= "a" \n root ::= "b"', r"line 2, column 2: rule 'root' is defined twice \(first at "
                                     r"line 1, column 1\)"),
    # Not xgrammar's words, but what is wrong and where.
    ("expr ::= \"a\"", "no rule named root"),
    ('root ::= "a"{3,1}', "line 1, column 13: bad repetition"),
    ('root ::= "a"{100001}', "repetition count 100001 is more than 100000"),
    ("root ::= [a-z", "line 1, column 10: missing ]"),
    ('root ::= "a" (= "b")', "line 1, column 14: lookahead assertions"),
    ('root ::= Regex("a+")', r"Regex\(\.\.\.\) macro is not supported"),
    ('root[max_tokens=3] ::= "a"', r"rule attributes name\[\.\.\.\] are not supported"),
    ('root ::= "\\U00110000"', "beyond U\\+10FFFF"),
    ('root ::= "a")', "line 1, column 13: unbalanced"),
    ("root ::=\nb ::= \"c\"", "rule 'root' has no body"),
    ('start: "a"', "Lark grammar is not supported"),
    ("", "no rule `name ::= ...`"),
    ("root ::= " + "(" * 101 + '"a"' + ")" * 101, "nested too deep"),
    ('root ::= ' + '"a" ' * 60_000, "grammar is too large: 240009 characters"),
    (5, "grammar must be a string"),
    (b'root ::= "a"', "grammar must be a string"),
])
def test_a_malformed_grammar_is_refused_by_what_and_where(grammar, match):
    with pytest.raises(ValueError, match=match) as e:
        StructuredOutputsParams(grammar=grammar)
    assert str(e.value).startswith("StructuredOutputsParams: grammar")


def test_grammar_is_one_constraint_among_the_others():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar"):
        StructuredOutputsParams(grammar='root ::= "a"', regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(grammar='root ::= "a"', json_object=True)
    params = StructuredOutputsParams(grammar='root ::= "a" | "b"')
    assert params.key == ("regex", params.pattern) and RegexDFA(params.pattern).fullmatch("b")


# -- sampled outputs -----------------------------------------------------------------------------

RICH = r"""
root ::= name ("," " "? name){0,2} " " verdict "."  # up to three names, then a verdict
name ::= [A-Z] [a-z]{1,5}
verdict ::= "yes" | "no" | "caf\u00e9" | [0-9]{1,3} | "\U0001F600"
"""
# Characters of several UTF-8 bytes, which a byte-level vocabulary spells over several tokens.
WIDE = r'root ::= ("caf\u00e9" | "na\u00efve") " " [\U0001F600-\U0001F603]{1,2} [!-/]?'


@pytest.fixture(scope="module")
def llm(tmp_path_factory, device):
    return make_llm(ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model")), device,
                    max_model_len=256)


@pytest.mark.parametrize("grammar", [SQL, RICH, WIDE], ids=["sql", "rich", "wide"])
def test_sampled_outputs_are_in_the_language_and_complete(llm, grammar):
    """At temperature 1 on random weights any allowed token may come: every output is a string
    of the language (the oracle's), ended by EOS (each language is finite and max_tokens is past
    its longest string, so every output completes)."""
    oracle = Oracle(grammar)
    params = SamplingParams(temperature=1.0, max_tokens=64, n=6, seed=5,
                            structured_outputs=StructuredOutputsParams(grammar=grammar))
    outs = llm.generate(["The quick brown fox", "SELECT"], params, use_tqdm=False)
    eos, texts = set(llm.engine.eos_ids), set()
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop" and c.token_ids[-1] in eos, c
            assert oracle.accepts(c.text), c.text
            texts.add(c.text)
    if grammar is SQL:
        assert texts <= SQL_LANGUAGE
    assert len(texts) > 3  # sampled, not one string over and over


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", ["structured_outputs", "guided_grammar"])
def test_the_sql_grammar_through_the_server(server, path, field):  # noqa: F811
    body = {"max_tokens": 50, "temperature": 1.0, "n": 3, "seed": 2,
            field: {"grammar": SQL} if field == "structured_outputs" else SQL}
    body.update({"prompt": "Generate an SQL query:"} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "Generate an SQL query."}]})
    status, answer = request(server, path, body)
    assert status == 200, answer
    for c in answer["choices"]:
        text = c["text"] if "text" in c else c["message"]["content"]
        assert c["finish_reason"] == "stop" and text in SQL_LANGUAGE, c


@pytest.mark.parametrize("fields, match", [
    ({"structured_outputs": {"grammar": 'root ::= "(" root ")" | "x"'}},
     "rule 'root' is recursive (root -> root)"),
    ({"guided_grammar": 'root ::= "a" undefined'}, "line 1, column 14: rule 'undefined'"),
    ({"guided_grammar": 'root ::= "a"', "guided_regex": "a"}, "give one constraint"),
    ({"structured_outputs": {"grammar": 'root ::= "a"', "choice": ["a"]}}, "exactly one"),
    ({"guided_grammar": ["root ::= x"]}, "'guided_grammar' must be a string"),
])
def test_a_bad_grammar_is_a_400_before_any_work(server, baseline, fields, match):  # noqa: F811
    assert_refused(server, baseline, "/v1/completions",
                   {"prompt": "x", "max_tokens": 4, **fields}, match)


def test_a_long_regexs_error_quotes_its_head_only():
    """A refused regex's error quotes its first 200 characters and its length, not the whole
    of it: a grammar's inlined regex may run to 200,000 characters."""
    from minivllm.runtime.regex_fsm import MAX_GROUP_DEPTH, RegexDFA

    depth = MAX_GROUP_DEPTH + 5
    pattern = "x" * 50_000 + "(?:" * depth + "a" + ")" * depth
    with pytest.raises(ValueError, match="nested too deep") as e:
        RegexDFA(pattern)
    assert len(str(e.value)) < 400 and f"({len(pattern)} chars)" in str(e.value)
