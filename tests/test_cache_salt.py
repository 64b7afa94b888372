"""vLLM's cache_salt (session 78): a request's prompt dict ({"prompt_token_ids": ..., "cache_salt":
"s"}, LLM.generate's TokensPrompt / TextPrompt) or its completion / chat body's "cache_salt" salts
the prefix cache, so that its blocks are shared only with requests of the same salt (and LoRA
adapter): never with unsalted requests, nor with other salts.

The reference is vLLM's documented behaviour, read in vllm-project/vllm:
vllm/v1/core/kv_cache_utils.py (generate_block_hash_extra_keys puts request.cache_salt among the
first block's extra keys, _gen_lora_extra_hash_keys the adapter among every block's, and
hash_block_tokens chains each block's hash on its parent's: a block is a hit only where the
whole chain, salt included, matches), vllm/inputs (the prompt dicts' "cache_salt" key) and
vllm/entrypoints/openai/protocol.py (check_cache_salt_support: "Parameter 'cache_salt' must be
a non-empty string if provided.", null meaning no salt). The block manager is checked against
that chain, written out here as tuples (vllm_block_keys); the engine against it through
num_cached_tokens, and its greedy tokens against an engine without the prefix cache; the
server's field through usage's cached_tokens."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm import LoRARequest, SamplingParams
from minivllm.runtime.block_manager import BlockManager
from minivllm.runtime.demo import ensure_demo_model
from minivllm.runtime.pooling import PoolingParams
from minivllm.runtime.sequence import Sequence
from minivllm.runtime.server import OpenAIServer

import engine_helpers
from hf_tiny import make_hf_model, save_checkpoint
from test_lora import write_adapter
from test_server import post

SALTS = [None, "a", "b"]


def vllm_block_keys(tokens: list[int], bs: int, lora_id: int, salt: str | None) -> list[tuple]:
    """vLLM's block hashes of tokens' full blocks, unhashed: hash_block_tokens(parent, block's
    ids, extra keys), the extra keys the adapter's (every block) and the salt (first block)."""
    keys, parent = [], None
    for i in range(len(tokens) // bs):
        extra = ((lora_id,) if lora_id else ()) + ((salt,) if i == 0 and salt else ())
        parent = (parent, tuple(tokens[i * bs:(i + 1) * bs]), extra or None)
        keys.append(parent)
    return keys


def expected_hits(tokens: list[int], bs: int, lora_id: int, salt: str | None,
                  cached: set) -> int:
    """vLLM's longest cache hit: leading blocks whose chained keys are cached, never the block of
    the last token (it must be computed)."""
    n = 0
    for key in vllm_block_keys(tokens, bs, lora_id, salt)[:(len(tokens) - 1) // bs]:
        if key not in cached:
            break
        n += 1
    return n


# -- the block manager against vLLM's chained keys ---------------------------------------------

BS = 2
OPS = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.lists(st.integers(0, 1), min_size=1, max_size=9),
              st.sampled_from(SALTS), st.sampled_from([0, 0, 1])),
    st.tuples(st.just("free"), st.integers(0, 50)),
    st.tuples(st.just("forget"), st.sampled_from([0, 1]))), max_size=40)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(ops=OPS)
def test_block_manager_hits_are_vllms_salted_chain(ops):
    """Sequences of random prompts (two ids: prefixes repeat), salts and adapters take blocks,
    free them and come back; an adapter's free blocks are forgotten now and then (forget_root,
    as an id re-bound to another adapter does). Each admission's hits must be exactly vLLM's
    longest hit over the blocks still cached, and each hit must hold what vLLM's key says: this
    sequence's prefix, under its own salt and adapter. The keys of the cached blocks are kept
    here, from what each sequence wrote, not read from the block manager."""
    bm = BlockManager(12, BS)
    content: dict[int, tuple] = {}  # block -> the vLLM key of what it holds, while registered
    adapter: dict[int, int] = {}  # block -> the adapter whose K/V it holds (0: the base model)
    live: list[Sequence] = []
    for k, op in enumerate(ops):
        if op[0] == "admit":
            _, tokens, salt, lora_id = op
            seq = Sequence(k, str(k), 0, tokens, SamplingParams(), 0,
                           lora=object() if lora_id else None,
                           lora_id=lora_id, cache_salt=salt)
            keys = vllm_block_keys(tokens, BS, lora_id, salt)
            hits = bm.match_prefix(seq)
            assert len(hits) == expected_hits(tokens, BS, lora_id, salt, set(content.values()))
            for i, b in enumerate(hits):
                assert content[b] == keys[i], f"block {i}: another prefix, salt or adapter's"
            if not bm.can_allocate(seq, len(tokens), hits):
                continue
            bm.allocate(seq, len(tokens), hits)
            for b in seq.block_table[len(hits):]:  # fresh: whatever they held is evicted
                content.pop(b, None)
                adapter[b] = lora_id
            seq.num_computed = len(tokens)
            bm.register_full_blocks(seq, len(tokens))
            bm.commit()
            for i, key in enumerate(keys):
                content[seq.block_table[i]] = key
            live.append(seq)
        elif op[0] == "free" and live:
            seq = live.pop(op[1] % len(live))
            bm.free_blocks(seq)
        elif op[0] == "forget":
            lora_id = op[1]
            bm.forget_root(-lora_id)
            held = {b for s in live for b in s.block_table}
            for b in [b for b in content if b not in held and adapter[b] == lora_id]:
                del content[b]
        bm.check(live)


