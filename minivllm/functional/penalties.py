"""Penalties and logits processors on a batch's logits, before temperature and truncation
(vLLM v1's order): allowed ids (and a structured output's packed constraint), logit bias, the
repetition / frequency / presence penalties on each row's own ids, banned ids."""

from __future__ import annotations

import torch

from .sampling_batch import SamplingBatch


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
    if sb.allowed_bits is not None:
        drop_disallowed_(x, sb.allowed_bits)
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


def drop_disallowed_(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """x [B, V] with the ids each row's packed bitmask drops set to -inf, in place; bits
    [B, ceil(V / 8)] uint8, id i at bit i % 8 of byte i // 8 (SamplingBatch.allowed_bits)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device)
    keep = (bits[:, :, None] >> shifts).bitwise_and_(1).view(bits.shape[0], -1)
    return x.masked_fill_(keep[:, :x.shape[-1]] == 0, float("-inf"))
