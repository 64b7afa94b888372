"""make_sampling_batch reads its flags off numpy reductions: they must equal the per-row rules;
with_steps and the runner's reuse of the last batch must equal a batch made afresh."""

import random

import attrs
import numpy as np
import pytest
import torch

from minivllm import SamplingParams
from minivllm.functional.sampling import (SamplingRow, apply_penalties, make_sampling_batch,
                                          plain_greedy, with_pending_ids, with_steps)
from minivllm.runtime.runner import StepInput
from minivllm.runtime.sequence import PENDING, Sequence


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


def _batches_equal(a, b) -> bool:
    for name in attrs.fields_dict(type(a)):
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if x is None or y is None or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def test_with_steps_equals_a_batch_made_at_those_steps():
    rng = random.Random(1)
    for _ in range(100):
        rows = [_row(rng) for _ in range(rng.randint(1, 9))]
        steps = [rng.randrange(1000) for _ in rows]
        old = make_sampling_batch(rows, vocab_size=50, steps=[0] * len(rows))
        new = with_steps(old, steps)
        assert _batches_equal(new, make_sampling_batch(rows, vocab_size=50, steps=steps))
        assert new.steps.data_ptr() % 16 == 0
        assert old.steps.tolist() == [0] * len(rows)  # the old batch is left as it was
    with pytest.raises(ValueError, match="2 steps for 3 rows"):
        with_steps(make_sampling_batch(rows[:1] * 3, vocab_size=50), [1, 2])


def test_the_runner_sends_only_steps_when_a_step_samples_the_very_same_rows(monkeypatch):
    """ModelRunner._sampling_batch: the same row objects in the same order reuse the last batch
    (with_steps); a new row, another order or a row count that differs builds a new one."""
    from types import SimpleNamespace

    from minivllm.runtime import runner as runner_mod

    built = []

    def make(rows, **kw):
        built.append(len(rows))
        return make_sampling_batch(rows, **kw)

    monkeypatch.setattr(runner_mod, "make_sampling_batch", make)
    runner = SimpleNamespace(last_sampling=None, vocab_size=50, device=torch.device("cpu"),
                             config=SimpleNamespace(logprobs_mode="raw_logprobs"))
    batch_for = runner_mod.ModelRunner._sampling_batch.__get__(runner)
    a, b, c = (SamplingRow(temperature=0.5, seed=s) for s in (1, 2, 3))
    cases = [([a, b], [0, 0], True), ([a, b], [1, 1], False), ([a, b], [2, 3], False),
             ([b, a], [3, 2], True), ([b, a, c], [4, 3, 0], True), ([b, a, c], [5, 4, 1], False),
             ([b, a, SamplingRow(temperature=0.5, seed=3)], [6, 5, 2], True), ([b], [7], True)]
    for rows, steps, builds in cases:
        n = len(built)
        sb = batch_for(StepInput([], list(rows), (), tuple(steps)))
        assert (len(built) > n) == builds, (rows, steps)
        assert _batches_equal(sb, make_sampling_batch(rows, vocab_size=50, steps=steps))
    n = len(built)
    batch_for(StepInput([], [b], (), None))  # no steps column: the rows' own, always built
    assert len(built) == n + 1


def test_banned_and_allowed_pairs_are_each_rows_ids_in_order():
    """The (row, id) pairs filled in C (_row_pairs) against the rows' lists walked in Python:
    rows with none, one or many ids, in any mix, as tuples or as int64 arrays (the engine's
    allowed ids, copied whole), and the allowed rows' flags."""
    rng = random.Random(1)
    vocab = 400

    def ids(counts):
        chosen = tuple(sorted(rng.sample(range(vocab), rng.choice(counts))))
        return np.array(chosen, dtype=np.int64) if rng.random() < 0.5 else chosen

    for _ in range(100):
        arrays = rng.random() < 0.5  # every row's allowed ids an array, or a mix
        rows = [SamplingRow(temperature=0.6, banned_ids=ids([0, 0, 1, 40]),
                            allowed_ids=np.array(ids([0, 0, 1, 90]), dtype=np.int64) if arrays
                            else ids([0, 0, 1, 90]))
                for _ in range(rng.randint(1, 7))]
        sb = make_sampling_batch(rows, vocab_size=vocab)
        for rows_t, ids_t, field in ((sb.banned_rows, sb.banned_ids, "banned_ids"),
                                     (sb.allowed_row_ids, sb.allowed_ids, "allowed_ids")):
            want = [(b, i) for b, r in enumerate(rows) for i in getattr(r, field)]
            if not want:
                assert rows_t is None and ids_t is None
                continue
            assert list(zip(rows_t.tolist(), ids_t.tolist())) == want
        if sb.allowed_rows is not None:
            assert sb.allowed_rows.tolist() == [len(r.allowed_ids) > 0 for r in rows]


