"""Sampling the next token from logits, as pure functions on the device.

`sample(logits, sb)` samples one token for each of B rows of logits, every row with its own
parameters (a `SamplingBatch` of [B] tensors): penalties, greedy or temperature, min-p, top-k,
top-p (vLLM v1's order), and the top-N logprobs of the raw logits (or of the processed ones,
or the logits themselves: vLLM's logprobs_mode, see LOGPROBS_MODES). There is no per-row Python
loop.

Randomness is counter based: a row's draws are hashes of (seeds[b], steps[b]), where `steps` is
how many tokens that sequence has generated so far. A row's token therefore depends only on its
own logits, its own parameters, its seed and its step, never on which other rows share the batch:
a seeded request gives the same output whatever it is batched with, and a sequence recomputed
after preemption continues the same random stream. Two paths, chosen per row:

- Gumbel-max, for rows that sample with temperature alone (the common case) and for greedy rows:
  token = argmax_v (logits[v] + T * g_v), g_v Gumbel noise hashed from (seed, step, v); T = 0
  turns the noise off, an exact arg-max. That is one pass over the logits and no sort, softmax
  or CDF: on CUDA one Triton kernel (minivllm.kernels.sample_kernel) reads the logits once, in
  their dtype; elsewhere `gumbel_argmax_reference` does the same math in torch.
- Inverse CDF, for rows with top-k, top-p or min-p, which need the sorted, truncated
  distribution anyway: the token is read off the row's CDF (accumulated in float64, so that
  rounding does not depend on the batch either) at a uniform hashed from (seed, step).

A mixed batch runs both and picks per row; static flags of the SamplingBatch (read off host
values) let a batch skip a path no row needs, so the common batch never sorts.

Both `functional.generate` and the engine sample with `sample`.
"""

from __future__ import annotations

import itertools
import operator
from typing import Sequence

import attrs
import numpy as np
import torch

from ..state.batch import host_to_device
from ..state.pytree import pytree_class, static


# ----------------------------------------------------------------------------------------------
# Counter-based uniforms: a hash of (seed, step), vectorised over rows.

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32): split c in 16-bit halves so that no product
    overflows int64 (signed overflow is undefined in the kernels that would run it)."""
    lo = x * (c & 0xFFFF)
    hi = (x * (c >> 16)) & 0xFFFF
    return (lo + (hi << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A well-mixed bijection on 32-bit values held in int64 ("lowbias32", C. Wellons)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_key(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """seeds, steps: [B] int64 -> [B] int64 keys in [0, 2**32), a pure function of each row's
    (seed, step). Seeds may use all 64 bits (negative int64 included); steps the low 32."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    h = _hash32((steps & _M32) ^ 0x9E3779B9)
    h = _hash32(h ^ hi)
    h = _hash32(h ^ lo)
    return _hash32(h ^ 0x85EBCA6B)


