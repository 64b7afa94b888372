"""Tests from session 50's mutation round over minivllm/runtime (the host-side engine): each one
failed on a mutant that the rest of the suite let through. The oracles are written here from the
documented rules (vLLM's stop semantics, the allocator's counting rules), never read back from the
code under test."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.runtime.block_manager import BlockManager
from minivllm.runtime.sampling_params import SamplingParams
from minivllm.runtime.scheduler import Scheduler
from minivllm.runtime.sequence import Sequence, Status

# -- stop rules: the scheduler against a hand-written model of vLLM's -----------------------------

EOS_IDS = (7, 9)  # the EOS proper first, then a generation_config.json EOS id


def expected_end(prompt_len, script, p: SamplingParams, max_model_len, eos_ids=EOS_IDS):
    """(output ids, finish_reason, stop_reason) of a completion that samples `script`, by the
    rules: the k-th generated token (k = 1, 2, ...) stops it when k >= min_tokens and it is an
    EOS id (unless ignore_eos; stop_reason None for the first EOS id, else the id) or a stop id
    (stop_reason the id); otherwise it ends by length once k == max_tokens or
    prompt_len + k == max_model_len. None if the script runs out first."""
    for k, tok in enumerate(script, start=1):
        if k >= p.min_tokens:
            if not p.ignore_eos and tok in eos_ids:
                return script[:k], "stop", (None if tok == eos_ids[0] else tok)
            if tok in (p.stop_token_ids or ()):
                return script[:k], "stop", tok
        if (p.max_tokens is not None and k == p.max_tokens) or prompt_len + k == max_model_len:
            return script[:k], "length", None
    return None


def run_scheduler(requests, *, max_model_len, asynchronous, num_blocks=64, block_size=4,
                  max_num_seqs=3, max_num_batched_tokens=8):
    """Drive a Scheduler as the engine does, each sequence sampling its script in order; the
    finished sequences."""
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      max_model_len=max_model_len)
    seqs = []
    for i, (prompt, params, script) in enumerate(requests):
        seq = Sequence(i, str(i), 0, prompt, params, 0, eos_ids=EOS_IDS)
        seq.script = script
        seqs.append(seq)
        sched.add(seq)

    in_flight = None
    for _ in range(500):
        if not (sched.has_unfinished() or in_flight):
            break
        out = sched.schedule()
        if not asynchronous:
            assert not out.empty
            sched.update(out, [c.seq.script[c.seq.num_output] for c in out.sampled])
            continue
        # asynchronous: advance (appends PENDING), resolve the previous step afterwards
        tokens = [c.seq.script[c.seq.num_output] for c in out.sampled]
        sched.advance(out)
        if in_flight is not None:
            sched.resolve(*in_flight)
        in_flight = (out, tokens) if out.chunks else None
    else:
        raise AssertionError("requests never finish")
    bm.check([])
    assert bm.num_free == num_blocks
    return seqs


SCRIPT_IDS = st.sampled_from([1, 2, 3, 7, 9, 11])


@st.composite
def a_request(draw):
    prompt = draw(st.lists(st.integers(0, 5), min_size=1, max_size=9))
    max_tokens = draw(st.one_of(st.none(), st.integers(1, 8)))
    min_tokens = draw(st.integers(0, max_tokens if max_tokens is not None else 8))
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens,
                            ignore_eos=draw(st.booleans()),
                            stop_token_ids=draw(st.lists(st.sampled_from([3, 11, 9]), max_size=2)))
    script = draw(st.lists(SCRIPT_IDS, min_size=24, max_size=24))
    return prompt, params, script


@settings(max_examples=150, deadline=None)
@given(st.lists(a_request(), min_size=1, max_size=4), st.booleans(), st.integers(10, 20))
def test_every_completion_ends_where_the_stop_rules_say(requests, asynchronous, max_model_len):
    """EOS (the first EOS id: stop_reason None; another: the id), stop ids, ignore_eos,
    min_tokens, max_tokens and max_model_len, synchronous and asynchronous: each finished
    sequence's output, finish_reason and stop_reason equal the hand-written rule's."""
    seqs = run_scheduler(requests, max_model_len=max_model_len, asynchronous=asynchronous)
    for seq, (prompt, params, script) in zip(seqs, requests):
        want = expected_end(len(prompt), script, params, max_model_len)
        assert want is not None
        assert seq.status is Status.FINISHED
        assert (seq.output_ids, seq.finish_reason, seq.stop_reason) == want, (prompt, params)
        assert seq.num_pending == 0 and seq.token_ids == list(prompt) + want[0]


# -- the scheduler's own guards -------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(max_num_seqs=0), dict(max_num_batched_tokens=0)])
def test_a_scheduler_refuses_a_budget_of_zero(kw):
    """A budget of 0 could never schedule anything: refused when built, not an endless loop."""
    args = dict(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=32) | kw
    with pytest.raises(ValueError, match="must be >= 1"):
        Scheduler(BlockManager(8, 4), **args)


def test_finishing_a_sequence_mid_flight_drops_its_pending_token_and_is_idempotent():
    """An abort (or a stop string) between advance() and resolve(): the finished sequence holds
    only known tokens and its blocks are free; finishing it again changes nothing; resolve()
    then skips it (its token is dropped) and records the other sequence's."""
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    a = Sequence(0, "0", 0, [1, 2, 3], params, 0)
    b = Sequence(1, "1", 0, [4, 5], params, 0)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.advance(out)
    assert a.token_ids[-1] == b.token_ids[-1] == -1  # PENDING
    sched.finish(a, "abort")
    assert (a.token_ids, a.num_pending, a.block_table, a.finish_reason) == ([1, 2, 3], 0, [], "abort")
    free = bm.num_free
    sched.finish(a, "stop", 11)  # again: a no-op (no error, nothing freed twice, reason kept)
    assert (bm.num_free, a.finish_reason, a.stop_reason) == (free, "abort", None)
    got = sched.resolve(out, [6, 7])
    assert got == [b] and a.token_ids == [1, 2, 3] and b.token_ids == [4, 5, 7]
    bm.check(sched.sequences)


