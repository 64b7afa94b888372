"""A step's per-row sampling parameters: SamplingRow (host values, one a row) packed by
make_sampling_batch into a SamplingBatch ([B] tensors on the device, and static flags read off
the host values, which tell functional.sampling which stages any row needs); with_steps and
with_pending_ids derive a step's batch from one already on the device. LOGPROBS_MODES says what
returned logprobs are taken from."""

from __future__ import annotations

import itertools
import operator
from typing import Sequence

import attrs
import numpy as np
import torch

from ..state.batch import host_to_device
from ..state.pytree import pytree_class, static

@attrs.frozen(eq=False)  # compared by identity: its ids may be numpy arrays (and the engine
class SamplingRow:      # reuses a row object while only the step changes)
    """One row's sampling parameters, as host values (see make_sampling_batch).

    temperature 0 (or below SAMPLING_EPS, as in vLLM) is greedy, and temperatures above
    MAX_TEMPERATURE sample as MAX_TEMPERATURE (the Gumbel paths clamp it); top_k <= 0 or >= vocab,
    top_p 1, min_p 0 and the neutral penalties (0, 0, 1) are off. `seed` and `step` (tokens this
    sequence has generated) pick the row's uniform. `output_ids` feed the presence / frequency /
    repetition penalties and `prompt_ids` the repetition penalty; `banned_ids` can never be
    sampled (EOS before min_tokens); `logit_bias` ((id, bias) pairs) is added to the logits and
    `allowed_ids`, when given, are the only ids that can be sampled (vLLM's logit_bias and
    allowed_token_ids: both act before the penalties, as vLLM's logits processors do);
    `allowed_bits`, when given, is a structured output's constraint as a packed bitmask (uint8
    [ceil(vocab / 8)], id i at bit i % 8 of byte i // 8: runtime.guide.pack_ids), applied as
    allowed_ids are; `logprobs` asks for the top-N logprobs (None: none)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    step: int = 0
    output_ids: Sequence[int] = ()
    prompt_ids: Sequence[int] = ()
    banned_ids: Sequence[int] = ()
    logit_bias: Sequence[tuple[int, float]] = ()
    allowed_ids: Sequence[int] = ()
    allowed_bits: np.ndarray | None = None
    logprobs: int | None = None


def plain_greedy(row: SamplingRow) -> bool:
    """Whether sample() gives this row the plain arg-max of its logits: greedy, with no
    penalty, no banned id and no logprobs (top-k, top-p and min-p do not touch a greedy row)."""
    return (row.temperature < SAMPLING_EPS and row.presence_penalty == 0
            and row.frequency_penalty == 0 and row.repetition_penalty == 1
            and not len(row.banned_ids) and not row.logit_bias and not len(row.allowed_ids)
            and row.allowed_bits is None and row.logprobs is None)


@pytree_class
class SamplingBatch:
    """Per-row sampling parameters for B rows of logits, as device tensors.

    temperature        [B] fp32   0: greedy
    top_k              [B] int64  >= vocab: off
    top_p, min_p       [B] fp32   1 / 0: off
    presence_penalty, frequency_penalty, repetition_penalty [B] fp32
    seeds, steps       [B] int64  the counter that picks each row's uniform
    output_ids         [B, L] int64 or None   tokens generated so far, padded with vocab_size
    prompt_ids         [B, P] int64 or None   prompt tokens, padded with vocab_size
    banned_rows, banned_ids [K] int64 or None  (row, id) pairs that can never be sampled
    bias_rows, bias_ids [J] int64, bias_values [J] fp32, or None  (row, id, bias) added to logits
    allowed_rows [B] bool, allowed_row_ids, allowed_ids [A] int64, or None  rows that may sample
                       only their (row, id) pairs
    allowed_bits       [B, ceil(V / 8)] uint8 or None  packed allowed ids (all ones: a row
                       without): a structured output's constraint
    Static flags say which stages any row needs, so that a batch skips what no row asks for
    (they are read off the host values, never synchronised from the device): all_greedy,
    any_greedy; any_truncated, all_truncated (rows that sample with top-k, top-p or min-p);
    do_top_k, do_top_p, do_min_p; num_logprobs; logprobs_mode (one of LOGPROBS_MODES: what the
    logprobs are taken from, the engine's for every row)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    repetition_penalty: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor
    output_ids: torch.Tensor | None = None
    prompt_ids: torch.Tensor | None = None
    banned_rows: torch.Tensor | None = None
    banned_ids: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    allowed_rows: torch.Tensor | None = None
    allowed_row_ids: torch.Tensor | None = None
    allowed_ids: torch.Tensor | None = None
    allowed_bits: torch.Tensor | None = None
    all_greedy: bool = static(default=False)
    any_greedy: bool = static(default=True)
    # Rows sampled with top-k, top-p or min-p (temperature > 0) take the inverse-CDF path, the
    # others the Gumbel-max one. The defaults (a SamplingBatch built by hand) run both.
    any_truncated: bool = static(default=True)
    all_truncated: bool = static(default=False)
    do_top_k: bool = static(default=False)
    do_top_p: bool = static(default=False)
    do_min_p: bool = static(default=False)
    # > 0: every sampled row with top-p has a top-k, all of them <= this: top-k and top-p run on
    # that many candidates a row (truncated_logits), not on a sort of the whole vocabulary.
    top_k_bound: int = static(default=0)
    num_logprobs: int = static(default=-1)  # the most logprobs any row asks for; -1: none
    logprobs_mode: str = static(default="raw_logprobs")

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


def _as_int64(x: int) -> int:
    """A Python int seed of up to 64 bits as the int64 holding the same bits."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _row_pairs(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(row, id) pairs of per-row id lists, as two int64 arrays: the rows repeated by their
    lists' lengths and the lists chained, each filled in C (a Python tuple per pair took 70 ms
    for 8 rows of 40,000 ids, these 3.6: session 62, when a structured output's row sent its
    mask as ids; since session 63 it sends allowed_bits)."""
    counts = [len(ids) for ids in lists]
    total = sum(counts)
    rows = np.repeat(np.arange(len(lists), dtype=np.int64), counts)
    given = [ids for ids in lists if len(ids)]
    if given and all(isinstance(ids, np.ndarray) for ids in given):
        # Arrays (the engine's allowed_token_ids rows) are copied whole: chaining 256 rows of
        # 1,000 ids an int at a time took 8.0 ms (sampler_stages.py, session 64), paid by every
        # step whose rows changed since the last (the runner reuses an unchanged batch).
        return rows, np.concatenate(given).astype(np.int64, copy=False)
    return rows, np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=total)