def test_penalised_rows_ids_are_each_rows_ids_padded_on_the_right():
    """output_ids / prompt_ids of the penalised rows (others all padding), each row's ids in
    order then the vocabulary size as padding, against the rows walked in Python."""
    rng = random.Random(2)
    vocab = 300

    def ids(n):  # a tuple or, as the engine's rows hold them, an int64 array
        got = tuple(rng.randrange(vocab) for _ in range(n))
        return np.array(got, dtype=np.int64) if rng.random() < 0.5 else got

    for _ in range(100):
        rows = [SamplingRow(temperature=0.6, presence_penalty=rng.choice([0.0, 0.5]),
                            repetition_penalty=rng.choice([1.0, 1.1]),
                            output_ids=ids(rng.choice([0, 1, 7, 30])),
                            prompt_ids=ids(rng.choice([0, 1, 12])))
                for _ in range(rng.randint(1, 6))]
        sb = make_sampling_batch(rows, vocab_size=vocab)
        for field, on in (("output_ids", lambda r: r.presence_penalty != 0
                           or r.repetition_penalty != 1),
                          ("prompt_ids", lambda r: r.repetition_penalty != 1)):
            got = getattr(sb, field)
            lists = [list(getattr(r, field)) if on(r) else [] for r in rows]
            if not any(on(r) for r in rows):
                assert got is None
                continue
            width = max(1, max(map(len, lists)))
            assert got.tolist() == [ids + [vocab] * (width - len(ids)) for ids in lists]


def test_pending_ids_penalise_as_the_whole_output_would():
    """with_pending_ids: rows built from their known ids, each pending row's last id taken from
    the previous step's tokens (on the device, in any order of rows), penalise the logits exactly
    as rows holding every id; the other rows are untouched."""
    rng = random.Random(4)
    vocab = 60
    for _ in range(60):
        b = rng.randint(1, 6)
        full = [tuple(rng.randrange(vocab) for _ in range(rng.choice([1, 2, 9]))) for _ in range(b)]
        pending = sorted(rng.sample(range(b), rng.randint(1, b)))
        tokens = torch.randint(vocab, (b + 3,))
        order = rng.sample(range(b + 3), b)  # row k's pending token is tokens[order[k]]
        full = [ids[:-1] + (int(tokens[order[k]]),) if k in pending else ids
                for k, ids in enumerate(full)]
        params = [dict(presence_penalty=rng.choice([0.0, 0.5]),
                       frequency_penalty=rng.choice([0.0, 0.7]),
                       repetition_penalty=rng.choice([1.0, 1.3])) for _ in range(b)]
        params[pending[0]]["frequency_penalty"] = 0.7  # a penalised row that has one pending

        def rows(known):
            return [SamplingRow(temperature=0.6, output_ids=ids[:-1] if known and k in pending
                                else ids, prompt_ids=(1, 2), **p)
                    for k, (ids, p) in enumerate(zip(full, params))]

        triples = [(k, len(full[k]) - 1, order[k]) for k in pending
                   if any(v != d for v, d in zip(params[k].values(), (0.0, 0.0, 1.0)))]
        got = with_pending_ids(make_sampling_batch(rows(True), vocab_size=vocab), triples,
                               tokens, vocab)
        want = make_sampling_batch(rows(False), vocab_size=vocab)
        logits = torch.randn(b, vocab)
        assert torch.equal(apply_penalties(logits, got), apply_penalties(logits, want))
    with pytest.raises(ValueError, match="without penalised rows"):
        with_pending_ids(make_sampling_batch([SamplingRow()], vocab_size=vocab), [(0, 0, 0)],
                         tokens, vocab)


def test_a_sequences_output_array_is_its_known_output_ids():
    """Sequence.output_array (a buffer extended as ids become known) against output_ids, through
    tokens appended known and pending, pendings resolved, and the views handed out earlier."""
    rng = random.Random(5)
    for _ in range(50):
        seq = Sequence(0, "r", 0, [rng.randrange(9) for _ in range(rng.randint(1, 5))],
                       SamplingParams(presence_penalty=0.5), 0)
        views = []
        for _ in range(rng.randint(1, 60)):
            if seq.num_pending and rng.random() < 0.6:  # the oldest pending token resolved
                seq.token_ids[seq.num_known] = rng.randrange(9)
                seq.num_pending -= 1
            elif rng.random() < 0.3:
                seq.token_ids.append(PENDING)
                seq.num_pending += 1
            elif not seq.num_pending:
                seq.token_ids.append(rng.randrange(9))
            got = seq.output_array()
            assert got.dtype == np.int64 and got.tolist() == seq.output_ids
            views.append((got, list(seq.output_ids)))
        assert all(v.tolist() == ids for v, ids in views)  # never rewritten under a holder
        assert seq.prompt_array().tolist() == seq.prompt_ids


