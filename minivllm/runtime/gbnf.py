"""GBNF grammars (vLLM's StructuredOutputsParams(grammar=...)) as one regex, for the regular ones.

vLLM hands a grammar to xgrammar, its default backend, whose EBNF is llama.cpp's GBNF: rules
`name ::= body`, each name at the start of its line, `root` the start. A body is alternatives
`|` of sequences of elements: "string literals" (escapes \\n \\t \\r \\" \\\\ \\' \\? \\/ \\a \\b
\\f \\v \\e \\0, \\x followed by any number of hex digits, \\u and 4 of them, \\U and 8), character
classes [a-z_] and [^...] (the same escapes, and \\- \\] \\[ \\^ ... for themselves), rule names,
and groups ( ) (`()` is the empty string), each with at most one quantifier * + ? {m} {m,} {m,n};
`#` starts a comment. This is xgrammar's syntax (its cpp/grammar_parser.cc), its refusals
included: a character class escape \\d \\s \\w, a rule name not at the start of its line, an
empty alternative, two quantifiers in a row.

A grammar whose rules reach no rule from itself describes a regular language: each reference is
replaced by the rule's body (`grammar_regex`), and the regex goes the way of every other
constraint (regex_fsm.RegexDFA). A recursive grammar (`expr ::= term ("+" term)*` is fine, `expr
::= term | "(" expr ")"` is not) is refused, its cycle named, before any regex is written; so are
xgrammar's lookahead assertions `(= ...)` and macros (TagDispatch, Regex, ...), and Lark grammars
(vLLM takes them through xgrammar's Lark converter). A grammar's errors name their line and
column, as xgrammar's do.
"""

from __future__ import annotations

from .regex_fsm import MAX_NFA_STATES, MAX_PATTERN_CHARS

# A rule's node: ("lit", text) (text "" for the empty string), ("class", ((lo, hi), ..),
# negated), ("ref", name), ("seq", [node, ..]), ("alt", [node, ..]) or
# ("rep", node, lo, hi) (hi None: no most).

