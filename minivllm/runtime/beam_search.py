"""Beam search over the engine, as vLLM's `LLM.beam_search` does it.

Each step runs every open beam for one token with the top 2 * beam_width logprobs (as
transformers' beam search, which vLLM follows), so each beam offers 2 * beam_width candidates
(and, at temperature > 0, the id it sampled when that is not among them). A candidate ending in
an EOS id is complete; of the others, each prompt keeps its beam_width best by score. After
max_tokens steps (or once no beam is open) the complete and open beams are ranked together and
the best beam_width returned. A beam's score is vLLM's (transformers'):
    cum_logprob / len(tokens) ** length_penalty,
its tokens the prompt's and the generated ones, less a final EOS.

A step is a batch of ordinary requests of max_tokens=1, the beams' whole token lists as prompts:
the prefix cache serves each beam the full blocks it shares with its parent, so a step computes
about the last, partly filled block of each beam. This module is the search's bookkeeping; the
step is a function handed in (LLM.beam_search gives one that runs the engine), so the search can
be tested on a scripted model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from .outputs import Logprob

# One step: the beams' token lists, and the prompt each extends (its index in beam_search's
# prompts: the LoRA adapter it runs under, say) -> per beam its candidates' logprobs.
StepFn = Callable[[list[list[int]], list[int]], list[dict[int, Logprob]]]


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's). tokens: the prompt's, then the generated ones. logprobs: per generated
    token, the logprobs of every candidate its step offered (vLLM's). text: the tokens decoded,
    prompt included (as vLLM's LLM.beam_search; None without a tokenizer). finish_reason: "stop"
    for a beam ended by an EOS id, "length" for one ended by max_tokens or max_model_len."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first: at most beam_width of them (vLLM's)."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_ids: frozenset[int], length_penalty: float) -> float:
    """vLLM's (transformers') length-penalised score; a final EOS does not count to the length."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos_ids)
    return beam.cum_logprob / (length ** length_penalty)


def extend(beam: BeamSearchSequence, candidates: dict[int, Logprob], eos_ids: frozenset[int],
           ignore_eos: bool) -> tuple[list[BeamSearchSequence], list[BeamSearchSequence]]:
    """The beams one step makes of `beam`, in the candidates' order: (open, ended by EOS)."""
    open_, ended = [], []
    for token, lp in candidates.items():
        child = BeamSearchSequence(tokens=beam.tokens + [token],
                                   logprobs=beam.logprobs + [candidates],
                                   cum_logprob=beam.cum_logprob + lp.logprob)
        if token in eos_ids and not ignore_eos:
            child.finish_reason = "stop"
            ended.append(child)
        else:
            open_.append(child)
    return open_, ended


@dataclass
class _Search:
    """One prompt's search: its open beams and the complete ones."""

    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def beam_search(step: StepFn, prompts: Sequence[list[int]], *, beam_width: int, max_tokens: int,
                eos_ids: Sequence[int], length_penalty: float = 1.0, ignore_eos: bool = False,
                max_model_len: int | None = None, concurrency_limit: int | None = None,
                decode: Callable[[list[int]], str] | None = None,
                progress: Callable[[range], range] | None = None) -> list[BeamSearchOutput]:
    """Beam search from each prompt (token ids), `step` running the model one token at a time.

    max_model_len: a beam this long ends ("length"): the engine cannot extend it.
    concurrency_limit: search this many prompts at a time (None: all). decode: tokens -> text
    for the returned beams. progress: wraps each group's range of steps (a progress bar)."""
    eos = frozenset(eos_ids)
    key = lambda b: beam_score(b, eos, length_penalty)  # noqa: E731
    searches = [_Search([BeamSearchSequence(tokens=list(p))]) for p in prompts]
    index = {id(s): k for k, s in enumerate(searches)}
    limit = concurrency_limit or max(len(searches), 1)
    for start in range(0, len(searches), limit):
        group = searches[start:start + limit]
        steps = range(max_tokens)
        for _ in (progress(steps) if progress is not None else steps):
            if max_model_len is not None:  # beams the engine cannot extend end here
                for s in group:
                    for b in s.beams:
                        if len(b.tokens) >= max_model_len:
                            b.finish_reason = "length"
                            s.completed.append(b)
                    s.beams = [b for b in s.beams if b.finish_reason is None]
            running = [(s, b) for s in group for b in s.beams]
            if not running:
                break
            candidates = step([b.tokens for _, b in running], [index[id(s)] for s, _ in running])
            children: dict[int, list[BeamSearchSequence]] = {id(s): [] for s in group}
            for (s, beam), cands in zip(running, candidates):
                open_, ended = extend(beam, cands, eos, ignore_eos)
                children[id(s)] += open_
                s.completed += ended
            for s in group:
                # sorted() is stable: equal scores keep the candidates' order, as vLLM's.
                s.beams = sorted(children[id(s)], key=key, reverse=True)[:beam_width]
    outputs = []
    for s in searches:
        for b in s.beams:
            b.finish_reason = "length"
        best = sorted(s.completed + s.beams, key=key, reverse=True)[:beam_width]
        if decode is not None:
            for b in best:
                b.text = decode(b.tokens)
        outputs.append(BeamSearchOutput(sequences=best))
    return outputs
