"""SamplingParams: how to sample one request, with vLLM's names and defaults, checked on creation."""

from __future__ import annotations

import logging
import math
import reprlib
from dataclasses import dataclass, field
from typing import Sequence

from ..state.values import as_int, as_real


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_FP32_MAX = 3.4028234663852886e38  # a logit bias is added to fp32 logits


def _is_number(x) -> bool:
    """Whether a real field's value, after __post_init__'s conversion (every finite real becomes
    a float), is a finite real: as_real leaves an infinity or NaN as it was given."""
    return isinstance(x, float) and math.isfinite(x)


log = logging.getLogger("minivllm")
# vLLM's temperature bounds (sampling_params.py): at most 2 (OpenAI's range, vLLM PR 44965), and
# a positive one below 1e-2 (its _MAX_TEMP) is raised to 1e-2 with a warning (dividing by a
# tinier one made nan / inf there), so that only 0 itself is greedy.
_TEMPERATURE_MAX = 2.0
_TEMPERATURE_FLOOR = 1e-2


# vLLM's bound on n (VLLM_MAX_N_SEQUENCES' default): a request makes its n sequences before
# any step, so n = 2**40 held the engine (and every request behind it) until memory ran out.
MAX_N = 16384
# Fields taken as Python ints / floats when given as numpy or torch scalars (the checks below
# then see plain numbers, and so does everything downstream).
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
               "truncate_prompt_tokens", "thinking_token_budget")