def _running(sched, prompts, params):
    """Admit and prefill `prompts` (one step, no pending token): decodes from then on."""
    seqs = [Sequence(i, str(i), 0, p, params, 0) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [c.seq for c in out.sampled] == seqs
    sched.update(out, [1] * len(seqs))
    return seqs


def test_a_spent_budget_schedules_no_empty_chunk():
    """Three decodes under a budget of 2 tokens: the step computes the two oldest, one token
    each, and holds no chunk of zero tokens for the third (it waits for the next step)."""
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=6, max_model_len=32)
    seqs = _running(sched, [[2, 3], [4, 5], [6]], SamplingParams(max_tokens=8, ignore_eos=True))
    sched.max_num_batched_tokens = 2
    out = sched.schedule()
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(seqs[0], 1), (seqs[1], 1)]
    assert out.num_tokens == 2 and all(c.num_tokens >= 1 for c in out.chunks)


@pytest.mark.parametrize("limit", ["max_tokens", "max_model_len"])
def test_a_sequence_whose_pending_token_is_its_last_is_not_scheduled_again(limit):
    """Asynchronous scheduling: once the pending token is certain to end the sequence (its
    max_tokens-th, or the one reaching max_model_len), the next step computes nothing for it
    (it would sample a token that is then dropped, and could take a block from others)."""
    bm = BlockManager(16, 4)
    max_model_len = 6 if limit == "max_model_len" else 32
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=max_model_len)
    seq = Sequence(0, "0", 0, [1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True)
                   if limit == "max_tokens" else SamplingParams(max_tokens=None, ignore_eos=True), 0)
    sched.add(seq)
    first = sched.schedule()  # the prefill samples token 1
    sched.advance(first)
    second = sched.schedule()  # decodes the pending token 1, sampling token 2: the last
    assert [c.seq for c in second.sampled] == [seq]
    sched.advance(second)
    sched.resolve(first, [5])
    assert sched.schedule().empty  # token 2 (pending) ends it: nothing to compute
    sched.resolve(second, [6])
    assert seq.finished and seq.finish_reason == "length" and seq.output_ids == [5, 6]


