"""Qwen3's reasoning: the text a thinking model writes between <think> and </think> before its
answer, split from the answer (vLLM's `--reasoning-parser qwen3`).

Where a completion starts is read from its prompt's last turn, the last of the two tags there
deciding (ThinkTags.prompt_phase): a prompt that opens <think> (Qwen3-2507 thinking models' chat
template) starts the completion inside the reasoning; one that closes it (enable_thinking=False
writes an empty <think></think>) starts it in the answer; one with neither (Qwen3's first
release, whose models write <think> themselves) starts it undecided: reasoning if its first token
is <think>, answer otherwise. The same phases decide when a structured output's constraint starts
(runtime/guide.py: after the reasoning, as vLLM's) and how the text splits (ReasoningSplit), so
that the constrained part is exactly the answer. ThinkBudget is vLLM's thinking_token_budget:
the engine forces </think> where a think block has used it up.
"""

from __future__ import annotations

from dataclasses import dataclass

START_TAG, END_TAG = "<think>", "</think>"
PARSERS = ("qwen3",)

# A completion's phase: inside the reasoning, in the answer, or not yet known (its first token
# decides).
REASONING, ANSWER, UNDECIDED = "reasoning", "answer", "undecided"


def check_parser(name) -> str | None:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"reasoning_parser must be one of {list(PARSERS)} or None, got {name!r}")
    return name


@dataclass(frozen=True)
class ThinkTags:
    """The ids of <think> and </think>, and the special ids that mark a chat turn's bounds
    (<|im_start|>, <|im_end|>, ...)."""

    start: int
    end: int
    turn_marks: frozenset = frozenset()

    def prompt_phase(self, prompt_ids) -> str:
        """The phase a completion of this prompt starts in: the last tag of the prompt's last
        turn decides. Earlier turns do not: Qwen3's template writes the reasoning of the turns
        since the last user message, closed, into the prompt of a tool loop's next step, whose
        model then opens its own <think>."""
        for token in reversed(prompt_ids):
            if token == self.start:
                return REASONING
            if token == self.end:
                return ANSWER
            if token in self.turn_marks:
                break
        return UNDECIDED


def think_tags(tokenizer) -> ThinkTags:
    """The tokenizer's ThinkTags: <think> and </think> must each be one token, as in Qwen3's
    vocabulary (the split and the constraint's start follow the ids the model generates); its
    special tokens bound the turns."""
    if tokenizer is None:
        raise ValueError("a reasoning parser needs a tokenizer, and this engine has none")
    ids = []
    for tag in (START_TAG, END_TAG):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"the qwen3 reasoning parser needs {tag} to be one token of the "
                             f"tokenizer's vocabulary; it encodes as {encoded}")
        ids.append(encoded[0])
    marks = frozenset(getattr(tokenizer, "all_special_ids", ()) or ()) - set(ids)
    return ThinkTags(ids[0], ids[1], marks)