# -- the engine: num_cached_tokens, and tokens as without the prefix cache ---------------------

EBS = 4
g = torch.Generator().manual_seed(78)
BASE = torch.randint(1, 101, (20,), generator=g).tolist()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(make_hf_model(seed=0, std=0.3),
                           tmp_path_factory.mktemp("salt") / "model")


@pytest.fixture(scope="module")
def lora(tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("salt_adapter") / "a1"
    write_adapter(path, tiny_dir, r=2, alpha=4, targets=["k_proj", "v_proj"], seed=1, std=0.5)
    return str(path)


def make_llm(path, **kw):
    kw.setdefault("num_kv_blocks", 96)
    return engine_helpers.make_llm(path, torch.device("cpu"), block_size=EBS,
                                   skip_tokenizer_init=True, enable_lora=True, max_loras=2,
                                   max_lora_rank=4, **kw)


@pytest.fixture(scope="module")
def uncached(tiny_dir):
    return make_llm(tiny_dir, enable_prefix_caching=False)


def prompt(ids, salt):
    return {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids,
                                                           "cache_salt": salt}


REQUESTS = st.lists(st.tuples(st.integers(5, 20), st.lists(st.integers(0, 100), max_size=3),
                              st.sampled_from(SALTS), st.booleans()), min_size=1, max_size=8)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(requests=REQUESTS)
def test_engine_hits_are_vllms_and_tokens_as_without_cache(tiny_dir, lora, uncached, requests):
    """Requests one after another on a fresh engine (a cache roomy enough that nothing is
    evicted): prefixes of one prompt plus a tail, salted or not, on the base model or an
    adapter. Each one's num_cached_tokens must be vLLM's (its longest hit over every earlier
    request's prompt blocks, under vLLM's salted keys), and its greedy tokens those of an engine
    without the prefix cache."""
    llm = make_llm(tiny_dir)
    adapter = LoRARequest("a1", 1, lora)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    cached: set = set()
    for length, tail, salt, on_adapter in requests:
        ids = BASE[:length] + tail
        lr = adapter if on_adapter else None
        out = llm.generate(prompt(ids, salt), sp, use_tqdm=False, lora_request=lr)[0]
        want = EBS * expected_hits(ids, EBS, 1 if on_adapter else 0, salt, cached)
        assert out.num_cached_tokens == want, (ids, salt, on_adapter)
        alone = uncached.generate({"prompt_token_ids": ids}, sp, use_tqdm=False,
                                  lora_request=lr)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        # max_tokens=1: only the prompt is computed, its full blocks cached
        cached.update(vllm_block_keys(ids, EBS, 1 if on_adapter else 0, salt))


def test_a_batch_of_salts_shares_only_within_each_salt(tiny_dir, uncached):
    """One generate call, the same prompt under two salts and none, n=2 each, with generated
    tokens: every completion's tokens are those of an engine without the prefix cache, and the
    next call's hits are each salt's own (those of the call before are all cached then)."""
    llm = make_llm(tiny_dir)
    ids = BASE[:18]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2)
    want = uncached.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
    first = llm.generate([prompt(ids, s) for s in SALTS], sp, use_tqdm=False)
    for out in first:
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]
    again = llm.generate([prompt(ids, s) for s in SALTS + ["c"]], sp, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [16, 16, 16, 0]
    for out in again:
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]