def uniform_from_counter(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """seeds, steps: [B] int64 -> [B] float64 uniforms in (0, 1): the inverse-CDF path's draw."""
    return (counter_key(seeds, steps).double() + 0.5) * (2.0 ** -32)


def counter_bits(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys: [B] (counter_key) -> [B, vocab] int64 hashes in [0, 2**32), one per (row, id): the
    Gumbel path's draws. The id is spread by an odd multiplier before the xor so that two rows'
    hash streams are not mere re-orderings of each other's."""
    ids = _mul32(torch.arange(vocab, device=keys.device), 0x9E3779B9)
    return _hash32(keys[:, None] ^ ids[None, :])


def gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """[..] int64 hashes in [0, 2**32) -> fp32 standard Gumbel noise g = -log(E), E = -log(1 - s)
    exponential for s = (bits + 1/2) / 2**32 uniform. The arg-max is decided by the largest g,
    that is the smallest E: there E ~ s, and the series s + s^2/2 + ... keeps s's 32-bit
    resolution where 1 - s in fp32 would round it to 24 bits (over a flat distribution of 1e5
    ids the winner's E is ~1e-5, and steps of 6e-8 would bias near-ties by ~1%). The Triton
    kernel does the same fp32 steps."""
    s = bits.float() * 2.0 ** -32 + 2.0 ** -33
    s = s.clamp(max=1.0 - 2.0 ** -24)  # bits near 2**32 round s up to 1.0
    series = s * (1.0 + s * (0.5 + s * (0.3333333432674408 + s * (0.25 + s * (0.20000000298023224
                                                                            + s * 0.1666666716337204)))))
    e = torch.where(s < 0.0625, series, -torch.log(1.0 - s))
    return -torch.log(e)


# The largest temperature the sampler uses: T * g must stay finite in fp32 (g <= 33 ln 2 ~ 22.9,
# the largest noise a 32-bit hash gives), or a row at T near fp32's max (which SamplingParams
# accepts) would see inf noise on many ids: the lowest of them always won, and -inf (banned) ids
# became NaN, which torch.argmax picks. Any T this large samples the uniform distribution over the
# finite logits (logits / T ~ 0), so the clamp changes no distribution.
MAX_TEMPERATURE = 1e37


def gumbel_argmax_reference(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                            steps: torch.Tensor) -> torch.Tensor:
    """logits [B, V], temperature [B] (0: greedy), seeds / steps [B] -> ids [B]: argmax of
    logits + T * g (a Gumbel-max draw from softmax(logits / T): scaling by T > 0 does not move
    the arg-max, and saves a division), or of the logits for greedy rows. Ties: the lowest id.
    T is clamped to MAX_TEMPERATURE. The torch twin of kernels.sample_kernel.gumbel_argmax,
    used off CUDA."""
    x = logits.float()
    g = gumbel_from_bits(counter_bits(counter_key(seeds, steps), x.shape[-1]))  # [B, V]
    t = temperature.clamp(max=MAX_TEMPERATURE)[:, None]
    return torch.where(t > 0, x + t * g, x).argmax(dim=-1)


# ----------------------------------------------------------------------------------------------
# Per-row sampling parameters.

@attrs.frozen
class SamplingRow:
    """One row's sampling parameters, as host values (see make_sampling_batch).

    temperature 0 (or below SAMPLING_EPS, as in vLLM) is greedy, and temperatures above
    MAX_TEMPERATURE sample as MAX_TEMPERATURE (the Gumbel paths clamp it); top_k <= 0 or >= vocab,
    top_p 1, min_p 0 and the neutral penalties (0, 0, 1) are off. `seed` and `step` (tokens this
    sequence has generated) pick the row's uniform. `output_ids` feed the presence / frequency /
    repetition penalties and `prompt_ids` the repetition penalty; `banned_ids` can never be
    sampled (EOS before min_tokens); `logit_bias` ((id, bias) pairs) is added to the logits and
    `allowed_ids`, when given, are the only ids that can be sampled (vLLM's logit_bias and
    allowed_token_ids: both act before the penalties, as vLLM's logits processors do);
    `logprobs` asks for the top-N logprobs (None: none)."""

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
    logprobs: int | None = None


def plain_greedy(row: SamplingRow) -> bool:
    """Whether sample() gives this row the plain arg-max of its logits: greedy, with no
    penalty, no banned id and no logprobs (top-k, top-p and min-p do not touch a greedy row)."""
    return (row.temperature < SAMPLING_EPS and row.presence_penalty == 0
            and row.frequency_penalty == 0 and row.repetition_penalty == 1 and not row.banned_ids
            and not row.logit_bias and not row.allowed_ids and row.logprobs is None)


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
    lists' lengths and the lists chained, each filled in C. A structured output's row bans or
    allows tens of thousands of ids every step: a Python tuple per pair took 70 ms for 8 rows of
    40,000 at a 151k vocabulary, these 3.6 (session 62)."""
    counts = [len(ids) for ids in lists]
    total = sum(counts)
    rows = np.repeat(np.arange(len(lists), dtype=np.int64), counts)
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
# The largest top-k that truncates by candidates (truncated_logits): torch.topk of this many a
# row, where a sort of the whole vocabulary took ~2 ms a step at 64 rows of 151,936 ids.
MAX_TOP_K_BOUND = 1024

# vLLM's logprobs_mode: what a sampled token's logprob, its rank and the top-N are taken from.
#   raw_logprobs        log_softmax of the model's logits, before anything (the default).
#   raw_logits          the model's logits themselves (fp32).
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
        return host_to_device(torch.tensor(values, dtype=dtype), device)

    # The float parameters as one [B, 6] array, read per row in one C-level call. The flags are
    # decided on the float64 (Python) values, the tensor holds their float32 rounding; each is a
    # few numpy calls whatever B.
    b = len(rows)
    f64 = np.array(list(map(_FLOAT_FIELDS, rows)), dtype=np.float64)
    # As vLLM: a temperature below SAMPLING_EPS is greedy (logits / T would overflow fp32 to inf
    # and softmax to NaN), and a top_p that fp32 rounds to 0 still keeps the top id.
    f64[:, 0][f64[:, 0] < SAMPLING_EPS] = 0.0
    np.maximum(f64[:, 1], np.finfo(np.float32).tiny, out=f64[:, 1])
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
    if any(r.banned_ids for r in rows):
        banned_rows, banned_ids = (t(a, torch.int64) for a in
                                   _row_pairs([r.banned_ids for r in rows]))
    bias_rows = bias_ids = bias_values = None
    biased = [(row, tok, value) for row, r in enumerate(rows) for tok, value in r.logit_bias]
    if biased:
        bias_rows = t([row for row, _, _ in biased], torch.int64)
        bias_ids = t([tok for _, tok, _ in biased], torch.int64)
        bias_values = t([value for _, _, value in biased], torch.float32)
    allowed_rows = allowed_row_ids = allowed_ids = None
    if any(r.allowed_ids for r in rows):
        allowed_rows = t([bool(r.allowed_ids) for r in rows], torch.bool)
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


# ----------------------------------------------------------------------------------------------
# The sampler.

@attrs.frozen
class SampleOutput:
    """token_ids [B] int64; when the batch asks for logprobs (else None): logprobs [B] fp32 and
    ranks [B] int64 of the sampled token, top_ids / top_logprobs [B, N]. By default (logprobs_mode
    "raw_logprobs") logprobs are those of the model's raw distribution (log_softmax of the logits,
    before penalties, banned ids, temperature and truncation), as vLLM v1 reports them; the
    batch's logprobs_mode may take them from the raw logits, or from the processed logits or
    logprobs (see LOGPROBS_MODES), the values, ranks and top-N all from that one representation.
    A rank is vLLM v1's: the number of ids whose value is >= the sampled one's (1 = most likely;
    an id tied with others counts them all, so the first of two tied maxima has rank 2)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def id_runs(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids: [B, L] int64 padded with vocab_size -> (each row's ids sorted [B, L], `last` [B, L]
    bool: the last entry of each distinct id's run, padding excluded, `count` [B, L]: how many
    times that id occurs in its row, at its last entry). Fixed shapes throughout: no host sync."""
    ids, _ = ids.sort(dim=-1)
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    new_run = torch.ones_like(ids, dtype=torch.bool)
    new_run[:, 1:] = ids[:, 1:] != ids[:, :-1]
    start = torch.where(new_run, pos, 0).cummax(dim=-1).values
    last = torch.ones_like(new_run)
    last[:, :-1] = new_run[:, 1:]
    return ids, last & (ids < vocab_size), pos - start + 1


def _update_at(flat: torch.Tensor, index: torch.Tensor, keep: torch.Tensor, fn) -> None:
    """flat[index] = fn(flat[index]) where keep (the kept indices unique); the others write to
    flat's last element, a spare that nothing reads. index, keep: [B, L]; fn maps [B, L] to
    [B, L]."""
    spare = flat.shape[0] - 1
    index = torch.where(keep, index, spare)
    flat[index] = fn(flat[index])


def apply_penalties(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits: [B, V] -> penalised logits, a new fp32 tensor, as vLLM applies them: first its
    logits processors, the ids a row does not allow to -inf and the logit bias added; then the
    repetition penalty divides positive (multiplies negative) logits of ids seen in the prompt
    or the output; then the frequency penalty subtracts per output occurrence and the presence
    penalty once per id present in the output. Banned ids go to -inf. Worked in place on one
    copy: each [B, V] temporary is ~150 MB at 256 rows of a 151,936-id vocabulary, and the KV
    budget sets the sampling's peak aside.

    The penalties touch only the rows' own ids (~1,000 a row, of 151,936): each row's ids are
    sorted and run-length counted (id_runs) and only those logits are read and rewritten, each
    by the same float32 operations as the dense form ([B, V] counts, then a division or product
    by 1 and subtractions of 0 for every other id) applies to it: the same values (that form
    could turn a -0.0 elsewhere into +0.0), at a dozen passes over [B, V] fewer (session 63)."""
    b, vocab = logits.shape
    flat = torch.empty(b * vocab + 1, dtype=torch.float32, device=logits.device)  # + a spare
    x = flat[:-1].view(b, vocab)
    x.copy_(logits)
    if sb.allowed_rows is not None:
        keep = ~sb.allowed_rows[:, None].expand_as(x).clone()  # rows without a list keep all
        keep[sb.allowed_row_ids, sb.allowed_ids] = True
        x.masked_fill_(~keep, float("-inf"))
        del keep
    if sb.bias_rows is not None:
        x.index_put_((sb.bias_rows, sb.bias_ids), sb.bias_values, accumulate=True)
    if sb.output_ids is not None:
        base = torch.arange(b, device=x.device)[:, None] * vocab  # [B, 1] each row's offset
        seen = sb.output_ids if sb.prompt_ids is None else \
            torch.cat([sb.output_ids, sb.prompt_ids], dim=1)
        ids, last, _ = id_runs(seen, vocab)  # each id of prompt or output once
        rep = sb.repetition_penalty[:, None]
        _update_at(flat, base + ids, last, lambda v: torch.where(v > 0, v / rep, v * rep))
        ids, last, count = id_runs(sb.output_ids, vocab)
        freq = sb.frequency_penalty[:, None] * count  # [B, L] fp32: count is exact
        pres = sb.presence_penalty[:, None]
        _update_at(flat, base + ids, last, lambda v: (v - freq) - pres)
    if sb.banned_rows is not None:
        x.index_put_((sb.banned_rows, sb.banned_ids), x.new_full((), float("-inf")))
    return x


def truncated_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Penalised logits [B, V] -> probabilities [B, V]: the softmax of truncated_logits."""
    return torch.softmax(truncated_logits(logits, sb), dim=-1)


def truncated_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Penalised logits [B, V] -> logits [B, V] after temperature, min-p, top-k and top-p (the ids
    they drop at -inf),
    in vLLM v1's order (min-p is one of its argmax-invariant logits processors, which run after
    the temperature and before top-k / top-p): top-p's mass is that of the distribution left by
    min-p and top-k, renormalised. Top-k keeps every id tied with the k-th largest logit (as
    vLLM's threshold does); top-p keeps the ids before which the mass is < top_p (the top one
    always), equal logits in id order (vLLM leaves that order to its sort), and drops nothing in a
    row whose top_p is 1. A truncated row is renormalised only implicitly: sample() reads its CDF
    up to its total. A greedy row is divided by 1 (and truncated by its own top-k / top-p /
    min-p: processed_logits turns those off first). In place where a tensor is its own, for the peak's sake (apply_penalties
    says why)."""
    temp = torch.where(sb.temperature > 0, sb.temperature, torch.ones_like(sb.temperature))
    x = logits / temp[:, None]
    if sb.do_min_p:
        # p_v < min_p * p_max is x_v - x_max < log(min_p): the logits say it without a softmax
        # (min_p 0 gives a floor of -inf, which drops nothing).
        floor = x.amax(dim=-1, keepdim=True).add_(torch.log(sb.min_p)[:, None])
        x.masked_fill_(x < floor, float("-inf"))
        del floor
    if sb.top_k_bound:
        return _top_k_top_p_by_candidates(x, sb)
    if sb.do_top_k or sb.do_top_p:
        vocab = x.shape[-1]
        # Stable sort: equal logits keep their id order, so truncation is deterministic.
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        del x  # its successor is allocated once top-p's temporaries are gone
        if sb.do_top_k:
            k = torch.where(sb.top_k > 0, sb.top_k, vocab).clamp_(max=vocab)
            kth = sorted_x.gather(1, (k - 1)[:, None])  # [B, 1] the k-th largest logit
            sorted_x.masked_fill_(sorted_x < kth, float("-inf"))
            del kth
        if sb.do_top_p:
            p = torch.softmax(sorted_x, dim=-1)
            # Drop an id when the mass strictly before it already reaches top_p (the top one
            # stays). Only where top_p < 1: the float32 cumulative mass can round up to 1.0
            # before the tail of a row, which would drop ids that no truncation asked to drop,
            # and only when another row of the batch asks for top-p.
            before = p.cumsum(dim=-1).sub_(p)
            del p
            top_p = torch.where(sb.top_p < 1, sb.top_p, float("inf"))
            sorted_x.masked_fill_(before >= top_p[:, None], float("-inf"))
            del before
        x = torch.empty_like(sorted_x).scatter_(-1, order, sorted_x)
        del sorted_x, order
    return x


def _top_k_top_p_by_candidates(x: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """truncated_logits' top-k and top-p (in place on x [B, V]) without sorting the vocabulary,
    for a batch whose sampled rows with top-p all have a top-k <= K = sb.top_k_bound: the same
    ids kept, in exact arithmetic. Qwen3's generation config asks for top-k 20 and top-p 0.95.

    K candidates a row (torch.topk) hold every id above the row's k-th largest value `kth` (fewer
    than k), G, followed by some of the ids tied at kth, T (t of them, at least one). Top-k keeps
    G and T (x >= kth). truncated_logits' order for top-p is G by value then id, then T by id;
    G sorted among the candidates gives each member the mass before it, and the j-th of T (from
    0) has mass M_G + j * q before it (M_G: G's mass, q: one tied id's), so T's first
    n = ceil((top_p - M_G) / q) ids stay (none where G reaches top_p), by their rank in id
    order. Rows without a top-k (k past K) have top_p 1 by the batch's condition, or are greedy
    (sample() overrides their draw; processed_logits turns their truncation off): no cut."""
    neg_inf = float("-inf")
    bound = sb.top_k_bound
    k = sb.top_k[:, None]
    has_k = k <= bound  # [B, 1]
    vals, ids = x.topk(bound, dim=-1)  # [B, K], largest first (ties in no set order)
    kth = torch.where(has_k, vals.gather(1, (k.clamp(max=bound) - 1)), neg_inf)  # [B, 1]
    if sb.do_top_k:
        x.masked_fill_(x < kth, neg_inf)  # ids tied with the k-th value stay
    if not sb.do_top_p:
        return x
    cut = has_k & (sb.top_p < 1)[:, None]  # rows top-p may cut
    top_p = torch.where(cut, sb.top_p[:, None], float("inf"))
    # The candidates by value, ties by id: sorted by id, then stably by value (K a row).
    by_id = ids.argsort(dim=-1)
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    vals, by_value = vals.sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, by_value)
    tied = (x == kth) & (kth > neg_inf)  # [B, V] T (none where fewer than k ids are finite)
    t = tied.sum(dim=-1, keepdim=True)
    top = vals[:, :1]
    in_g = vals > kth  # [B, K] G, a prefix of the candidates
    w = torch.where(in_g, (vals - top).exp(), 0.0)
    w_tied = torch.where(t > 0, (kth - top).exp(), 0.0)  # [B, 1]
    z = w.sum(dim=-1, keepdim=True) + t * w_tied
    p = w / z
    keep_g = in_g & (p.cumsum(dim=-1) - p < top_p)  # [B, K] a prefix of G
    mass_g = p.sum(dim=-1, keepdim=True)
    q = w_tied / z
    n_tied = torch.where((mass_g < top_p) & (t > 0),
                         ((top_p - mass_g) / q).ceil().clamp(max=t.to(q.dtype)), 0.0)
    # G's last kept id (value, id): G ids after it in the order (smaller value, or equal and a
    # larger id) go. Where G keeps none, every G id goes.
    last = (keep_g.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    any_g = keep_g[:, :1]
    last_val = torch.where(any_g, vals.gather(1, last), float("inf"))
    last_id = ids.gather(1, last)
    column = torch.arange(x.shape[-1], device=x.device)[None, :]
    g_drop = (x > kth) & ((x < last_val) | ((x == last_val) & (column > last_id)))
    t_drop = tied & (tied.cumsum(dim=-1, dtype=torch.int32) > n_tied)  # 1 + rank in id order
    x.masked_fill_(cut & (g_drop | t_drop), neg_inf)
    return x


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Inverse-CDF sampling: probs [B, V] (unnormalised is fine), uniforms [B] in (0, 1)
    -> ids [B]: the first id whose float64 CDF reaches u * total. An id of probability 0 is never
    chosen.

    Two levels, so that no [B, V] float64 copy or long scan is made: the CDF over chunks of
    `chunk` ids picks the chunk (sums accumulated in float64), then the CDF inside that one chunk
    picks the id. Every step is per row, so a row's draw does not depend on the batch."""
    b, v = probs.shape
    n = -(-v // chunk)
    padded = torch.nn.functional.pad(probs, (0, n * chunk - v)).view(b, n, chunk)
    chunk_cdf = padded.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [B, n]
    target = uniforms * chunk_cdf[:, -1]  # [B], > 0
    k = torch.searchsorted(chunk_cdf, target[:, None]).clamp(max=n - 1)  # [B, 1]
    before = torch.where(k > 0, chunk_cdf.gather(1, (k - 1).clamp(min=0)), torch.zeros_like(target[:, None]))
    seg = padded.gather(1, k[:, :, None].expand(b, 1, chunk)).squeeze(1)  # [B, chunk]
    local_cdf = seg.double().cumsum(dim=-1)
    # Rounding between the two levels may put the local target a hair outside (0, seg total]:
    # keep it inside, then never land on a zero-probability id.
    local = (target[:, None] - before).clamp(min=torch.finfo(torch.float64).tiny)
    j = torch.searchsorted(local_cdf, local).clamp(max=chunk - 1)  # [B, 1]
    cols = torch.arange(chunk, device=probs.device)[None, :]
    last_nonzero = torch.where(seg > 0, cols, -1).amax(dim=-1, keepdim=True)
    j = torch.minimum(j, last_nonzero)
    # An id inside the vocabulary even for a row with no mass at all (every id masked out).
    return (k * chunk + j).squeeze(-1).clamp(0, v - 1)


def truncated_rows(sb: SamplingBatch, vocab: int) -> torch.Tensor:
    """[B] bool: the rows that sample with top-k, top-p or min-p (the inverse-CDF path)."""
    cut = (sb.top_k < vocab) | (sb.top_p < 1) | (sb.min_p > 0)
    return cut & (sb.temperature > 0)


def _gumbel_pass(logits: torch.Tensor, sb: SamplingBatch, kernel: bool) -> torch.Tensor:
    """[B, V] -> [B]: the Gumbel-max draw of every row (the arg-max for greedy rows), by the
    Triton kernel or by its torch reference (same hashes, same math)."""
    if kernel:
        from ..kernels.sample_kernel import gumbel_argmax as triton_gumbel_argmax

        return triton_gumbel_argmax(logits, sb.temperature, sb.seeds, sb.steps)
    return gumbel_argmax_reference(logits, sb.temperature, sb.seeds, sb.steps)


def _sample_ids(logits: torch.Tensor, sb: SamplingBatch, gumbel: bool, kernel: bool
                ) -> torch.Tensor:
    """[B, V] -> [B]: sample()'s tokens."""
    vocab = logits.shape[-1]
    # Without penalties the logits are read as they are (the kernel converts on the fly).
    x = apply_penalties(logits, sb) if _penalised(sb) else logits
    if sb.all_greedy:
        return x.argmax(dim=-1)
    inverse_cdf_all = sb.all_truncated or not gumbel
    inverse_cdf_any = sb.any_truncated or not gumbel
    # Greedy rows take the arg-max inside the Gumbel pass (their noise is off).
    direct = None if inverse_cdf_all else _gumbel_pass(x, sb, kernel)
    if not inverse_cdf_any:
        return direct
    drawn = sample_from_probs(truncated_probs(x.float(), sb),
                              uniform_from_counter(sb.seeds, sb.steps))
    if direct is not None:
        # A mixed batch computes both and picks per row, so that a row's token does not depend
        # on what the other rows ask for.
        return torch.where(truncated_rows(sb, vocab), drawn, direct)
    if sb.any_greedy:
        return torch.where(sb.temperature > 0, drawn, x.argmax(dim=-1))
    return drawn


def sample(logits: torch.Tensor, sb: SamplingBatch, *, gumbel: bool = True,
           kernel: bool | None = None) -> SampleOutput:
    """logits: [B, V] (fp32, or bf16 / fp16) -> one token per row under that row's parameters
    (see SamplingBatch).

    `kernel`: run the Gumbel-max / greedy pass as the Triton kernel (default: when the logits
    are on CUDA; True also works on the CPU under TRITON_INTERPRET=1), else the torch reference.
    `gumbel=False` samples every non-greedy row by inverse CDF, as the sampler did before the
    Gumbel path (for benchmarks and tests). Which stages run is decided by sb's static flags and
    these arguments only, never by tensor values: no host sync, fit for torch.compile and CUDA
    graphs."""
    if kernel is None:
        kernel = logits.is_cuda
    token_ids = _sample_ids(logits, sb, gumbel, kernel)  # its [B, V] temporaries freed by now
    if sb.num_logprobs < 0:
        return SampleOutput(token_ids=token_ids)
    mode = sb.logprobs_mode
    if mode.startswith("processed"):
        # Recomputed after the draw (its temporaries are gone): the same functions on the same
        # values give the very logits the tokens were drawn from. Only the processed modes pay.
        logits = processed_logits(logits, sb)
    return SampleOutput(token_ids, *token_logprobs(logits, token_ids, sb.num_logprobs,
                                                   as_logits=mode.endswith("logits")))


def needs_vocab_rows(sb: SamplingBatch) -> bool:
    """Whether sample(logits, sb) on CUDA allocates temporaries of the logits' size [B, V]:
    penalties' copy, truncation's sort, logprobs' log-softmax. Without them it takes the arg-max
    or the Gumbel kernel's pass alone, whose temporaries are a few values a row, so any number
    of rows fits the memory set aside for sampling (runtime.runner._sampling_batches)."""
    return _penalised(sb) or sb.any_truncated or sb.num_logprobs >= 0


def _penalised(sb: SamplingBatch) -> bool:
    return (sb.output_ids is not None or sb.banned_rows is not None
            or sb.bias_rows is not None or sb.allowed_rows is not None)


def processed_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits [B, V] -> the fp32 logits each row samples from (logprobs_mode "processed_logits",
    LOGPROBS_MODES says what is applied): apply_penalties, then for the rows that sample the
    temperature and truncation of truncated_logits; greedy rows are left as penalised."""
    x = apply_penalties(logits, sb) if _penalised(sb) else logits.float()
    if sb.all_greedy:
        return x
    if sb.any_greedy:
        # vLLM's greedy SamplingParams carry no top-k / top-p / min-p: none for these rows.
        sampled = sb.temperature > 0
        sb = attrs.evolve(sb, top_k=torch.where(sampled, sb.top_k, x.shape[-1]),
                          top_p=torch.where(sampled, sb.top_p, 1.0),
                          min_p=torch.where(sampled, sb.min_p, 0.0))
    return truncated_logits(x, sb)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, n: int, *,
                   as_logits: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V], token_ids [B] -> each id's logprob [B] fp32 and rank [B] int64 under the
    distribution of the logits, and the top min(n, V) (ids, logprobs) [B, n]: see SampleOutput.
    as_logits: the same of the logits themselves (fp32), no log_softmax."""
    logprobs = logits.float() if as_logits else torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])  # [B, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # vLLM v1's count: ties included
    top = torch.topk(logprobs, min(n, logprobs.shape[-1]), dim=-1)
    return chosen.squeeze(-1), ranks, top.indices, top.values
