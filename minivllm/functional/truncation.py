"""Truncation of a batch's (penalised) logits: temperature, min-p, top-k and top-p in vLLM v1's
order, the ids they drop at -inf; top-k and top-p on torch.topk's candidates where every row
that needs them allows (SamplingBatch.top_k_bound), else on a sort of the vocabulary."""

from __future__ import annotations

import torch

from .sampling_batch import SamplingBatch


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
    min-p: processed_logits turns those off first). In place where a tensor is its own, for the
    peak's sake (apply_penalties says why)."""
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
    ids kept, in exact arithmetic (_kth and _top_p_bounds say how)."""
    neg_inf = float("-inf")
    vals, ids = x.topk(sb.top_k_bound, dim=-1)  # [B, K], largest first (ties in no set order)
    kth, has_k = _kth(vals, sb)
    if sb.do_top_k:
        x.masked_fill_(x < kth, neg_inf)  # ids tied with the k-th value stay
    if not sb.do_top_p:
        return x
    tied = (x == kth) & (kth > neg_inf)  # [B, V] T (none where fewer than k ids are finite)
    cut, last_val, last_id, n_tied = _top_p_bounds(vals, ids, kth, has_k,
                                                   tied.sum(dim=-1, keepdim=True), sb)
    column = torch.arange(x.shape[-1], device=x.device)[None, :]
    g_drop = (x > kth) & ((x < last_val) | ((x == last_val) & (column > last_id)))
    t_drop = tied & (tied.cumsum(dim=-1, dtype=torch.int32) > n_tied)  # 1 + rank in id order
    x.masked_fill_(cut & (g_drop | t_drop), neg_inf)
    return x


def _kth(vals: torch.Tensor, sb: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's candidates' values [B, K] (its K largest, largest first) -> its k-th largest
    value kth [B, 1] (-inf in a row without a top-k, k past K) and whether it has one [B, 1]."""
    k = sb.top_k[:, None]
    has_k = k <= sb.top_k_bound
    kth = torch.where(has_k, vals.gather(1, k.clamp(max=sb.top_k_bound) - 1), float("-inf"))
    return kth, has_k


def _top_p_bounds(vals: torch.Tensor, ids: torch.Tensor, kth: torch.Tensor, has_k: torch.Tensor,
                  t: torch.Tensor, sb: SamplingBatch
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which ids top-p keeps among those top-k keeps, as four numbers a row [B, 1] (cut: whether
    top-p may cut the row; last_val, last_id; n_tied), from its K candidates (vals, ids: the K
    largest values and their ids, in any order among equal values), kth and has_k (_kth) and t,
    the number of its ids equal to kth (the whole row's).

    The candidates hold every id above kth (fewer than k), G, followed by some of the ids tied
    at kth, T (t of them, at least one where kth is finite). truncated_logits' order for top-p is
    G by value then id, then T by id; G sorted among the candidates gives each member the mass
    before it, and the j-th of T (from 0) has mass M_G + j * q before it (M_G: G's mass, q: one
    tied id's), so T's first n_tied = ceil((top_p - M_G) / q) ids stay (none where G reaches
    top_p), by their rank in id order. G's ids after its last kept one, (last_val, last_id) in
    the order value down, id up, go (every G id where G keeps none: last_val +inf). Rows without
    a top-k (k past K) have top_p 1 by the batch's condition, or are greedy (sample() overrides
    their draw; processed_logits turns their truncation off): no cut."""
    cut = has_k & (sb.top_p < 1)[:, None]  # rows top-p may cut
    top_p = torch.where(cut, sb.top_p[:, None], float("inf"))
    # The candidates by value, ties by id: sorted by id, then stably by value (K a row).
    by_id = ids.argsort(dim=-1)
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    vals, by_value = vals.sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, by_value)
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
    last = (keep_g.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    last_val = torch.where(keep_g[:, :1], vals.gather(1, last), float("inf"))
    return cut, last_val, ids.gather(1, last), n_tied


def cut_bounds(logits: torch.Tensor, sb: SamplingBatch, rows: torch.Tensor, **tiling
               ) -> tuple[torch.Tensor, tuple | None]:
    """What kernels.truncated_sample.cut_gumbel_argmax needs to keep, in the rows `rows` [B]
    bool, the ids truncated_logits keeps, without writing them: lo [B] (the ids with
    logits / T < lo go: min-p's floor, top-k's k-th value; -inf in the other rows) and, where
    top-p may cut, (kth, cut, last_val, last_id, n_tied, ties_before) (_top_p_bounds' numbers;
    ties_before [B, n]: the ids equal to kth in the kernel's chunks before each). For a batch
    without top-k and top-p, or whose top-k / top-p run on candidates (sb.top_k_bound), which
    the sort's batches cannot. `tiling`: the kernels' block and chunk, for tests.

    logits [B, V] in any float dtype (penalised or not): the top-k of the raw values
    (kernels.top_candidates), then the division, gives the values truncated_logits' topk of the
    divided ones gives (a division by a positive T keeps their order, and IEEE rounding is per
    value), and every id above the k-th value among the candidates, which is all _top_p_bounds
    asks of them (which of the ids tied at the k-th value are among them does not matter: the
    kernels count those); kernels.truncated_sample.candidate_bounds does _kth's and
    _top_p_bounds' arithmetic a row in one program."""
    assert sb.top_k_bound or not (sb.do_top_k or sb.do_top_p), \
        "the sort's batches: truncated_logits"
    log_min_p = torch.log(sb.min_p) if sb.do_min_p else None  # truncated_logits' floor's term
    if not sb.top_k_bound:  # min-p alone (or nothing): its floor, truncated_logits' same sum
        if log_min_p is None:
            return torch.full_like(sb.temperature, float("-inf")), None
        temp = torch.where(sb.temperature > 0, sb.temperature, torch.ones_like(sb.temperature))
        floor = logits.amax(dim=-1).float() / temp + log_min_p
        return torch.where(rows, floor, float("-inf")), None
    from ..kernels.top_candidates import top_candidates
    from ..kernels.truncated_sample import candidate_bounds

    vals, ids = top_candidates(logits, sb.top_k_bound)  # [B, K] (any float dtype), int64
    return candidate_bounds(logits, vals, ids, sb.temperature, sb.top_k, sb.top_p, log_min_p, rows,
                            top_p_cut=sb.do_top_p, **tiling)


def truncated_rows(sb: SamplingBatch, vocab: int) -> torch.Tensor:
    """[B] bool: the rows that sample with top-k, top-p or min-p (the inverse-CDF path)."""
    cut = (sb.top_k < vocab) | (sb.top_p < 1) | (sb.min_p > 0)
    return cut & (sb.temperature > 0)