def _dense_penalties(logits: torch.Tensor, sb) -> torch.Tensor:
    """apply_penalties' former dense form (until session 63): [B, V + 1] counts by scatter_add,
    then every logit divided / multiplied by its row's penalty or 1 and 0 subtracted elsewhere."""
    x = logits.to(torch.float32, copy=True)
    vocab = x.shape[-1]

    def counts(ids):
        c = torch.zeros(ids.shape[0], vocab + 1)
        c.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
        return c[:, :vocab]
    if sb.bias_rows is not None:
        x.index_put_((sb.bias_rows, sb.bias_ids), sb.bias_values, accumulate=True)
    out_counts = counts(sb.output_ids)
    in_output = out_counts > 0
    seen = in_output if sb.prompt_ids is None else in_output | (counts(sb.prompt_ids) > 0)
    rep = sb.repetition_penalty[:, None]
    positive = x > 0
    x.div_(torch.where(seen & positive, rep, 1.0))
    x.mul_(torch.where(seen & ~positive, rep, 1.0))
    x.sub_(sb.frequency_penalty[:, None] * out_counts)
    x.sub_(sb.presence_penalty[:, None] * in_output.float())
    return x


def test_penalties_on_the_rows_ids_equal_the_dense_form():
    """apply_penalties rewrites only the logits of each row's ids (id_runs): the dense form's
    values everywhere (ids repeated in output and prompt, rows without penalties or ids,
    negative, zero and -inf logits, a logit bias first), compared as values (+0.0 == -0.0)."""
    rng = random.Random(6)
    vocab = 40

    def ids(n):
        return tuple(rng.randrange(vocab) for _ in range(n))

    for _ in range(200):
        b = rng.randint(1, 5)
        rows = [SamplingRow(temperature=0.6,
                            presence_penalty=rng.choice([0.0, 0.5, -0.7]),
                            frequency_penalty=rng.choice([0.0, 0.3, -0.2]),
                            repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
                            output_ids=ids(rng.choice([0, 1, 5, 30])),
                            prompt_ids=ids(rng.choice([0, 3, 12])),
                            logit_bias=tuple((rng.randrange(vocab), 1.5)
                                             for _ in range(rng.choice([0, 2]))))
                for _ in range(b)]
        sb = make_sampling_batch(rows, vocab_size=vocab)
        if sb.output_ids is None:
            continue
        logits = torch.randn(b, vocab) * 3
        logits[torch.rand(b, vocab) < 0.1] = 0.0
        logits[torch.rand(b, vocab) < 0.05] = float("-inf")
        got, want = apply_penalties(logits, sb), _dense_penalties(logits, sb)
        assert ((got == want) | (got.isnan() & want.isnan())).all()


def test_a_packed_constraint_allows_what_the_same_ids_allow():
    """A row's allowed_bits (a structured output's packed mask) masks the logits as the same ids
    given as allowed_ids; rows without bits keep every id; with both, an id must be in both.
    A vocabulary not a multiple of 8 leaves pad bits past it unread."""
    from minivllm.runtime.guide import pack_ids

    rng = random.Random(7)
    vocab = 45
    for _ in range(60):
        b = rng.randint(1, 5)
        ids = [tuple(sorted(rng.sample(range(vocab), rng.randint(1, 20)))) for _ in range(b)]
        packed = [rng.random() < 0.7 for _ in range(b)]
        both = [rng.random() < 0.2 for _ in range(b)]
        extra = [tuple(sorted(rng.sample(range(vocab), 25))) for _ in range(b)]
        bits_rows = [SamplingRow(temperature=0.7, allowed_bits=pack_ids(np.array(i), vocab) if p
                                 else None, allowed_ids=e if x else ())
                     for i, p, x, e in zip(ids, packed, both, extra)]
        id_rows = [SamplingRow(temperature=0.7, allowed_ids=tuple(sorted(set(i) & set(e)))
                               if p and x else i if p else e if x else ())
                   for i, p, x, e in zip(ids, packed, both, extra)]
        if any(p and x and not set(i) & set(e) for i, p, x, e in zip(ids, packed, both, extra)):
            continue  # nothing allowed by both: no ids list says that
        logits = torch.randn(b, vocab)
        got = apply_penalties(logits, make_sampling_batch(bits_rows, vocab_size=vocab))
        want = apply_penalties(logits, make_sampling_batch(id_rows, vocab_size=vocab))
        assert torch.equal(got, want)
    assert not plain_greedy(SamplingRow(temperature=0.0, allowed_bits=pack_ids(np.arange(3), 9)))
