"""Sequence: the mutable record of one completion while the engine runs it.

A sequence is its prompt followed by the tokens generated so far (`token_ids`); `num_computed`
of them have their K/V in the cache, in the blocks of `block_table`. Each step computes tokens
`num_computed ... num_computed + n - 1` for some n the scheduler picks; when that reaches the
last token, the step samples one more. Preemption drops the blocks and sets num_computed to 0,
keeping the tokens: the sequence is prefilled again (prompt and output) when it comes back.
"""

from __future__ import annotations

import enum

import numpy as np

from .sampling_params import SamplingParams


# A prompt given as embeddings holds this id at each of its positions in token_ids (never read
# as a token: the step takes the position's embedding, and the prefix cache skips the sequence).
PLACEHOLDER = 0

# Stands in token_ids for a token that a launched step is still sampling (asynchronous scheduling:
# the next step is scheduled before the previous one's tokens reach the host). Never a real id.
PENDING = -1


def check_cache_salt(salt) -> str | None:
    """vLLM's cache_salt checked (its request validator's words): a non-empty string, or None
    (no salt). TypeError / ValueError otherwise."""
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise TypeError(f"Parameter 'cache_salt' must be a non-empty string if provided, got "
                        f"{type(salt).__name__} {salt!r:.40}")
    if not salt:
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided, got ''")
    return salt


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    # seq_id grows with arrival: the scheduler's "oldest first" and "newest preempted first".
    def __init__(self, seq_id: int, request_id: str, index: int, prompt_ids: list[int],
                 params: SamplingParams, seed: int, eos_ids: tuple[int, ...] = (),
                 bad_words: tuple[tuple[int, ...], ...] = (), guide=None, pooling: bool = False,
                 priority: int = 0, lora=None, lora_id: int = 0, prompt_embeds=None,
                 cache_salt: str | None = None):
        self.seq_id = seq_id
        # vLLM's prompt_embeds: [prompt_len, hidden] host tensor in the model's dtype, which the
        # prompt's steps take in place of its ids' embeddings (its prompt ids are placeholders,
        # PLACEHOLDER each: they only give the prompt its length). Kept while the sequence
        # lives: a preempted sequence computes its prompt again. None: a prompt of token ids.
        self.prompt_embeds = prompt_embeds
        # Its LoRA adapter (state.lora.LoRAAdapter) and that adapter's lora_int_id (>= 1), or
        # None and 0: the base model. The id also keys its prefix cache (block_manager).
        self.lora = lora
        self.lora_id = lora_id if lora is not None else 0
        # vLLM's cache_salt (a non-empty string), or None: its prefix-cache blocks are shared
        # only with sequences of the same salt and adapter (block_manager.root_of).
        self.cache_salt = cache_salt
        self.priority = priority  # lower first, under the scheduler's "priority" policy
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.params = params
        self.seed = seed  # the sampler's counter key (the request's seed, or one drawn for it)
        self.eos_ids = eos_ids
        # The ids that can end it (whether they do depends on min_tokens: stop_by_token).
        self.ending_ids = frozenset((*(() if params.ignore_eos else eos_ids), *params.stop_ids))
        self.prompt_len = len(prompt_ids)
        self.token_ids: list[int] = list(prompt_ids)
        self.num_computed = 0
        self.num_pending = 0  # trailing PENDING entries of token_ids (tokens still being sampled)
        self.max_num_tokens = 0  # where it ends by length (the scheduler sets it: length_limit)
        # Penalties read the generated ids: its sampling row sends them each step, as arrays
        # (output_array, prompt_array); a pending one is taken on the device (ModelRunner).
        self.penalised = (params.presence_penalty != 0 or params.frequency_penalty != 0
                          or params.repetition_penalty != 1)
        self._output_buffer = np.empty(0, dtype=np.int64)  # output_array's; [:_output_filled]
        self._output_filled = 0
        self._prompt_array = None
        self.bad_words = bad_words  # token ids of each (runtime/bad_words.py)
        self.guide = guide  # its structured output's place (runtime/guide.py), or None
        # An embedding's sequence (runtime/pooling.py): it ends with its prompt, whose last
        # token's hidden state the step that computes it returns, sampling nothing.
        self.pooling = pooling
        # Whether its sampling row is decided by its generated ids on the host (multi-token bad
        # words, a structured output's constraint): it never runs with a pending token (the
        # engine resolves the previous step before scheduling it). Penalties only count the
        # ids, which the device completes: not these. The engine also sets it for a
        # thinking_token_budget whose next forced </think> hangs on an unread id
        # (LLMEngine._think_budget).
        self.reads_output = any(len(w) > 1 for w in bad_words) or guide is not None
        # The engine's SamplingRow for it, once only the step changes from step to step.
        self.sampling_row = None
        # Its thinking_token_budget's state (reasoning.ThinkBudget), made by the engine at its
        # first sampling row; None without a budget.
        self.think_budget = None
        self.block_table: list[int] = []
        self.num_registered_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        self.num_cached_prompt = -1  # prompt tokens found in the prefix cache at first admission
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Incremental detokenization (see detokenizer.py) and what has been streamed.
        self.text = ""
        self.prefix_offset = max(self.prompt_len - 5, 0)
        self.read_offset = self.prompt_len
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        # The prompt's scores (prompt_logprobs), position by position, the first None: kept by
        # the request's first completion, which computes its whole prompt (it never reads the
        # prefix cache, as in vLLM: a hit would skip positions it must score).
        self.prompt_logprobs: list[dict | None] | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None)
        self.cumulative_logprob = 0.0
        self.num_preemptions = 0
        # vLLM's per-request timestamps (runtime/metrics.py), the host's monotonic clock; 0: not
        # yet. arrival: the request's receipt; queued: added to the engine; scheduled: first
        # admitted; first_token: its first token read. last_token_time is kept only while the
        # sequence is out of the engine's token streak (LLMEngine._record_token_times).
        self.arrival_time = 0.0
        self.queued_time = 0.0
        self.scheduled_time = 0.0
        self.first_token_time = 0.0
        self.last_token_time = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        """Tokens generated, pending ones included (what the sampler's counter and the length
        limits count)."""
        return len(self.token_ids) - self.prompt_len

    @property
    def num_known(self) -> int:
        """Tokens whose ids are known: all but the pending ones."""
        return len(self.token_ids) - self.num_pending

    @property
    def output_ids(self) -> list[int]:
        """The generated ids known so far."""
        return self.token_ids[self.prompt_len:self.num_known]

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    def output_array(self) -> np.ndarray:
        """output_ids as int64, a view (later calls only write past it). A penalised row
        sends these every step (~1,000 ids a row at 256 rows: numpy copies an array's at C
        speed, a list's an int at a time): the ids are copied once into a buffer kept across
        steps, which each call extends with those known since the last (known ids never change;
        should the known ones shrink, those past them are copied again)."""
        n = self.num_known - self.prompt_len
        have = self._output_filled = min(self._output_filled, n)
        if n > have:
            buffer = self._output_buffer
            if n > len(buffer):
                buffer = np.empty(max(n, 2 * len(buffer), 16), dtype=np.int64)
                buffer[:have] = self._output_buffer[:have]
                self._output_buffer = buffer
            start = self.prompt_len
            buffer[have:n] = self.token_ids[start + have:start + n]
            self._output_filled = n
        return self._output_buffer[:n]

    def prompt_array(self) -> np.ndarray:
        """prompt_ids as int64, made once (a repetition penalty sends them every step)."""
        if self._prompt_array is None:
            self._prompt_array = np.array(self.token_ids[:self.prompt_len], dtype=np.int64)
        return self._prompt_array

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self):
        return (f"Sequence({self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed}, blocks={self.block_table})")