def _padded(rows: Sequence[Sequence[int]], pad: int, device) -> torch.Tensor:
    """The rows' ids as one [B, longest] int64 tensor, each row padded with `pad` on its right,
    copied a row at a time: numpy copies an int64 array's at C speed (the engine's penalised
    rows hold their sequences' kept arrays: Sequence.output_array), a list's an int at a time.
    make_sampling_batch of 256 penalised rows of ~560 output and ~560 prompt ids, every step
    (session 63, this repository's CPU): 9.2 ms with lists chained into one array, 2.3 with
    arrays (most of it the padded arrays' fresh pages)."""
    lengths = [len(ids) for ids in rows]
    out = np.full((len(rows), max(1, max(lengths, default=0))), pad, dtype=np.int64)
    for row, ids, n in zip(out, rows, lengths):
        if n:
            row[:n] = ids
    return host_to_device(torch.from_numpy(out), device)


SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
_FP32_MAX = float(np.finfo(np.float32).max)  # the float parameters' tensors are fp32
# The largest top-k that truncates by candidates (truncated_logits): torch.topk of this many a
# row, where a sort of the whole vocabulary took ~2 ms a step at 64 rows of 151,936 ids.
MAX_TOP_K_BOUND = 1024

# vLLM's logprobs_mode: what a sampled token's logprob, its rank and the top-N are taken from.
#   raw_logprobs        log_softmax of the model's logits, before anything (the default) but a
#                       structured output's constraint (allowed_bits), whose dropped ids are -inf:
#                       vLLM masks the logits by its grammar before its sampler takes them.
#   raw_logits          the model's logits themselves (fp32), so constrained.
#   processed_logits    the logits the row actually samples from: vLLM v1's Sampler order, that is
#                       the allowed token ids (and a structured output's constraint) -> -inf, the
#                       banned ids (bad words, EOS / stop ids before min_tokens) -> -inf, the
#                       logit bias, the repetition / frequency / presence penalties; then, for a
#                       row that samples (temperature > 0), the division by its temperature,
#                       min-p, top-k and top-p, the ids they drop set to -inf. A greedy row
#                       (temperature 0) stops after the penalties: no temperature (vLLM divides
#                       greedy rows by 1) and no truncation (vLLM's SamplingParams turn top-k,
#                       top-p and min-p off at temperature 0), whatever else shares its batch.
#   processed_logprobs  log_softmax of processed_logits: the logprobs of the distribution the
#                       token was drawn from (what RL trainers compare against). The sampled
#                       token's is always finite.
# Prompt logprobs are always raw_logprobs (vLLM computes them apart from the sampler).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def check_logprobs_mode(mode) -> str:
    """mode if it is one of LOGPROBS_MODES, else a ValueError naming them."""
    if not isinstance(mode, str) or mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(map(repr, LOGPROBS_MODES))}, "
                         f"got {mode!r}")
    return mode

