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
- Inverse CDF, for rows with top-k, top-p or min-p, which need the truncated distribution
  anyway (functional.truncation): the token is read off the row's CDF (accumulated in float64,
  so that rounding does not depend on the batch either) at a uniform hashed from (seed, step).

A mixed batch runs both and picks per row; static flags of the SamplingBatch (read off host
values) let a batch skip a path no row needs, so the common batch never sorts.

Both `functional.generate` and the engine sample with `sample`. The batch's parameters are
functional.sampling_batch's, the penalties functional.penalties', the truncation
functional.truncation's (their names are importable from here too).
"""

from __future__ import annotations

import attrs
import torch

from .penalties import apply_penalties, drop_disallowed_, id_runs  # noqa: F401  (re-exported)
from .sampling_batch import (LOGPROBS_MODES, MAX_TOP_K_BOUND, SAMPLING_EPS,  # noqa: F401
                             SamplingBatch, SamplingRow, check_logprobs_mode,
                             make_sampling_batch, plain_greedy, with_pending_ids, with_steps)
from .truncation import cut_bounds, truncated_logits, truncated_probs, truncated_rows  # noqa: F401


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
# The sampler.

@attrs.frozen
class SampleOutput:
    """token_ids [B] int64; when the batch asks for logprobs (else None): logprobs [B] fp32 and
    ranks [B] int64 of the sampled token, top_ids / top_logprobs [B, N]. By default (logprobs_mode
    "raw_logprobs") logprobs are those of the model's raw distribution (log_softmax of the logits,
    before penalties, banned ids, temperature and truncation; only a structured output's
    constraint, allowed_bits, acts before: constrained_logits), as vLLM v1 reports them; the
    batch's logprobs_mode may take them from the raw logits, or from the processed logits or
    logprobs (see LOGPROBS_MODES), the values, ranks and top-N all from that one representation.
    A rank is vLLM v1's: the number of ids whose value is >= the sampled one's (1 = most likely;
    an id tied with others counts them all, so the first of two tied maxima has rank 2)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


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
    # Without penalties the logits are read as they are (the kernel converts on the fly).
    x = apply_penalties(logits, sb) if _penalised(sb) else logits
    if sb.all_greedy:
        return x.argmax(dim=-1)
    if not gumbel:
        drawn = sample_from_probs(truncated_probs(x.float(), sb),
                                  uniform_from_counter(sb.seeds, sb.steps))
        return torch.where(sb.temperature > 0, drawn, x.argmax(dim=-1)) if sb.any_greedy else drawn
    if sb.any_truncated:
        return _truncated_gumbel(x, sb, kernel)
    return _gumbel_pass(x, sb, kernel)  # greedy rows take the arg-max inside (their noise is off)


def _truncated_gumbel(x: torch.Tensor, sb: SamplingBatch, kernel: bool) -> torch.Tensor:
    """[B, V] -> [B]: _gumbel_pass's draw over the ids truncated_logits keeps, in the rows that
    truncate (truncated_rows); the other rows, greedy ones included, draw as _gumbel_pass does,
    so that a row's token does not depend on what the other rows ask for. The kernel tests each
    id against a few numbers a row (truncation.cut_bounds); the torch reference, and the batches
    whose top-k / top-p sort the vocabulary, write the truncated logits out and mask by them."""
    rows = truncated_rows(sb, x.shape[-1])
    if kernel and (sb.top_k_bound or not (sb.do_top_k or sb.do_top_p)):
        from ..kernels.truncated_sample import cut_gumbel_argmax

        lo, top_p_cut = cut_bounds(x, sb, rows)
        return cut_gumbel_argmax(x, sb.temperature, sb.seeds, sb.steps, lo, top_p_cut)
    x = x.float()  # once (truncated_logits writes only its own tensors)
    dropped = rows[:, None] & (truncated_logits(x, sb) == float("-inf"))
    return _gumbel_pass(x.masked_fill(dropped, float("-inf")), sb, kernel)


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
    elif sb.allowed_bits is not None:
        logits = constrained_logits(logits, sb.allowed_bits)
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
            or sb.bias_rows is not None or sb.allowed_rows is not None
            or sb.allowed_bits is not None)


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


def constrained_logits(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """logits [B, V], bits [B, ceil(V / 8)] uint8 (SamplingBatch.allowed_bits: a structured
    output's constraint, id i at bit i % 8 of byte i // 8; all ones for a row without) -> fp32
    logits with the ids a row's constraint drops at -inf. The raw modes' values: vLLM applies
    its grammar bitmask to the model's logits before its sampler, so that even its raw logprobs
    are those of the constrained logits (allowed_token_ids, bad words, the bias and the
    penalties act inside the sampler, after the raw values are taken)."""
    # One fp32 copy whatever the logits' dtype (the caller's logits are never written).
    return drop_disallowed_(logits.to(torch.float32, copy=True), bits)


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