def test_a_prefill_chunk_ending_before_the_last_prompt_token_samples_nothing():
    """A 6-token prompt under a 5-token budget: the first chunk (tokens 0-4) stops one short of
    the last token, so it wants no logits; the second (token 5) does."""
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=2, max_num_batched_tokens=5, max_model_len=32)
    seq = Sequence(0, "0", 0, [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True), 0)
    sched.add(seq)
    out = sched.schedule()
    assert [(c.start, c.num_tokens, c.want_logits) for c in out.chunks] == [(0, 5, False)]
    assert out.sampled == []
    sched.update(out, [])
    out = sched.schedule()
    assert [(c.start, c.num_tokens, c.want_logits) for c in out.chunks] == [(5, 1, True)]


def test_a_prompt_is_counted_as_cached_only_at_its_first_admission():
    """num_cached_prompt (RequestOutput.num_cached_tokens) and the scheduler's total count what
    the prefix cache held when the sequence was first scheduled (vLLM's meaning): a sequence
    preempted and readmitted through its own cached blocks adds nothing."""
    bm = BlockManager(6, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=40)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    a = Sequence(0, "0", 0, list(range(1, 9)), params, 0)
    b = Sequence(1, "1", 0, list(range(11, 18)), params, 0)
    for s in (a, b):
        sched.add(s)
    hits_of_b, match = [], bm.match_prefix

    def spy(seq):
        hits = match(seq)
        if seq is b:
            hits_of_b.append(len(hits))
        return hits
    bm.match_prefix = spy
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.update(out, [20 + c.seq.num_output for c in out.sampled])
        bm.commit()
    # the scenario: B was preempted and readmitted through its own cached blocks
    assert a.finished and b.finished and b.num_preemptions >= 1 and hits_of_b[0] == 0
    assert max(hits_of_b) >= 1
    assert (a.num_cached_prompt, b.num_cached_prompt, sched.num_prompt_tokens_cached) == (0, 0, 0)


def test_an_abandoned_step_recomputes_a_sequence_whose_last_hit_was_never_written():
    """Step 1 computes and commits A's first block; step 2 computes A's second block and admits
    B (A's prompt), which hits both. Step 2 never runs (abandon): A's second block was never
    written, so B, which would read it, must be recomputed (back to waiting, no blocks), even
    though its first hit is fine."""
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=5, max_model_len=32)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    a = Sequence(0, "0", 0, prompt, params, 0)
    sched.add(a)
    out = sched.schedule()
    bm.commit()
    sched.update(out, [])
    b = Sequence(1, "1", 0, prompt, params, 0)
    sched.add(b)
    out = sched.schedule()
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(a, 5, 4), (b, 8, 1)]
    assert b.block_table[:2] == a.block_table[:2]
    sched.abandon(out)
    assert b.status is Status.WAITING and b.block_table == [] and b.num_computed == 0
    assert sched.waiting == [b]
    bm.check(sched.sequences)
    # Run to the end: B then gets A's prompt computed for real.
    while sched.has_unfinished():
        out = sched.schedule()
        bm.commit()
        sched.update(out, [30] * len(out.sampled))
    assert a.output_ids == b.output_ids == [30] * 4


