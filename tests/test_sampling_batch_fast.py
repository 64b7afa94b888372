"""make_sampling_batch reads its flags off numpy reductions: they must equal the per-row rules."""

import random

import torch

from minivllm.functional.sampling import SamplingRow, make_sampling_batch


def _row(rng: random.Random) -> SamplingRow:
    pick = rng.choice
    return SamplingRow(temperature=pick([0.0, 0.6, 1.0]), top_k=pick([0, -1, 5, 50, 60]),
                       top_p=pick([1.0, 0.9]), min_p=pick([0.0, 0.1]),
                       presence_penalty=pick([0.0, 0.0, 0.5]), frequency_penalty=pick([0.0, 0.0, -0.5]),
                       repetition_penalty=pick([1.0, 1.0, 1.2]), seed=rng.getrandbits(64),
                       step=rng.randrange(100), output_ids=(1, 2), prompt_ids=(3,),
                       banned_ids=pick([(), (4,)]), logprobs=pick([None, 2]))


def test_flags_and_columns_follow_the_rows():
    rng = random.Random(0)
    vocab = 50
    for _ in range(200):
        rows = [_row(rng) for _ in range(rng.randint(1, 6))]
        sb = make_sampling_batch(rows, vocab_size=vocab)
        top_k = [r.top_k if 0 < r.top_k < vocab else vocab for r in rows]
        truncated = [r.temperature > 0 and (k < vocab or r.top_p < 1 or r.min_p > 0)
                     for r, k in zip(rows, top_k)]
        assert sb.all_greedy == all(r.temperature == 0 for r in rows)
        assert sb.any_greedy == any(r.temperature == 0 for r in rows)
        assert sb.any_truncated == any(truncated) and sb.all_truncated == all(truncated)
        assert sb.do_top_k == any(k < vocab for k in top_k)
        assert sb.do_top_p == any(r.top_p < 1 for r in rows)
        assert sb.do_min_p == any(r.min_p > 0 for r in rows)
        penalised = any(r.presence_penalty or r.frequency_penalty or r.repetition_penalty != 1
                        for r in rows)
        assert (sb.output_ids is not None) == penalised
        assert (sb.prompt_ids is not None) == any(r.repetition_penalty != 1 for r in rows)
        assert sb.top_k.tolist() == top_k and sb.steps.tolist() == [r.step for r in rows]
        assert torch.equal(sb.temperature, torch.tensor([r.temperature for r in rows]))
        assert sb.temperature.is_contiguous() and sb.seeds.is_contiguous()


def test_steps_override_the_rows_steps():
    rows = [SamplingRow(temperature=0.5, seed=1, step=0)] * 3
    sb = make_sampling_batch(rows, vocab_size=10, steps=[4, 5, 6])
    assert sb.steps.tolist() == [4, 5, 6]


def test_every_column_starts_16_byte_aligned_whatever_the_batch(device):
    """Triton specialises a kernel on whether each pointer is 16-byte aligned: columns of an
    odd-sized batch that started mid-alignment made the sampler compile new variants while
    serving. Every tensor column must start aligned, for every B, and still hold its rows."""
    for b in range(1, 10):
        rows = [SamplingRow(temperature=0.5 + r, top_k=r + 1, seed=100 + r, step=r)
                for r in range(b)]
        sb = make_sampling_batch(rows, vocab_size=1000, device=device)
        for name in ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "seeds", "steps"):
            column = getattr(sb, name)
            assert column.shape == (b,) and column.data_ptr() % 16 == 0, (b, name)
        assert sb.seeds.tolist() == [100 + r for r in range(b)]
        assert sb.steps.tolist() == list(range(b))
        assert sb.top_k.tolist() == [r + 1 for r in range(b)]
        assert sb.temperature.tolist() == [0.5 + r for r in range(b)]
