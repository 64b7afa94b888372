"""Qwen3's reasoning: the text a thinking model writes between <think> and </think> before its
answer, split from the answer (vLLM's `--reasoning-parser qwen3`).

Where a completion starts is read from its prompt's last turn, the last of the two tags there
deciding (ThinkTags.prompt_phase): a prompt that opens <think> (Qwen3-2507 thinking models' chat
template) starts the completion inside the reasoning; one that closes it (enable_thinking=False
writes an empty <think></think>) starts it in the answer; one with neither (Qwen3's first
release, whose models write <think> themselves) starts it undecided: reasoning if its first token
is <think>, answer otherwise. The same phases decide when a structured output's constraint starts
(runtime/guide.py: after the reasoning, as vLLM's) and how the text splits (ReasoningSplit), so
that the constrained part is exactly the answer.
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