def test_an_adapter_id_taken_by_another_adapter_forgets_its_salted_blocks(tiny_dir, lora,
                                                                          uncached, tmp_path):
    """Adapter a1 under lora_int_id 1 caches a salted prompt; remove_lora(1) frees the id and
    adapter a2 takes it: a2's request of the same prompt and salt must read none of a1's K/V
    (forget_root must reach the salted blocks under the adapter's root too)."""
    other = tmp_path / "a2"
    write_adapter(other, tiny_dir, r=2, alpha=4, targets=["k_proj", "v_proj"], seed=2, std=0.5)
    llm = make_llm(tiny_dir)
    ids, sp = BASE[:17], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompt(ids, "s"), sp, use_tqdm=False, lora_request=LoRARequest("a1", 1, lora))
    assert llm.engine.remove_lora(1)
    second = LoRARequest("a2", 1, str(other))
    got = llm.generate(prompt(ids, "s"), sp, use_tqdm=False, lora_request=second)[0]
    assert got.num_cached_tokens == 0
    want = uncached.generate({"prompt_token_ids": ids}, sp, use_tqdm=False,
                             lora_request=LoRARequest("a2", 2, str(other)))[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_embedding_requests_are_salted_too(tiny_dir):
    """A pooling request's prompt dict takes cache_salt as a generation's does (the engine serves
    embeddings beside generations): its hits are its salt's only."""
    llm = make_llm(tiny_dir)
    eng, ids = llm.engine, BASE[:13]

    def embed(salt):
        rid = eng.add_pooling_requests([prompt(ids, salt)], [PoolingParams()])[0]
        while True:
            for o in eng.step():
                if o.request_id == rid and o.finished:
                    return o

    assert [embed(s).num_cached_tokens for s in ("a", "a", None, "b", None)] == [0, 12, 0, 0, 12]


BAD_SALTS = ["", 5, b"salt", ["a"], True]


@pytest.mark.parametrize("bad", BAD_SALTS, ids=repr)
def test_a_bad_salt_is_refused_before_anything_runs(tiny_dir, bad):
    """Not a non-empty string: refused (vLLM's words) before any request of the call is queued
    or any block taken; the engine serves the next call as before. None is no salt."""
    llm = make_llm(tiny_dir)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    before = llm.generate(prompt(BASE[:9], None), sp, use_tqdm=False)[0]
    eng, bm = llm.engine, llm.engine.block_manager
    registered, free, requests = bm.registered_blocks(), bm.num_free, dict(eng.requests)
    with pytest.raises((ValueError, TypeError), match="'cache_salt' must be a non-empty string"):
        llm.generate([prompt(BASE[:9], "ok"), prompt(BASE[:9], bad)], sp, use_tqdm=False)
    with pytest.raises((ValueError, TypeError), match="'cache_salt' must be a non-empty string"):
        eng.add_pooling_requests([prompt(BASE[:9], bad)], [PoolingParams()])
    assert not eng.has_unfinished_requests() and eng.requests == requests
    assert bm.registered_blocks() == registered and bm.num_free == free
    again = llm.generate({"prompt_token_ids": BASE[:9], "cache_salt": None}, sp, use_tqdm=False)
    assert again[0].outputs[0].token_ids == before.outputs[0].token_ids
    assert again[0].num_cached_tokens == 8  # None is unsalted: the first call's blocks


# -- the server's field ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = ensure_demo_model(str(tmp_path_factory.mktemp("salt_demo") / "model"))
    llm = engine_helpers.make_llm(path, torch.device("cpu"), max_model_len=512, block_size=4,
                                  num_kv_blocks=256)
    srv = OpenAIServer(llm, port=0, model_name="tiny", enable_prompt_tokens_details=True)
    with engine_helpers.serving(srv):
        yield srv


SERVED = [("/v1/completions", {"prompt": "The quick brown fox jumps over the lazy dog " * 3}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story "
                                                  "about a robot who learns to paint."}]})]


@pytest.mark.parametrize("path,body", SERVED, ids=["completions", "chat"])
def test_the_servers_cache_salt_field(server, path, body):
    """A completion or chat body's cache_salt: the same salt's second request finds the first's
    blocks (usage's cached_tokens), another salt and no salt find none of them; the text is the
    same whatever the salt (greedy). A bad salt is a 400 in vLLM's words; null is no salt."""
    body = {**body, "model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    path_salt = path.rsplit("/", 1)[-1]  # each test's salts its own: the server is shared
    answers = []
    for salt in ("s1", "s1", "s2", None, None):
        fields = {} if salt is None else {"cache_salt": f"{path_salt}-{salt}"}
        status, got = post(server, path, {**body, **fields})
        assert status == 200, got
        answers.append(got)
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[1] > 0 and cached[0] == cached[2] == cached[3] == 0
    assert cached[4] == cached[1]  # the unsalted second finds the unsalted first's only
    texts = {json.dumps(a["choices"][0].get("text", a["choices"][0].get("message")))
             for a in answers}
    assert len(texts) == 1
    for bad in ("", 5, ["x"]):
        status, got = post(server, path, {**body, "cache_salt": bad})
        assert status == 400, got
        assert "cache_salt" in got["error"]["message"]
    status, got = post(server, path, {**body, "cache_salt": None})
    assert status == 200 and got["usage"]["prompt_tokens_details"]["cached_tokens"] == cached[1]