@pytest.mark.parametrize("wrong", [[], [5, 6]])
def test_resolve_refuses_a_token_count_other_than_the_sampled_rows(wrong):
    """Asynchronous recording: a step's tokens must match its sampled rows one for one (zip
    would drop or ignore some without a word)."""
    sched = Scheduler(BlockManager(8, 4), max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32)
    seq = Sequence(0, "0", 0, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), 0)
    sched.add(seq)
    out = sched.schedule()
    sched.advance(out)
    with pytest.raises(ValueError, match="sampled tokens for 1 sampled"):
        sched.resolve(out, wrong)


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0)])
def test_a_block_manager_of_no_blocks_is_refused(num_blocks, block_size):
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockManager(num_blocks, block_size)


# -- the block manager ----------------------------------------------------------------------------


def _seq(i, tokens):
    return Sequence(i, str(i), 0, tokens, SamplingParams(), 0)


def test_with_prefix_caching_off_nothing_is_registered_or_shared():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a, b = _seq(0, [1, 2, 3, 4, 5]), _seq(1, [1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    bm.register_full_blocks(a, 5)
    assert bm.registered_blocks() == {} and a.num_registered_blocks == 0
    assert bm.match_prefix(b) == []
    bm.allocate(b, 5)
    assert not set(a.block_table) & set(b.block_table)
    bm.check([a, b])


def test_a_sequence_that_comes_back_without_hits_registers_its_blocks_again():
    """Freed (preempted), its cached blocks then evicted: when it is allocated afresh and
    recomputes its prompt, its full blocks are registered again, so that a later sequence with
    the same prompt hits them (a brute-force count: 2 full blocks before the last token)."""
    bm = BlockManager(8, 2)
    seq = _seq(0, [1, 2, 3, 4, 5])
    bm.allocate(seq, 5)
    bm.register_full_blocks(seq, 5)
    assert len(bm.registered_blocks()) == 2
    bm.free_blocks(seq)
    assert seq.num_registered_blocks == 0 and seq.block_table == []
    bm.reset_prefix_cache()
    assert bm.registered_blocks() == {} and bm.match_prefix(seq) == []
    bm.allocate(seq, 5)
    bm.register_full_blocks(seq, 5)
    probe = _seq(1, [1, 2, 3, 4, 9])
    assert bm.match_prefix(probe) == seq.block_table[:2]
    bm.check([seq])


# -- SamplingParams' boundaries (vLLM's ranges, ends included where vLLM includes them) -------------


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.0), dict(presence_penalty=-2.0),
                                dict(frequency_penalty=2.0), dict(frequency_penalty=-2.0)])
def test_penalties_at_the_ends_of_their_range_are_accepted(kw):
    assert getattr(SamplingParams(**kw), next(iter(kw))) == next(iter(kw.values()))


def test_stop_strings_without_detokenization_are_refused():
    """Stop strings are matched in the text: with detokenize=False they could never stop the
    request, so they are refused (as vLLM does) rather than ignored."""
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop="x", detokenize=False)
    assert SamplingParams(stop_token_ids=[3], detokenize=False).stop_ids == (3,)


def test_defaults_are_vllms():
    """vLLM's SamplingParams defaults (docs.vllm.ai, SamplingParams): n 1, temperature 1.0
    (random sampling), top_p 1, top_k off, min_p 0, no penalties, max_tokens 16, min_tokens 0,
    no logprobs, detokenize, skip_special_tokens and spaces_between_special_tokens on."""
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k in (0, -1), p.min_p) == (1, 1.0, 1.0, True, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed, p.ignore_eos) == (16, 0, None, None, False)
    assert (p.detokenize, p.skip_special_tokens, p.spaces_between_special_tokens,
            p.include_stop_str_in_output) == (True, True, True, False)
    assert (p.stop_strings, p.stop_ids) == ((), ()) and not p.greedy


def test_logprobs_zero_is_accepted():
    """vLLM's logprobs=0: only the sampled token's logprob (not refused, not None)."""
    assert SamplingParams(logprobs=0).logprobs == 0
    assert Sequence(0, "0", 0, [1], SamplingParams(logprobs=0), 0).logprobs == []


# -- incremental detokenization against whole decodes, with a tokenizer written here ---------------