MAX_NEST = 100  # parentheses open at once: the parser recurses per level
MAX_CODE_POINT = 0x10FFFF
_NAME_FIRST = set("_-.abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_NAME_CHARS = _NAME_FIRST | set("0123456789")
_HEX = set("0123456789abcdefABCDEF")
_ESCAPES = {"'": "'", '"': '"', "?": "?", "\\": "\\", "/": "/", "a": "\a", "b": "\b",
            "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "0": "\0", "e": "\x1b"}
_CLASS_ESCAPES = {c: c for c in "^$\\.*+?()[]{}|/-"}  # in a class, on top of _ESCAPES
_MACROS = ("TagDispatch", "Token", "ExcludeToken", "TokenTagDispatch", "Regex")


def _where(text: str, at: int) -> str:
    """Offset `at` of the grammar as xgrammar names a place: line and column, 1-based."""
    line, column = text.count("\n", 0, at) + 1, at - text.rfind("\n", 0, at)
    return f"line {line}, column {column}"


def _error(text: str, at: int, what: str) -> ValueError:
    return ValueError(f"grammar: {_where(text, at)}: {what}")


def _escape(text: str, i: int, extra: dict) -> tuple[str, int]:
    """The character of the escape at text[i] (a backslash) and the offset after it. `extra`:
    the escapes a character class takes on top of a string's."""
    c = text[i + 1:i + 2]
    if c and c in extra:
        return extra[c], i + 2
    if c and c in _ESCAPES:
        return _ESCAPES[c], i + 2
    if not c or c not in "xuU":
        hint = " (character class escapes \\d \\s \\w are not supported, nor by xgrammar)" \
            if c and c in "dDsSwW" and extra else ""
        raise _error(text, i, f"invalid escape \\{c}{hint}")
    end = i + 2
    if c == "x":  # xgrammar's: as many hex digits as follow
        while end < len(text) and text[end] in _HEX:
            end += 1
    else:
        end += 4 if c == "u" else 8
    digits = text[i + 2:end]
    if not digits or len(digits) != end - i - 2 or not set(digits) <= _HEX:
        raise _error(text, i, f"bad \\{c} escape (\\x takes hex digits, \\u 4, \\U 8)")
    if int(digits, 16) > MAX_CODE_POINT:
        raise _error(text, i, f"\\{c}{digits} is beyond U+10FFFF")
    return chr(int(digits, 16)), end


def _tokens(text: str) -> list[tuple]:
    """The grammar's tokens: (kind, value, offset). Kinds: "name", "string" (its characters),
    "class" ((ranges, negated)), "int", "::=", one of ( ) | * + ? { } , and "end"."""
    out, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n#":
            if text[i] == "#":  # a comment, to the end of its line
                while i < n and text[i] not in "\r\n":
                    i += 1
            else:
                i += 1
        if i == n:
            out.append(("end", None, i))
            return out
        c, start = text[i], i
        if c == '"':
            chars, i = [], i + 1
            while i < n and text[i] not in '"\r\n':
                if text[i] == "\\":
                    ch, i = _escape(text, i, {})
                else:
                    ch, i = text[i], i + 1
                chars.append(ch)
            if i == n or text[i] != '"':
                raise _error(text, i, 'missing " at the end of a string literal (a string '
                             'ends on its line)')
            out.append(("string", "".join(chars), start))
            i += 1
        elif c == "[":
            i, value = _char_class(text, i)
            out.append(("class", value, start))
        elif text.startswith("(=", i):
            raise _error(text, i, "lookahead assertions (= ...) are not supported")
        elif c in "()|*+?{},":
            out.append((c, None, start))
            i += 1
        elif text.startswith("::=", i):
            out.append(("::=", None, start))
            i += 3
        elif c in _NAME_FIRST:
            while i < n and text[i] in _NAME_CHARS:
                i += 1
            out.append(("name", text[start:i], start))
        elif "0" <= c <= "9":
            while i < n and "0" <= text[i] <= "9":
                i += 1
            if i - start > 15:  # xgrammar's bound (1e15); int() takes at most 4,300 digits
                raise _error(text, start, f"number {text[start:start + 20]}... is too large")
            out.append(("int", int(text[start:i]), start))
        else:
            hint = {"'": " (string literals are in double quotes)",
                    ":": " (a rule is `name ::= ...`; a Lark grammar is not supported)"}
            raise _error(text, i, f"unexpected character {c!r}{hint.get(c, '')}")


def _char_class(text: str, i: int) -> tuple[int, tuple]:
    """The class at text[i] ('['): (the offset after its ']', (ranges, negated)). A '-' between
    two members is a range; first, last or after a range it is itself (xgrammar's rule)."""
    n, start = len(text), i
    i += 1
    negated = text[i:i + 1] == "^"
    i += negated
    items = []  # (character, whether it is a bare '-', its offset)
    while i < n and text[i] != "]":
        if text[i] in "\r\n":
            raise _error(text, i, "a character class ends on its line")
        at = i
        if text[i] == "\\":
            ch, i = _escape(text, i, _CLASS_ESCAPES)
        else:
            ch, i = text[i], i + 1
        items.append((ch, text[at] == "-", at))
    if i == n:
        raise _error(text, start, "missing ] at the end of a character class")
    ranges, k = [], 0
    while k < len(items):
        lo = items[k][0]
        if k + 2 < len(items) and items[k + 1][1]:
            hi = items[k + 2][0]
            if hi < lo:
                raise _error(text, items[k][2], f"bad range {lo!r}-{hi!r} in a character class "
                             f"(its start is after its end)")
            ranges.append((lo, hi))
            k += 3
        else:
            ranges.append((lo, lo))
            k += 1
    return i + 1, (tuple(ranges), negated)


class _Parser:
    """Recursive descent over the tokens, each rule's body ending where the next rule's name
    (a name followed by ::=) begins."""

    def __init__(self, text: str, tokens: list[tuple], names: set[str]):
        self.text, self.tokens, self.names = text, tokens, names
        self.k = 0
        self.depth = 0

    def error(self, what: str, k: int | None = None) -> ValueError:
        return _error(self.text, self.tokens[self.k if k is None else k][2], what)

    def kind(self, delta: int = 0) -> str:
        return self.tokens[self.k + delta][0]

    def at_rule_start(self) -> bool:
        return self.kind() == "name" and self.kind(1) == "::="

    def shown(self) -> str:
        kind, value, at = self.tokens[self.k]
        if kind == "end":
            return "the end of the grammar"
        if kind in ("name", "int"):
            return repr(str(value))
        return repr(self.text[at:at + 12]) if kind in ("string", "class") else repr(kind)

    def choices(self):
        options = [self.sequence()]
        while self.kind() == "|":
            self.k += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self):
        items = [self.quantified()]  # xgrammar's: no empty alternative (`()` is the empty string)
        while self.kind() not in ("|", ")", "end") and not self.at_rule_start():
            items.append(self.quantified())
        return items[0] if len(items) == 1 else ("seq", items)

    def quantified(self):
        node = self.element()
        kind = self.kind()
        if kind in ("*", "+", "?"):
            self.k += 1
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[kind]
            return ("rep", node, lo, hi)
        if kind == "{":
            lo, hi = self.braces()
            return ("rep", node, lo, hi)
        return node

    def braces(self) -> tuple[int, int | None]:
        start = self.k
        self.k += 1
        if self.kind() != "int":
            raise self.error(f"expected a count in {{m}}, {{m,}} or {{m,n}}, got {self.shown()}")
        lo = hi = self.tokens[self.k][1]
        self.k += 1
        if self.kind() == ",":
            self.k += 1
            hi = None
            if self.kind() == "int":
                hi = self.tokens[self.k][1]
                self.k += 1
        if self.kind() != "}":
            raise self.error(f"expected , or }} in a repetition, got {self.shown()}")
        self.k += 1
        if hi is not None and hi < lo:
            raise self.error(f"bad repetition {{{lo},{hi}}}: the most is below the least", start)
        if max(lo, hi or 0) > MAX_NFA_STATES:  # each copy is a state of the automaton at least
            raise self.error(f"repetition count {max(lo, hi or 0)} is more than "
                             f"{MAX_NFA_STATES} (the automaton's bound on its states)", start)
        return lo, hi

    def element(self):
        kind, value, _ = self.tokens[self.k]
        if kind == "(":
            self.depth += 1
            if self.depth > MAX_NEST:
                raise self.error(f"parentheses nested too deep (more than {MAX_NEST})")
            self.k += 1
            node = ("lit", "") if self.kind() == ")" else self.choices()
            if self.kind() != ")":
                raise self.error(f"expected ), got {self.shown()}")
            self.k += 1
            self.depth -= 1
            return node
        if kind == "string":
            self.k += 1
            return ("lit", value)
        if kind == "class":
            self.k += 1
            return ("class", *value)
        if kind == "name" and not self.at_rule_start():
            if value in _MACROS and self.kind(1) == "(":
                raise self.error(f"xgrammar's {value}(...) macro is not supported")
            if value not in self.names:
                raise self.error(f"rule {value!r} is not defined")
            self.k += 1
            return ("ref", value)
        raise self.error(f"expected a string, a character class, a rule name or ( here, got "
                         f"{self.shown()}")


def parse_grammar(text: str) -> dict[str, tuple]:
    """The grammar's rules, name -> node (see above), in the order written. ValueError naming
    the line and column of what xgrammar's parser refuses, and of a missing `root`."""
    if not isinstance(text, str):
        raise ValueError(f"grammar must be a string (GBNF rules), got {type(text).__name__}")
    if len(text) > MAX_PATTERN_CHARS:
        raise ValueError(f"grammar is too large: {len(text)} characters, more than "
                         f"{MAX_PATTERN_CHARS}")
    tokens = _tokens(text)
    names: dict[str, int] = {}  # name -> the offset of its definition
    for k, (kind, value, at) in enumerate(tokens):
        if kind != "::=":
            continue
        if k == 0 or tokens[k - 1][0] != "name":
            attributes = k >= 2 and tokens[k - 1][0] == "class" and tokens[k - 2][0] == "name"
            raise _error(text, at, "::= must follow a rule's name" + (
                " (xgrammar's rule attributes name[...] are not supported)" if attributes else ""))
        name, name_at = tokens[k - 1][1], tokens[k - 1][2]
        between = text[tokens[k - 2][2]:name_at] if k >= 2 else "\n"
        if "\n" not in between and "\r" not in between:
            raise _error(text, name_at, f"rule {name!r} must begin its line (xgrammar's rule)")
        if name in names:
            raise _error(text, name_at, f"rule {name!r} is defined twice (first at "
                         f"{_where(text, names[name])})")
        names[name] = name_at
    if not names:
        raise ValueError("grammar: no rule `name ::= ...` in it (GBNF, as xgrammar takes it; "
                         "a Lark grammar is not supported)")
    if "root" not in names:
        raise ValueError(f"grammar: no rule named root, where the grammar starts (its rules: "
                         f"{', '.join(list(names)[:8])}{', ...' if len(names) > 8 else ''})")
    parser = _Parser(text, tokens, set(names))
    if not parser.at_rule_start():
        raise parser.error(f"expected a rule `name ::= ...`, got {parser.shown()}")
    rules = {}
    while parser.kind() != "end":
        name = tokens[parser.k][1]
        parser.k += 2
        if parser.kind() == "end" or parser.at_rule_start():
            raise parser.error(f"rule {name!r} has no body")
        rules[name] = parser.choices()
        if parser.kind() == ")":
            raise parser.error("unbalanced )")
    return rules


def _refs(node) -> list[str]:
    """The rule names `node` refers to, in order."""
    kind = node[0]
    if kind == "ref":
        return [node[1]]
    if kind in ("seq", "alt"):
        return [name for item in node[1] for name in _refs(item)]
    if kind == "rep":
        return _refs(node[1])
    return []


def rule_order(rules: dict[str, tuple], root: str = "root") -> list[str]:
    """The rules `root` reaches, each after every rule it refers to. ValueError naming a cycle
    (root -> a -> b -> a) where one reaches itself: the grammar is then no regex's."""
    refs = {name: list(dict.fromkeys(_refs(node))) for name, node in rules.items()}
    order, done = [], set()
    path, on_path = [root], {root: 0}
    todo = [iter(refs[root])]  # a walk, not recursion: a chain of rules may be long
    while todo:
        nxt = next(todo[-1], None)
        if nxt is None:
            todo.pop()
            name = path.pop()
            del on_path[name]
            done.add(name)
            order.append(name)
        elif nxt in on_path:
            cycle = path[on_path[nxt]:] + [nxt]
            if len(cycle) > 10:  # a long one by its ends
                cycle = [*cycle[:5], f"... ({len(cycle) - 8} more)", *cycle[-3:]]
            raise ValueError(f"grammar: rule {nxt!r} is recursive ({' -> '.join(cycle)}): only "
                             f"grammars without recursion (regular languages) are supported; "
                             f"write a repetition with * + ? or {{m,n}}")
        elif nxt not in done:
            on_path[nxt] = len(path)
            path.append(nxt)
            todo.append(iter(refs[nxt]))
    return order


# A fragment's binding: what it may stand beside, or be quantified, without a group.
_ALT, _SEQ, _QUANT, _ATOM = range(4)


def _char(c: str) -> str:
    """One character as regex_fsm (and re) read it, in a class or out of one."""
    if c.isascii() and (c.isalnum() or c == "_"):
        return c
    if " " <= c <= "~":
        return "\\" + c
    code = ord(c)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else c


def _quantifier(lo: int, hi: int | None) -> str:
    short = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((lo, hi))
    if short:
        return short
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{'' if hi is None else hi}}}"