class ThinkBudget:
    """vLLM's thinking_token_budget for one sequence (vllm/v1/sample/thinking_budget_state.py):
    a think block counts the tokens after its <think>, a prompt's own among them where the
    prompt opened it, and once it holds `budget` of them without its </think> the next token is
    forced to be </think>. Every <think> the output writes opens a new block with the whole
    budget again (vLLM's re-entry, PRs 43757 and 45984); a </think> outside a block does
    nothing.

    The state is the known ids' (advance): `count` is the open block's tokens, None outside
    one. A step may be set up while the previous step's token is still being sampled
    (asynchronous scheduling): forced() and needs_known() reason over what that token may be."""

    def __init__(self, tags: ThinkTags, budget: int, prompt_ids, shows_tags: bool = True):
        """shows_tags=False: the prompt's ids are placeholders (a prompt of embeddings), whose
        completion starts outside any think block."""
        self.start, self.end, self.budget = tags.start, tags.end, budget
        count = None
        # The last tag of the prompt's last turn is <think>.
        if shows_tags and tags.prompt_phase(prompt_ids) == REASONING:
            count = list(reversed(prompt_ids)).index(tags.start)  # the tokens after it
        self.first = self.count = count
        self.prompt_len = self.seen = len(prompt_ids)  # seen: the ids advanced over
        self.row = None  # the engine's unforced SamplingRow, kept while only the step changes
        # Whether the sequence reads its generated ids without the budget (multi-token bad
        # words, a structured output): the engine's Sequence.reads_output before it took the
        # budget's need in.
        self.reads_ids = False

    def advance(self, token_ids, known: int) -> None:
        """Walk the sequence's ids (prompt and output) up to `known`, those not seen yet only
        (a step costs its new ids, not the whole output); from the prompt's end again should
        the known ones be fewer than those seen."""
        if known < self.seen:
            self.count, self.seen = self.first, self.prompt_len
        count, start, end = self.count, self.start, self.end
        for token in token_ids[self.seen:known]:
            if count is None:
                count = 0 if token == start else None
            elif token == end:
                count = None
            else:
                count += 1
        self.count, self.seen = count, known

    def _forces(self, count) -> bool:
        return count is not None and count >= self.budget

    def _next(self, count) -> tuple:
        """The states one more token can lead to: a forced one is </think>."""
        if count is None:
            return None, 0
        return (None,) if count >= self.budget else (None, count + 1)

    def _reachable(self, pending: int) -> set:
        states = {self.count}
        for _ in range(pending):
            states = {n for count in states for n in self._next(count)}
        return states

    def forced(self, pending: int) -> bool:
        """Whether the next token must be </think>, `pending` tokens after the known ones still
        unread. RuntimeError where those tokens decide it: needs_known() keeps that from
        happening."""
        answers = {self._forces(count) for count in self._reachable(pending)}
        if len(answers) > 1:
            raise RuntimeError("thinking_token_budget: the forced </think> depends on a token "
                               "still being sampled")
        return answers.pop()

    def needs_known(self, pending: int) -> bool:
        """Whether the step after this one (set up while this one's token is unread, and
        `pending` tokens unread now) depends on that token: it must be set up after it is
        read."""
        return any(len({self._forces(n) for n in self._next(count)}) > 1
                   for count in self._reachable(pending))


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is shorter): text that may
    be the start of the tag, held back until the next piece says."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplit:
    """A completion's text, fed as it grows, split into (reasoning, answer) pieces. The tags
    themselves are in neither: a <think> the completion opens with is dropped also where the
    prompt already opened the reasoning (vLLM's qwen3 parser strips it, as a model may write it
    again). Feeding the whole text at once and then finish() gives the same split as feeding it
    piece by piece."""

    def __init__(self, phase: str):
        self.phase = phase
        self.pending = ""  # text that may be the start of the tag the phase waits for
        self.opening = phase in (UNDECIDED, REASONING)  # a leading <think> may still come

    def feed(self, text: str) -> tuple[str, str]:
        text = self.pending + text
        self.pending = ""
        if self.opening:
            if text.startswith(START_TAG):
                self.phase, text = REASONING, text[len(START_TAG):]
            elif START_TAG.startswith(text):  # empty, or the tag's beginning
                self.pending = text
                return "", ""
            elif self.phase == UNDECIDED:
                self.phase = ANSWER
            self.opening = False
        if self.phase == REASONING:
            before, tag, after = text.partition(END_TAG)
            if not tag:
                keep = partial_tag(text, END_TAG)
                self.pending = text[len(text) - keep:] if keep else ""
                return text[:len(text) - keep], ""
            self.phase = ANSWER
            return before, after
        return "", text

    def finish(self) -> tuple[str, str]:
        """The text held back, at the completion's end: reasoning if it is inside one, else
        answer."""
        text, self.pending = self.pending, ""
        return (text, "") if self.phase == REASONING else ("", text)


def split_reasoning(text: str, phase: str) -> tuple[str | None, str | None]:
    """A whole completion's (reasoning, answer); None for a part it does not have (vLLM's)."""
    split = ReasoningSplit(phase)
    r1, a1 = split.feed(text)
    r2, a2 = split.finish()
    return r1 + r2 or None, a1 + a2 or None