class LetterTokenizer:
    """Ids 0-25 are the letters a-z; ids 100+ are special tokens "<k>". Like a slow
    transformers tokenizer, it joins special tokens with spaces unless told not to."""

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        parts = []
        for i in ids:
            if i >= 100:
                if skip_special_tokens:
                    continue
                parts.append((" " if spaces_between_special_tokens and parts else "") + f"<{i}>")
            else:
                parts.append(chr(ord("a") + i))
        return "".join(parts)


@pytest.mark.parametrize("spaces", [True, False])
def test_incremental_text_equals_the_whole_decode_and_the_window_moves(spaces):
    from minivllm.runtime.detokenizer import detokenize_incrementally

    tok = LetterTokenizer()
    ids = [0, 1, 100, 101, 2, 102, 3]
    prefix, read, text = 0, 0, ""
    for end in range(1, len(ids) + 1):
        new, new_prefix, new_read = detokenize_incrementally(
            tok, ids[:end], prefix, read, skip_special_tokens=False,
            spaces_between_special_tokens=spaces)
        text += new
        if new:  # the window moves on: it starts where the last read ended (vLLM's rule)
            assert (new_prefix, new_read) == (read, end)
        prefix, read = new_prefix, new_read
    want = tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=spaces)
    assert text == want
    assert ("a b" not in want) and (("<100> <101>" in want) == spaces)


class ByteTokenizer:
    """Each id is one byte (a byte-level tokenizer at its simplest): a character of several
    UTF-8 bytes is several tokens, each decoding alone to U+FFFD."""

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("prompt_text, cut", [("xyz€", 0), ("xyz€", 1), ("xyz€", 2), ("€", 0),
                                               ("ab", 0), ("a€€", 1)])
def test_output_text_starts_at_the_prompts_last_whole_character(prompt_text, cut):
    """The output's text is decode(prompt + output) less the prompt's complete characters: a
    prompt ending in a whole multi-byte character keeps it out of the output; one ending inside
    a character (cut bytes short) has the output start with that character, completed."""
    from minivllm.runtime.detokenizer import detokenize_incrementally, prompt_offsets

    tok = ByteTokenizer()
    full = list(prompt_text.encode())
    prompt = full[:len(full) - cut]
    out = full[len(full) - cut:] + list("b€c".encode())
    ids = prompt + out
    prefix, read = prompt_offsets(tok, ids, len(prompt))
    whole_chars = prompt_text if cut == 0 else prompt_text[:-1]
    assert read == len(whole_chars.encode())  # the boundary before an unfinished character
    text = ""
    for end in range(len(prompt) + 1, len(ids) + 1):
        new, prefix, read = detokenize_incrementally(tok, ids, prefix, read, end=end)
        text += new
    assert text == bytes(ids).decode()[len(whole_chars):]


def test_of_two_stop_strings_completed_at_once_the_one_starting_first_wins():
    """minivllm's documented rule (detokenizer.find_stop_string): the earliest start, whatever
    the strings' order in the list; only the new characters (and len(stop) - 1 before them)
    are searched."""
    from minivllm.runtime.detokenizer import find_stop_string

    assert find_stop_string("say hello world", 11, ("world", "hello")) == (4, "hello")
    assert find_stop_string("say hello world", 11, ("hello", "world")) == (4, "hello")
    assert find_stop_string("say hello world", 3, ("world", "hello")) == (10, "world")
    assert find_stop_string("say hello world", 3, ("hello",)) is None  # old text: searched before
    assert find_stop_string("abcdef", 1, ("cdef", "x")) == (2, "cdef")  # straddles the boundary


