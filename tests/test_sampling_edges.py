"""What mutating functional/sampling.py let through (session 49): each test fails on its
mutant, against the sampler's definition (vLLM's greedy threshold, the inverse CDF)."""

import torch

from minivllm.functional.sampling import (SAMPLING_EPS, SamplingRow, make_sampling_batch, sample,
                                          sample_from_probs)


def test_inverse_cdf_never_lands_on_a_zero_id_at_a_chunk_edge():
    """Uniforms aimed at the top of a chunk (and of the row) whose last ids have probability 0:
    the two levels' float64 sums round differently by an ulp or so, and the local target can
    fall past the chunk's own total, past its last id of mass. The draw must still be an id of
    mass, the one the whole row's CDF picks up to that rounding."""
    gen = torch.Generator().manual_seed(0)
    b, v, chunk = 64, 512, 256
    for _ in range(20):
        probs = torch.rand(b, v, generator=gen) ** 4
        probs[:, 240:256] = 0.0  # chunk 0 ends in zeros
        probs[:, 500:] = 0.0  # so does the row
        probs = probs / probs.sum(-1, keepdim=True)
        sums = probs.double().view(b, 2, chunk).sum(-1).cumsum(-1)
        edge = torch.cat([(sums[:, 0] / sums[:, 1])[: b // 2],
                          torch.full((b // 2,), 1 - 2.0 ** -45, dtype=torch.float64)])
        for u in (edge, torch.nextafter(edge, torch.ones_like(edge)),
                  torch.nextafter(edge, torch.zeros_like(edge))):
            got = sample_from_probs(probs, u, chunk=chunk)
            assert torch.all(probs.gather(1, got[:, None]) > 0)
            cdf = probs.double().cumsum(-1)
            target = u * cdf[:, -1]
            # the first id whose CDF reaches the target, within rounding
            lo = torch.where(got > 0, cdf.gather(1, (got - 1).clamp(min=0)[:, None]).squeeze(1),
                             torch.zeros_like(target))
            hi = cdf.gather(1, got[:, None]).squeeze(1)
            assert torch.all(lo <= target + 1e-12) and torch.all(hi >= target - 1e-12)


def test_a_temperature_of_exactly_sampling_eps_samples():
    """As vLLM: a temperature below SAMPLING_EPS is greedy, one of exactly SAMPLING_EPS samples.
    Two tied logits: greedy always takes the lower id, a draw at any temperature takes either."""
    logits = torch.tensor([[0.0, 3.0, 3.0, -1.0]]).repeat(64, 1)

    def draw(temperature):
        rows = [SamplingRow(temperature=temperature, seed=s) for s in range(64)]
        return sample(logits, make_sampling_batch(rows, vocab_size=4)).token_ids

    assert torch.all(draw(SAMPLING_EPS * 0.99) == 1)
    drawn = draw(SAMPLING_EPS)
    assert set(drawn.tolist()) == {1, 2}


_M32 = 0xFFFFFFFF


def _unhash32(x: int) -> int:
    """The inverse of sampling._hash32 (lowbias32): each xor-shift and odd multiply undone."""
    x ^= x >> 16
    x = (x * pow(0x846CA68B, -1, 1 << 32)) & _M32
    x ^= (x >> 15) ^ (x >> 30)
    x = (x * pow(0x7FEB352D, -1, 1 << 32)) & _M32
    return x ^ (x >> 16)


def _seed_whose_key_is_zero(step: int) -> int:
    """A seed (high 32 bits 0) whose counter_key at `step` is 0, the smallest hash there is:
    counter_key's last two rounds undone."""
    from minivllm.functional.sampling import _hash32

    h = int(_hash32(_hash32(torch.tensor((step & _M32) ^ 0x9E3779B9))))  # xor hi = 0
    return _unhash32(_unhash32(0) ^ 0x85EBCA6B) ^ h


def test_the_uniform_stays_inside_the_open_interval_at_the_smallest_hash():
    """uniform_from_counter's draws lie in (0, 1), the hash's smallest value included: a draw
    of exactly 0 would pick the row's first chunk of ids even where it has no mass (top-k cut
    it), and there the id of no mass. With top_k=1 every seed samples the arg-max."""
    from minivllm.functional.sampling import counter_key, uniform_from_counter

    seed = _seed_whose_key_is_zero(step=3)
    seeds, steps = torch.tensor([seed]), torch.tensor([3])
    assert counter_key(seeds, steps).item() == 0  # the seed is the edge case it is meant to be
    u = uniform_from_counter(seeds, steps).item()
    assert 0.0 < u < 1.0
    logits = torch.linspace(-2.0, 2.0, 600).flip(0).roll(400)[None, :]  # arg-max 400, chunk 1
    row = SamplingRow(temperature=1.0, top_k=1, seed=seed, step=3)
    assert sample(logits, make_sampling_batch([row], vocab_size=600)).token_ids.tolist() == [400]


def test_a_draw_exactly_at_a_chunk_boundary_takes_the_first_id_reaching_it():
    """sample_from_probs' definition: the first id whose CDF reaches u * total. With dyadic
    probabilities every sum is exact, and a uniform landing exactly on the CDF at a chunk's end
    must pick that chunk's last id of mass, not the next chunk's first (the full-row CDF, left
    search, is the reference)."""
    chunk, v = 8, 40
    probs = torch.zeros(4, v)
    probs[:, [1, 5, 6, 9, 15, 17, 22, 30, 33, 38]] = 1 / 16  # 10 ids of mass, chunks 0-4
    probs[1, 6], probs[1, 9] = 3 / 16, 0.0
    probs[2, 22] = 0.0  # chunk 2 then has mass only at id 17
    probs[3] = probs[0]
    cdf = probs.double().cumsum(-1)
    for at in (2, 3, 4, 5, 7):  # u * total lands on the CDF after that many ids of mass
        u = (at / 16) / cdf[:, -1]
        got = sample_from_probs(probs, u, chunk=chunk)
        want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1)
        assert torch.equal(got, want), (at, got.tolist(), want.tolist())
        assert torch.all(probs.gather(1, got[:, None]) > 0)


def test_banned_ids_stay_banned_at_any_temperature():
    """A banned id's logit is -inf, not merely very low: at a temperature near fp32's largest
    (SamplingParams accepts it) every finite logit is as good as another and a draw is uniform
    over them, yet the banned ids never come, on either path."""
    logits = torch.tensor([[5.0, 4.0, -1.0, -2.0, 0.5, 3.0]]).expand(400, -1).clone()
    for extra in (dict(), dict(top_k=5)):  # Gumbel-max; inverse CDF
        rows = [SamplingRow(temperature=1e30, seed=s, banned_ids=(0, 1), **extra) for s in range(400)]
        ids = sample(logits, make_sampling_batch(rows, vocab_size=6)).token_ids.tolist()
        assert set(ids) <= {2, 3, 4, 5}, extra
        assert len(set(ids)) >= 3  # and the draw does spread over the others


def test_make_sampling_batch_refuses_steps_of_another_length():
    """One step for two rows would broadcast to both silently."""
    import pytest

    rows = [SamplingRow(seed=1), SamplingRow(seed=2)]
    with pytest.raises(ValueError, match="1 steps for 2 rows"):
        make_sampling_batch(rows, vocab_size=10, steps=[5])