def _group(fragment: tuple[str, int], least: int) -> str:
    text, binding = fragment
    return text if binding >= least else f"(?:{text})"


def _regex(node, done: dict[str, tuple[str, int]]) -> tuple[str, int]:
    """(regex, binding) of a node; `done`: the regex of each rule it refers to."""
    kind = node[0]
    if kind == "lit":
        return "".join(map(_char, node[1])), _ATOM if len(node[1]) == 1 else _SEQ
    if kind == "class":
        ranges, negated = node[1], node[2]
        if not ranges:  # [] is no character, [^] any
            return ("[\\s\\S]" if negated else "[^\\s\\S]"), _ATOM
        body = "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in ranges)
        return f"[{'^' if negated else ''}{body}]", _ATOM
    if kind == "ref":
        return done[node[1]]
    if kind == "rep":
        _, item, lo, hi = node
        inner = _regex(item, done)
        if not inner[0] or hi == 0:  # the empty string, however often
            return "", _SEQ
        if (lo, hi) == (1, 1):
            return inner
        return _joined([inner, (_quantifier(lo, hi), _ATOM)], "", _ATOM), _QUANT
    parts = [p for p in (_regex(item, done) for item in node[1]) if p[0] or kind == "alt"]
    if kind == "seq":
        return parts[0] if len(parts) == 1 else (_joined(parts, "", _SEQ), _SEQ)
    return _joined(parts, "|", _ALT), _ALT


def _joined(parts: list[tuple[str, int]], sep: str, least: int) -> str:
    """The parts' regexes joined by `sep`, each grouped where it binds less than `least`.
    Each reference writes its rule's regex again (rules that refer twice to rules that refer
    twice to ... grow as 2^depth): ValueError, before the text is built, where it would be
    longer than MAX_PATTERN_CHARS."""
    size = sum(len(text) + 4 * (binding < least) for text, binding in parts)
    if size + len(sep) * (len(parts) - 1) > MAX_PATTERN_CHARS:
        raise ValueError(f"grammar: written as a regex it is longer than {MAX_PATTERN_CHARS} "
                         f"characters (each reference writes its rule's regex again)")
    return sep.join(_group(part, least) for part in parts)


def grammar_regex(text: str) -> str:
    """The regex (regex_fsm's syntax, under fullmatch) of the strings the grammar's root rule
    derives. ValueError for a malformed grammar (its line and column), a recursive one (its
    cycle), or one whose regex is longer than regex_fsm.MAX_PATTERN_CHARS; all before any
    regex is built."""
    rules = parse_grammar(text)
    done: dict[str, tuple[str, int]] = {}
    for name in rule_order(rules):
        done[name] = _regex(rules[name], done)
    return done["root"][0]