@pytest.mark.parametrize("eos", [True, [5, False], -1, "2", 1.0])
def test_a_generation_config_eos_that_is_no_token_id_is_refused(eos):
    """JSON true is not token id 1 (bool is an int in Python): refused, naming the file."""
    from minivllm.runtime.generation_config import eos_ids_of

    with pytest.raises(ValueError, match="where.json: eos_token_id"):
        eos_ids_of({"eos_token_id": eos}, "where.json")
    assert eos_ids_of({"eos_token_id": [5, None, 6]}, "where.json") == [5, 6]
    assert eos_ids_of({"eos_token_id": 0}, "where.json") == [0]


# -- memory and workload arithmetic, against published figures and the documented rules -------------


def test_a_kv_block_holds_k_and_v_of_every_layer():
    """Qwen3-0.6B: 28 layers, 8 KV heads of 128: K and V of one token in bf16 take
    2 * 28 * 8 * 128 * 2 = 114688 bytes (112 KiB, the model card's figure); a 16-token block 16x."""
    from types import SimpleNamespace

    import torch

    from minivllm.runtime.memory import kv_block_bytes
    from minivllm.state.config import config_for_shape
    from minivllm.state.shard import ShardSpec

    params = SimpleNamespace(config=config_for_shape("qwen3-0.6b"), shard=ShardSpec())
    assert kv_block_bytes(params, 16, torch.bfloat16) == 16 * 114688
    assert kv_block_bytes(params, 1, torch.float32) == 2 * 114688


def test_the_cpu_kv_budget_is_4_gib_at_most_a_quarter_of_the_ram(monkeypatch):
    from minivllm.runtime import memory

    monkeypatch.delenv("MINIVLLM_CPU_KV_CACHE_SPACE", raising=False)
    for ram_gib, want in ((8, 2), (64, 4)):
        pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": ram_gib * memory.GiB // 4096}
        monkeypatch.setattr(memory.os, "sysconf", pages.__getitem__)
        assert memory.cpu_kv_budget_bytes() == want * memory.GiB
    monkeypatch.setenv("MINIVLLM_CPU_KV_CACHE_SPACE", "0.5")
    assert memory.cpu_kv_budget_bytes() == memory.GiB // 2


def test_start_up_memory_exactly_at_the_limit_is_not_over():
    from minivllm.runtime.memory import GiB, startup_memory_report

    _, over = startup_memory_report([("weights", 2 * GiB), ("cache", 8 * GiB)], 10 * GiB, 0.8)
    assert not over
    _, over = startup_memory_report([("weights", 2 * GiB), ("cache", 8 * GiB + 1)], 10 * GiB, 0.8)
    assert over


def test_the_throughput_workload_takes_nano_vllms_least_lengths():
    """Lengths are drawn from randint(100, max): a max of exactly 100 is allowed (every length
    100), 99 is not; a vocabulary must hold id 10000."""
    from minivllm.runtime.workload import check_vocabulary, throughput_workload

    prompts, max_tokens = throughput_workload(3, 100, 100)
    assert [len(p) for p in prompts] == [100] * 3 and max_tokens == [100] * 3
    with pytest.raises(ValueError, match="max_input_len"):
        throughput_workload(3, 99, 100)
    check_vocabulary(10001)
    with pytest.raises(ValueError, match="10000"):
        check_vocabulary(10000)


def test_the_traffic_floor_reads_the_cache_in_its_own_dtype_and_needs_a_sequence():
    """An fp8 cache (1 byte) halves the KV bytes of a bf16 one (2 bytes), weights unchanged;
    the workload needs at least one sequence."""
    from minivllm.runtime.workload import check_throughput_workload, traffic_floor_bytes
    from minivllm.state.config import config_for_shape

    config = config_for_shape("qwen3-0.6b")
    bf16 = traffic_floor_bytes(config, [100, 200], [10, 20])
    fp8 = traffic_floor_bytes(config, [100, 200], [10, 20], kv_dtype_bytes=1)
    assert fp8["kv_bytes"] * 2 == bf16["kv_bytes"] and fp8["weight_bytes"] == bf16["weight_bytes"]
    with pytest.raises(ValueError, match="at least one sequence"):
        check_throughput_workload(0, 1024, 1024)