_FLOAT_FIELDS = operator.attrgetter("temperature", "top_p", "min_p", "presence_penalty",
                                    "frequency_penalty", "repetition_penalty")


def _aligned_width(b: int) -> int:
    """B padded to a multiple of 4 entries: each [B] column of a SamplingBatch then starts 16-byte
    aligned (make_sampling_batch says why)."""
    return b + (-b % 4)


def make_sampling_batch(rows: Sequence[SamplingRow], *, vocab_size: int, device=None,
                        steps: Sequence[int] | None = None,
                        logprobs_mode: str = "raw_logprobs") -> SamplingBatch:
    """Pack per-row parameters into a SamplingBatch (built on the host, then moved to `device`).
    steps: each row's step, in place of the rows' own (a caller that keeps one row per sequence
    across steps sends only this column). logprobs_mode: see LOGPROBS_MODES."""
    check_logprobs_mode(logprobs_mode)
    if not rows:
        raise ValueError("a sampling batch needs at least one row")
    if steps is not None and len(steps) != len(rows):
        raise ValueError(f"{len(steps)} steps for {len(rows)} rows")

    def t(values, dtype):
        # An array's buffer as it is: torch.tensor reads an ndarray element by element (2.2 ms
        # for the 64,000 (row, id) pairs of 64 rows allowing 1,000 ids, from_numpy 9 us).
        host = torch.from_numpy(values).to(dtype) if isinstance(values, np.ndarray) else \
            torch.tensor(values, dtype=dtype)
        return host_to_device(host, device)

    # The float parameters as one [B, 6] array, read per row in one C-level call. The flags are
    # decided on the float64 (Python) values, the tensor holds their float32 rounding; each is a
    # few numpy calls whatever B.
    b = len(rows)
    f64 = np.array(list(map(_FLOAT_FIELDS, rows)), dtype=np.float64)
    # As vLLM: a temperature below SAMPLING_EPS is greedy (logits / T would overflow fp32 to inf
    # and softmax to NaN), and a top_p that fp32 rounds to 0 still keeps the top id.
    f64[:, 0][f64[:, 0] < SAMPLING_EPS] = 0.0
    np.maximum(f64[:, 1], np.finfo(np.float32).tiny, out=f64[:, 1])
    # Values past fp32's range (a repetition penalty of 1e39, which vLLM takes) would become inf
    # in the tensor, and a seen id's logit of exactly 0 times inf is nan, which torch's arg-max
    # picks: the penalty would choose the very id it penalises. fp32's largest finite value
    # penalises as inf does (x / 3.4e38 ~ 0, x * 3.4e38 = -inf for x < -1) without the nan.
    np.clip(f64, -_FP32_MAX, _FP32_MAX, out=f64)
    temperature, top_p, min_p = f64[:, 0], f64[:, 1], f64[:, 2]
    top_k = np.fromiter([r.top_k for r in rows], dtype=np.int64, count=b)
    top_k[(top_k <= 0) | (top_k >= vocab_size)] = vocab_size
    do_top_k = bool((top_k < vocab_size).any())
    do_top_p, do_min_p = bool((top_p < 1).any()), bool((min_p > 0).any())
    # Token lists cost a host-to-device copy each step: send them only when a row is penalised,
    # and only that row's (the others get an empty, all-padding row).
    repeated = f64[:, 5] != 1
    penalised = (f64[:, 3] != 0) | (f64[:, 4] != 0) | repeated
    output_ids = prompt_ids = None
    if penalised.any():
        output_ids = _padded([r.output_ids if p else () for r, p in zip(rows, penalised.tolist())],
                             vocab_size, device)
        if repeated.any():
            prompt_ids = _padded([r.prompt_ids if p else ()
                                  for r, p in zip(rows, repeated.tolist())], vocab_size, device)
    banned_rows = banned_ids = None
    if any(len(r.banned_ids) for r in rows):
        banned_rows, banned_ids = (t(a, torch.int64) for a in
                                   _row_pairs([r.banned_ids for r in rows]))
    bias_rows = bias_ids = bias_values = None
    biased = [(row, tok, value) for row, r in enumerate(rows) for tok, value in r.logit_bias]
    if biased:
        bias_rows = t([row for row, _, _ in biased], torch.int64)
        bias_ids = t([tok for _, tok, _ in biased], torch.int64)
        bias_values = t([value for _, _, value in biased], torch.float32)
    allowed_bits = None
    if any(r.allowed_bits is not None for r in rows):
        packed = np.full((b, -(-vocab_size // 8)), 0xFF, dtype=np.uint8)  # a row without: all
        for row, r in zip(packed, rows):
            if r.allowed_bits is not None:
                row[:] = r.allowed_bits
        allowed_bits = host_to_device(torch.from_numpy(packed), device)
    allowed_rows = allowed_row_ids = allowed_ids = None
    if any(len(r.allowed_ids) for r in rows):
        allowed_rows = t([len(r.allowed_ids) > 0 for r in rows], torch.bool)
        allowed_row_ids, allowed_ids = (t(a, torch.int64) for a in
                                        _row_pairs([r.allowed_ids for r in rows]))
    wanted = [r.logprobs for r in rows if r.logprobs is not None]
    num_greedy = np.count_nonzero(temperature == 0)
    top_k_bound = 0
    if do_top_k:
        sampled = temperature > 0
        ks = top_k[sampled & (top_k < vocab_size)]
        if ks.size and ks.max() <= MAX_TOP_K_BOUND and \
                not (sampled & (top_p < 1) & (top_k >= vocab_size)).any():
            top_k_bound = int(ks.max())
    num_truncated = 0  # rows that sample (temperature > 0) with top-k, top-p or min-p
    if do_top_k or do_top_p or do_min_p:
        num_truncated = np.count_nonzero(
            (temperature > 0) & ((top_k < vocab_size) | (top_p < 1) | (min_p > 0)))
    # Two host-to-device copies per step, not nine: the float parameters and the int ones each
    # travel as one [fields, B] tensor (pinned and non-blocking on CUDA), then split into views.
    # Each field's row is padded to a multiple of 4 entries, so that every view starts 16-byte
    # aligned whatever B: Triton compiles a kernel variant per pointer alignment, and an odd B
    # made the sampler compile one mid-serving (0.2-0.7 s each, 4 times in the H200 benchmark).
    width = _aligned_width(b)
    floats = np.zeros((6, width), dtype=np.float32)
    floats[:, :b] = f64.T
    floats = host_to_device(torch.from_numpy(floats), device)[:, :b]
    ints = np.zeros((3, width), dtype=np.int64)
    ints[0, :b] = top_k
    ints[1, :b] = [_as_int64(r.seed) for r in rows]
    ints[2, :b] = [r.step for r in rows] if steps is None else steps
    ints = host_to_device(torch.from_numpy(ints), device)[:, :b]
    temperature_t, top_p_t, min_p_t, presence_t, frequency_t, repetition_t = floats.unbind(0)
    top_k_t, seeds, steps_t = ints.unbind(0)
    return SamplingBatch(
        temperature=temperature_t,
        top_k=top_k_t,
        top_p=top_p_t,
        min_p=min_p_t,
        presence_penalty=presence_t,
        frequency_penalty=frequency_t,
        repetition_penalty=repetition_t,
        seeds=seeds,
        steps=steps_t,
        output_ids=output_ids,
        prompt_ids=prompt_ids,
        banned_rows=banned_rows,
        banned_ids=banned_ids,
        bias_rows=bias_rows,
        bias_ids=bias_ids,
        bias_values=bias_values,
        allowed_rows=allowed_rows,
        allowed_row_ids=allowed_row_ids,
        allowed_ids=allowed_ids,
        allowed_bits=allowed_bits,
        all_greedy=num_greedy == b,
        any_greedy=num_greedy > 0,
        any_truncated=num_truncated > 0,
        all_truncated=num_truncated == b,
        do_top_k=do_top_k,
        do_top_p=do_top_p,
        do_min_p=do_min_p,
        top_k_bound=top_k_bound,
        num_logprobs=max(wanted) if wanted else -1,
        logprobs_mode=logprobs_mode,
    )


def with_steps(sb: SamplingBatch, steps: Sequence[int], device=None) -> SamplingBatch:
    """sb for the same rows at other steps: only the steps column is sent (make_sampling_batch
    costs ~0.3 ms at 256 rows on the host; a decode step that samples the same rows as the last
    one needs only this). sb's other tensors are shared, never written."""
    if len(steps) != sb.steps.shape[0]:
        raise ValueError(f"{len(steps)} steps for {sb.steps.shape[0]} rows")
    b = len(steps)
    column = np.zeros(_aligned_width(b), dtype=np.int64)
    column[:b] = steps
    return attrs.evolve(sb, steps=host_to_device(torch.from_numpy(column), device)[:b])


def with_pending_ids(sb: SamplingBatch, pending: Sequence[tuple[int, int, int]],
                     tokens: torch.Tensor, vocab_size: int, device=None) -> SamplingBatch:
    """sb with one more id in some rows' output ids, taken from `tokens` [R] (on sb's device):
    each (row, column, r) of `pending` puts tokens[r] at output_ids[row, column], `column` being
    the row's count of ids (a column of padding, vocab_size, is added first). Asynchronous
    scheduling builds a penalised row while its sequence's last token is still being sampled:
    that token is the previous step's, still on the device, and is read there in stream order."""
    if sb.output_ids is None:
        raise ValueError("pending output ids for a batch without penalised rows")
    ids = torch.nn.functional.pad(sb.output_ids, (0, 1), value=vocab_size)
    index = host_to_device(torch.tensor(pending, dtype=torch.int64).reshape(-1, 3).T,
                           device)  # [3, n]
    ids[index[0], index[1]] = tokens[index[2]]
    return attrs.evolve(sb, output_ids=ids)