_REAL_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                "top_p", "min_p")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's `StructuredOutputsParams`; runtime/guide.py): one of
    `choice` (the output is one of these strings), `regex` (it fullmatches this pattern, Python
    re syntax: regex_fsm.py lists the subset), `json` (a JSON schema, a dict or its text: the
    output is a JSON text it admits, for the subset guide.schema_regex lists), `grammar` (a GBNF
    grammar in xgrammar's syntax, as vLLM's: the output is a string its rule `root` derives;
    grammars without recursion only, runtime/gbnf.py) or `json_object=True` (the output is a
    JSON object, within json_automaton.py's bounds on nesting and whitespace). vLLM's
    `structural_tag` is not supported."""

    json: str | dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # The constraint as one regex, filled in by __post_init__ (which checks that it parses);
    # None for json_object, which is no regex.
    pattern: str | None = field(init=False, repr=False, default="")
    # The constraint's key for guide.GuideCache: ("regex", pattern) or guide.JSON_OBJECT.
    key: tuple = field(init=False, repr=False, default=())

    def __post_init__(self):
        from .guide import JSON_OBJECT, choice_regex, grammar_regex, schema_regex
        from .regex_fsm import RegexDFA

        def bad(msg):
            raise ValueError(f"StructuredOutputsParams: {msg}")

        if self.structural_tag not in (None, False):
            bad("structural_tag is not supported (choice, regex, json, grammar and json_object "
                "are)")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            bad(f"json_object must be a bool, got {self.json_object!r:.80}")
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if self.json_object:  # False is vLLM's "not asked", as None
            given.append("json_object")
        if len(given) != 1:
            bad(f"give exactly one of json, regex, choice, grammar and json_object, got "
                f"{given or 'none'}")
        if self.json_object:
            object.__setattr__(self, "pattern", None)
            object.__setattr__(self, "key", JSON_OBJECT)
            return
        if self.regex is not None and not isinstance(self.regex, str):
            bad(f"regex must be a string, got {self.regex!r:.80}")
        schema = self.json
        if isinstance(schema, str):
            import json as json_module  # (the field `json` is no module)

            try:
                schema = json_module.loads(schema)
            except ValueError as e:
                bad(f"json is not a JSON schema's text: {e}")
        try:
            pattern = (choice_regex(self.choice) if self.choice is not None
                       else self.regex if self.regex is not None
                       else grammar_regex(self.grammar) if self.grammar is not None
                       else schema_regex(schema))
        except ValueError as e:
            bad(str(e))
        try:
            RegexDFA(pattern)  # parsed now: a bad pattern is named before any work
        except ValueError as e:  # a grammar's regex is no text the user wrote: say whose it is
            bad(str(e) if self.grammar is None else f"grammar, written as a regex: {e}")
        object.__setattr__(self, "pattern", pattern)
        object.__setattr__(self, "key", ("regex", pattern))


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters for one request (vLLM's `SamplingParams`, the subset minivllm runs).

    n: completions per prompt. temperature in [0, 2]: 0 is greedy, one in (0, 0.01) is raised
    to 0.01 (as vLLM). top_p in (0, 1]; top_k 0 or -1 is off; min_p in [0, 1].
    presence/frequency penalties in [-2, 2] act on generated tokens, the repetition penalty
    (finite, > 0, 1 is off) on prompt and generated tokens. seed: makes this request's samples
    reproducible whatever it is batched with (-1: None, as vLLM). stop: strings that end the
    output (left out of the text unless include_stop_str_in_output); stop_token_ids: ids that
    end it (kept in token_ids). ignore_eos: run past EOS. max_tokens: None means up to
    max_model_len.
    min_tokens: EOS and stop ids are masked out before this many tokens. logit_bias: {id: bias}
    added to the logits; allowed_token_ids: the only ids that may be sampled (both before the
    penalties, as vLLM; the default raw logprobs leave both out). bad_words: words never
    generated (vLLM's: each word's last token is banned where the output ends with its others;
    needs a tokenizer). structured_outputs: a StructuredOutputsParams (choice, regex, JSON
    schema, grammar or json_object) the output must satisfy (needs a tokenizer; as vLLM's
    grammar mask, it acts on the logits before even the raw logprobs are taken). logprobs: the
    top-N logprobs (plus the sampled token's) per generated token (-1: the whole vocabulary's;
    True: 1), taken as the engine's logprobs_mode says (LLM).
    prompt_logprobs: the same for each prompt token after the first (the prompt scored by the
    model; its first entry is None). truncate_prompt_tokens: keep only the prompt's last k
    tokens (-1: max_model_len; the output's prompt_token_ids are those kept).
    thinking_token_budget: the most tokens a think block holds (the prompt's own after its
    <think> included) before </think> is forced, as vLLM's (runtime/reasoning.ThinkBudget; needs
    the engine's reasoning parser); -1 or None: no limit."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: str | Sequence[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    thinking_token_budget: int | None = None
    # Normalised forms of stop / stop_token_ids (tuples), filled in by __post_init__.
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())
    stop_ids: tuple[int, ...] = field(init=False, repr=False, default=())
    bias_pairs: tuple[tuple[int, float], ...] = field(init=False, repr=False, default=())
    allowed_ids: tuple[int, ...] = field(init=False, repr=False, default=())
    bad_word_texts: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"SamplingParams: {msg}")

        for name in ("logprobs", "prompt_logprobs"):  # as vLLM: True asks for 1
            if getattr(self, name) is True:
                object.__setattr__(self, name, 1)
        for names, convert in ((_INT_FIELDS, as_int), (_REAL_FIELDS, as_real)):
            for name in names:
                value = convert(getattr(self, name))
                if value is not None:
                    object.__setattr__(self, name, value)
        if self.seed == -1:  # vLLM's "no seed": the request samples as one without
            object.__setattr__(self, "seed", None)
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad(f"n must be an integer in [1, {MAX_N}] (vLLM's VLLM_MAX_N_SEQUENCES bound), "
                f"got {self.n!r:.40}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                bad(f"{name} must be in [-2, 2], got {v!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be a finite number > 0, got "
                f"{self.repetition_penalty!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= _TEMPERATURE_MAX:
            bad(f"temperature must be a number in [0, {_TEMPERATURE_MAX:g}] (vLLM's range), got "
                f"{self.temperature!r}")
        if 0 < self.temperature < _TEMPERATURE_FLOOR:
            log.warning("temperature %s is below %s: raised to %s, as vLLM does (only 0 is "
                        "greedy)", self.temperature, _TEMPERATURE_FLOOR,
                        _TEMPERATURE_FLOOR)
            object.__setattr__(self, "temperature", _TEMPERATURE_FLOOR)
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad(f"top_k must be an integer >= 1, or 0 / -1 to disable, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            bad(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not _is_int(n) or n < -1):
                bad(f"{name} must be an integer >= 0, -1 (the whole vocabulary) or None, got "
                    f"{n!r}")

        budget = self.thinking_token_budget
        if budget is not None and (not _is_int(budget) or budget < -1):
            # vLLM's words (validate_thinking_token_budget): floats and bools are refused too.
            bad(f"`thinking_token_budget` must be a non-negative integer or -1 for unlimited "
                f"(got {budget!r:.40})")
        if budget == -1:  # vLLM keeps None for "no limit"
            object.__setattr__(self, "thinking_token_budget", None)

        keep = self.truncate_prompt_tokens
        if keep is not None and (not _is_int(keep) or (keep < 1 and keep != -1)):
            bad(f"truncate_prompt_tokens must be an integer >= 1, -1 (max_model_len) or None, "
                f"got {keep!r}")

        for name in ("ignore_eos", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be a bool, got {getattr(self, name)!r}")

        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)):
            stop = tuple(stop)
        else:
            bad(f"stop must be a string or a list of non-empty strings, got {stop!r}")
        for s in stop:
            if not isinstance(s, str) or not s:
                bad(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            bad(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        ids = () if self.stop_token_ids is None else tuple(map(as_int, self.stop_token_ids))
        for i in ids:
            if i is None or i < 0:
                bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if stop and not self.detokenize:
            bad("stop strings need detokenize=True")
        object.__setattr__(self, "stop_strings", stop)
        object.__setattr__(self, "stop_ids", ids)

        bias = self.logit_bias
        if bias is not None and not isinstance(bias, dict):
            bad(f"logit_bias must be a dict of token id -> bias, got {reprlib.repr(bias)}")
        pairs = []
        for tok, value in (bias or {}).items():
            i, v = as_int(tok), as_real(value)
            if i is None or i < 0 or not isinstance(v, float) or not abs(v) <= _FP32_MAX:
                bad(f"logit_bias must map token ids (ints >= 0) to numbers within fp32's range "
                    f"(the logits'), got {tok!r}: {value!r}")
            pairs.append((i, v))
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)) or not allowed:
                bad(f"allowed_token_ids must be a non-empty list of token ids, got "
                    f"{reprlib.repr(allowed)}")
            allowed = tuple(map(as_int, allowed))
            if any(i is None or i < 0 for i in allowed):
                bad(f"allowed_token_ids must be non-negative integers, got "
                    f"{reprlib.repr(self.allowed_token_ids)}")
        words = self.bad_words
        words = () if words is None else (words,) if isinstance(words, str) else words
        if not isinstance(words, (list, tuple)) or \
                not all(isinstance(w, str) and w.strip() for w in words):
            bad(f"bad_words must be a list of non-blank strings, got "
                f"{reprlib.repr(self.bad_words)}")
        object.__setattr__(self, "bad_word_texts", tuple(words))
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad(f"structured_outputs must be a StructuredOutputsParams, got "
                    f"{type(self.structured_outputs).__name__}")
            # A complete constrained output may only take EOS: one that must go on has nothing
            # it may take (or takes EOS over and over).
            if self.ignore_eos or self.min_tokens:
                bad("structured_outputs end at EOS once complete: ignore_eos and min_tokens "
                    "cannot be combined with them")
        object.__setattr__(self, "bias_pairs", tuple(pairs))
        object.__setattr__(self, "allowed_ids", tuple(dict.fromkeys(allowed or ())))

    @property
    def greedy(self) -> bool:
        """Whether the sampler takes the arg-max: temperature 0 (__post_init__ raised a positive
        one below 1e-2 to 1e-2, so none reaches the sampler's threshold, vLLM's 1e-5)."""
        from ..functional.sampling import SAMPLING_EPS

        return self.temperature < SAMPLING_EPS


@dataclass(frozen=True)
class BeamSearchParams:
    """Parameters of LLM.beam_search (vLLM's `BeamSearchParams`).

    beam_width: beams kept per prompt (each step offers 2 * beam_width candidates a beam, so
    2 * beam_width must not exceed the engine's max_logprobs). max_tokens: the most tokens a beam
    generates. ignore_eos: an EOS id does not end a beam. temperature: each step's sampled id
    joins its candidates (at 0 the best one, already among them; as vLLM). length_penalty: the
    exponent of the length that divides a beam's cumulative logprob in its score.
    include_stop_str_in_output: taken for vLLM's signature; a beam's text is its tokens decoded,
    EOS included, as vLLM's LLM.beam_search gives it."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"BeamSearchParams: {msg}")

        for name in ("beam_width", "max_tokens"):
            value = as_int(getattr(self, name))
            if value is None or value < 1:
                bad(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)
        for name in ("temperature", "length_penalty"):
            value = as_real(getattr(self, name))
            if value is None:
                bad(f"{name} must be a finite number, got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)
        if not 0 <= self.temperature <= _TEMPERATURE_MAX:
            # vLLM's LLM.beam_search refuses it too: its steps' SamplingParams do.
            bad(f"temperature must be in [0, {_TEMPERATURE_MAX:g}] (vLLM's range), got "
                f"{self.temperature!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be a bool, got {getattr(self, name)!r}")

    def step_params(self) -> SamplingParams:
        """The requests of one step: a token, with the top 2 * beam_width logprobs."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.beam_width,
                              temperature=self.temperature)
