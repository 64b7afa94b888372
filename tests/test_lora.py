"""LoRA adapters (state/lora.py, functional/lora.py, runtime/lora.py) against an independent
oracle: transformers' Qwen3 with each adapter merged into its weights (W + scale * B @ A, fp32),
written here from the adapter's own tensors, never through minivllm's loader.

Adapters are PEFT directories written by hand (adapter_config.json and
adapter_model.safetensors with random A and B, B nonzero). Covered: logits of a batch mixing
adapters and base rows, rsLoRA's scale, "all-linear", a subset of targets, a rank below
max_lora_rank (padding); greedy tokens of the engine against the merged models, alone and mixed;
base rows against an engine without LoRA; LRU slots at max_loras=1 across calls and within one;
the prefix cache kept apart per adapter; the compiled forward's LoRA layer (against the eager
LoRA forward, without recompiles across mixes of adapters) and the decode graphs' static batch
with its LoRA slots (padded, against the unpadded LoRA batch; the runner's graph path with each
replay run eagerly; on a GPU, the captured graphs against the eager LoRA engine); the errors;
tensor parallelism (each rank's slice of the slots; a TP=2 engine on gloo against TP=1's);
the server's model selection, /v1/models and runtime load / unload; the CLI's flags;
LoRASlots' eviction invariant (hypothesis)."""

from __future__ import annotations

import copy
import functools
import json
import os
import threading
import time

import attrs
import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, strategies as st
from safetensors.torch import save_file

import minivllm
from minivllm import LLM, LoRARequest, SamplingParams
from minivllm.functional.model import forward
from minivllm.runtime.lora import LoRASlots
from minivllm.state.batch import SeqChunk, make_batch
from minivllm.state.lora import init_lora, load_adapter, write_slot

from engine_helpers import make_llm
from hf_tiny import hf_greedy, make_hf_model, save_checkpoint

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARENT = {m: "self_attn" if m in ALL[:4] else "mlp" for m in ALL}
MAX_RANK = 8
NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def module_dims(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each target module, from a config.json's fields."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_adapter(path, model_dir, *, r: int, alpha: float, targets, seed: int, std: float = 0.3,
                  rslora: bool = False, **extra) -> tuple[dict, float]:
    """A PEFT LoRA directory for the checkpoint at model_dir: random A [r, in] and B [out, r]
    for each layer's targeted modules. Returns ({(layer, module): (A, B)}, scale)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    modules = ALL if targets == "all-linear" else targets
    g = torch.Generator().manual_seed(seed)
    dims, weights, tensors = module_dims(cfg), {}, {}
    for n in range(cfg["num_hidden_layers"]):
        for m in modules:
            n_in, n_out = dims[m]
            a = torch.randn(r, n_in, generator=g) * std
            b = torch.randn(n_out, r, generator=g) * std
            weights[(n, m)] = (a, b)
            key = f"base_model.model.model.layers.{n}.{PARENT[m]}.{m}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = dict(peft_type="LORA", r=r, lora_alpha=alpha, target_modules=targets, bias="none",
                  use_rslora=rslora, lora_dropout=0.0, task_type="CAUSAL_LM",
                  modules_to_save=None, use_dora=False)
    config.update(extra)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return weights, (alpha / r ** 0.5 if rslora else alpha / r)


def merged(hf_model, weights: dict, scale: float):
    """The oracle: a copy of hf_model with W += scale * B @ A for every adapted module."""
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for (n, m), (a, b) in weights.items():
            getattr(getattr(model.model.layers[n], PARENT[m]), m).weight += scale * (b @ a)
    return model


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=0, std=0.3)


@pytest.fixture(scope="module")
def tiny_dir(hf_model, tmp_path_factory):
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("lora") / "model")


@pytest.fixture(scope="module")
def adapters(tiny_dir, hf_model, tmp_path_factory):
    """name -> (LoRARequest, merged oracle): all-linear at rank 4; an rsLoRA subset at the
    full max rank; a rank-2 subset (padded to max_lora_rank)."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {"all": dict(r=4, alpha=8, targets="all-linear", seed=1),
             "rs": dict(r=8, alpha=4, targets=["q_proj", "v_proj", "down_proj"], seed=2,
                        rslora=True),
             "low": dict(r=2, alpha=3, targets=["k_proj", "o_proj", "gate_proj", "up_proj"],
                         seed=3)}
    out = {}
    for k, (name, spec) in enumerate(specs.items(), start=1):
        path = str(root / name)
        weights, scale = write_adapter(path, tiny_dir, **spec)
        out[name] = (LoRARequest(name, k, path), merged(hf_model, weights, scale))
    return out


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 101, (n,), generator=g).tolist() for n in (5, 11, 19, 34)]


@pytest.fixture(scope="module")
def oracle(adapters, hf_model, prompts):
    """(adapter name or None, prompt index) -> transformers' greedy tokens, computed lazily."""
    cache = {}

    def tokens(name, i):
        if (name, i) not in cache:
            model = hf_model if name is None else adapters[name][1]
            cache[(name, i)] = hf_greedy(model, prompts[i], NEW)
        return cache[(name, i)]
    return tokens


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def run(llm, prompts, lora_request=None):
    return [o.outputs[0].token_ids for o in
            llm.generate(token_prompts(prompts), GREEDY, use_tqdm=False, lora_request=lora_request)]


def lora_llm(path, **kw):
    kw.setdefault("max_loras", 3)
    kw.setdefault("max_lora_rank", MAX_RANK)
    return make_llm(path, torch.device("cpu"), enable_lora=True, **kw)


# -- the pure functions --------------------------------------------------------------------------


def test_forward_logits_of_a_mixed_batch_equal_merged_transformers(tiny_dir, hf_model, adapters,
                                                                   prompts):
    """Every row's logits at every position, rows of three adapters and the base model in one
    batch, against transformers with each adapter merged; slots in another order than the
    adapters' ids."""
    params = minivllm.load(tiny_dir)
    lora = init_lora(params.config, max_loras=4, max_rank=MAX_RANK, dtype=params.dtype)
    names = {"all": 2, "rs": 0, "low": 3}  # slot 1 left empty
    for name, slot in names.items():
        write_slot(lora, slot, load_adapter(adapters[name][0].lora_path, params.config,
                                            MAX_RANK), params.config)
    with_lora = attrs.evolve(params, lora=lora)
    rows = [("all", 0), (None, 1), ("rs", 2), ("low", 3), (None, 0), ("rs", 0)]
    chunks, start = [], 0
    for _, i in rows:
        n = -(-len(prompts[i]) // 16)
        chunks.append(SeqChunk(prompts[i], 0, list(range(start, start + n))))
        start += n
    slots = [-1 if name is None else names[name] for name, _ in rows]
    batch = make_batch(chunks, block_size=16, every_row=True, lora_slots=slots)
    cache = minivllm.init_cache(with_lora, num_blocks=start, block_size=16)
    logits, _ = forward(with_lora, cache, batch)
    at = 0
    for name, i in rows:
        model = hf_model if name is None else adapters[name][1]
        with torch.no_grad():
            want = model(torch.tensor([prompts[i]])).logits[0]
        got = logits[at:at + len(prompts[i])]
        at += len(prompts[i])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if name is not None:  # the adapter changes the model: the check has teeth
            with torch.no_grad():
                assert (hf_model(torch.tensor([prompts[i]])).logits[0] - want).abs().max() > 0.1
    # The base rows equal the forward of params without LoRA.
    base = minivllm.init_cache(params, num_blocks=start, block_size=16)
    plain, _ = forward(params, base, make_batch(chunks, block_size=16, every_row=True))
    base_rows = torch.cat([torch.arange(sum(len(prompts[j]) for _, j in rows[:k]),
                                        sum(len(prompts[j]) for _, j in rows[:k + 1]))
                           for k, (name, _) in enumerate(rows) if name is None])
    torch.testing.assert_close(logits[base_rows], plain[base_rows], rtol=1e-5, atol=1e-5)


def test_without_lora_nothing_changes(tiny_dir):
    """A Batch without slots has no lora leaf; params without adapters have the leaves they
    had; a batch naming slots needs params with LoRA weights."""
    params = minivllm.load(tiny_dir)
    batch = make_batch([SeqChunk([1, 2, 3], 0, [0])], block_size=16)
    assert batch.lora_slots is None
    assert make_batch([SeqChunk([1, 2], 0, [0])], block_size=16, lora_slots=[-1]).lora_slots is None
    leaves = pytree.tree_leaves(params)
    assert len(leaves) == 3 + 8 * params.config.num_layers  # embed, norm, head + the layers
    llm = make_llm(tiny_dir, torch.device("cpu"))
    assert llm.engine.runner.params.lora is None and llm.engine.loras is None
    slotted = make_batch([SeqChunk([1, 2, 3], 0, [0])], block_size=16, lora_slots=[0])
    cache = minivllm.init_cache(params, num_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="params hold no LoRA"):
        forward(params, cache, slotted)


# -- the engine ----------------------------------------------------------------------------------


def test_engine_mixed_batch_equals_each_alone_and_merged_transformers(tiny_dir, adapters,
                                                                      prompts, oracle):
    """One generate call mixing three adapters and base rows (several adapters per step) gives
    each prompt transformers' merged greedy tokens; so does each run alone; the base rows are
    an engine without LoRA's."""
    llm = lora_llm(tiny_dir)
    plan = [("all", 0), (None, 1), ("rs", 2), ("low", 3), ("low", 0), (None, 2), ("all", 3),
            ("rs", 1)]
    requests = [None if name is None else adapters[name][0] for name, _ in plan]
    launched = []
    real = llm.engine.runner.launch

    def launch(step):
        launched.append(step.lora_slots)
        return real(step)
    llm.engine.runner.launch = launch
    mixed = run(llm, [prompts[i] for _, i in plan], requests)
    assert any(s is not None and len({x for x in s if x >= 0}) > 1 for s in launched), \
        "no step mixed adapters"
    assert any(s is not None and -1 in s for s in launched), "no step mixed base rows in"
    for (name, i), got in zip(plan, mixed):
        assert got == oracle(name, i), (name, i)
    for (name, i), req in zip(plan, requests):
        assert run(llm, [prompts[i]], req) == [oracle(name, i)]
    plain = make_llm(tiny_dir, torch.device("cpu"))
    base = [(k, i) for k, (name, i) in enumerate(plan) if name is None]
    assert [mixed[k] for k, _ in base] == run(plain, [prompts[i] for _, i in base])
    # The adapters change the outputs (else the comparisons above would prove little).
    assert any(oracle(name, i) != oracle(None, i) for name, i in plan if name is not None)


def test_chat_and_stream_take_a_lora_request(tiny_dir, adapters, prompts, oracle):
    llm = lora_llm(tiny_dir, max_loras=1)
    req = adapters["rs"][0]
    streamed: list[int] = []
    for delta in llm.stream(token_prompts(prompts[2:3]), GREEDY, lora_request=req):
        streamed += delta.outputs[0].token_ids
    assert streamed == oracle("rs", 2)
    # chat's plumbing: no tokenizer here, so chat refuses before its lora_request matters; the
    # keyword is accepted.
    with pytest.raises(ValueError, match="tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, lora_request=req)


def test_beam_search_runs_each_prompts_beams_under_its_adapter(tiny_dir, hf_model, adapters,
                                                               prompts):
    """vLLM's LLM.beam_search(prompts, params, lora_request): each prompt's search equals one
    written here (test_beam_search's) over transformers with that prompt's adapter merged; one
    LoRARequest for every prompt too. Until session 75 beam_search took no lora_request."""
    from minivllm import BeamSearchParams
    from test_beam_search import reference_beam_search

    def reference(model, prompt):
        @functools.lru_cache(maxsize=None)
        def next_logprobs(tokens):
            with torch.no_grad():
                return torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1)
        # length penalty 0 and EOS ignored: a beam's score is its summed logprob, whatever EOS
        return reference_beam_search(next_logprobs, prompt, width=2, max_tokens=4, eos=-1,
                                     length_penalty=0.0, ignore_eos=True)

    llm = lora_llm(tiny_dir, max_loras=2)
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True, length_penalty=0.0)
    names = ["all", None, "low"]
    chosen = prompts[:3]
    outs = llm.beam_search(token_prompts(chosen), params,
                           [None if n is None else adapters[n][0] for n in names])
    for out, prompt, name in zip(outs, chosen, names, strict=True):
        want = reference(hf_model if name is None else adapters[name][1], prompt)
        assert [b.tokens for b in out.sequences] == [t for t, _ in want]
        assert [b.cum_logprob for b in out.sequences] == \
            pytest.approx([c for _, c in want], abs=1e-4)
    # the adapters change the search here, so a search run on the base model would fail above
    assert reference(hf_model, chosen[0]) != reference(adapters["all"][1], chosen[0])
    one = llm.beam_search(token_prompts(chosen[2:]), params, adapters["rs"][0])
    assert [b.tokens for b in one[0].sequences] == \
        [t for t, _ in reference(adapters["rs"][1], chosen[2])]
    with pytest.raises(ValueError, match="lora"):
        llm.beam_search(token_prompts(chosen), params, [adapters["rs"][0]])
    assert not llm.engine.requests


def test_lru_slots_with_max_loras_1(tiny_dir, adapters, prompts, oracle):
    """One slot, two adapters alternating across calls and mixed in one call: each call's
    outputs are the merged oracle's; the slot is rewritten only when another adapter needs it,
    and a running adapter's sequences finish before another's start."""
    llm = lora_llm(tiny_dir, max_loras=1)
    runner = llm.engine.runner
    loads = []
    real_set, real_launch = runner.set_lora, runner.launch

    def set_lora(slot, adapter):
        loads.append((slot, adapter.path))
        real_set(slot, adapter)

    def launch(step):
        if step.lora_slots is not None:
            assert set(step.lora_slots) <= {-1, 0}
        return real_launch(step)
    runner.set_lora, runner.launch = set_lora, launch
    a, b = adapters["all"][0], adapters["low"][0]
    assert run(llm, prompts[:2], a) == [oracle("all", 0), oracle("all", 1)]
    assert run(llm, prompts[:1], b) == [oracle("low", 0)]
    assert run(llm, prompts[1:2], a) == [oracle("all", 1)]
    assert run(llm, prompts[1:2], a) == [oracle("all", 1)]  # in its slot already: no load
    assert [p for _, p in loads] == [a.lora_path, b.lora_path, a.lora_path]
    mixed = run(llm, prompts[:4], [b, a, None, b])
    assert mixed == [oracle("low", 0), oracle("all", 1), oracle(None, 2), oracle("low", 3)]
    # b's sequences (first in the queue) run first, a's once they are done: one load each.
    assert [p for _, p in loads[3:]] == [b.lora_path, a.lora_path]
    assert all(slot == 0 for slot, _ in loads)
    assert dict(llm.engine.loras.slot_of) == {a.lora_int_id: 0}


def test_metrics_name_the_running_and_waiting_adapters(tiny_dir, adapters, prompts):
    """/metrics' vllm:lora_requests_info (vLLM's labels: max_lora and the running and waiting
    sequences' adapter names, each once, in the scheduler's order; the value the scrape's Unix
    time): with one slot, the first adapter's sequences and the base one run while the other
    adapter's wait; none once all are done. An engine without LoRA has no such family."""
    from minivllm.runtime import metrics as prom
    from test_metrics import parse

    llm = lora_llm(tiny_dir, max_loras=1)
    a, b = adapters["all"][0], adapters["low"][0]
    engine = llm.engine
    engine.add_requests(token_prompts(prompts), [GREEDY] * 4, lora_requests=[b, a, None, b])

    def info():
        before = time.time()
        samples = parse(prom.render(prom.snapshot(engine), "m"))["vllm:lora_requests_info"][
            "samples"]
        assert len(samples) == 1
        name, labels, when = samples[0]
        assert before <= when <= time.time()
        return labels
    assert info() == {"max_lora": "1", "waiting_lora_adapters": "low,all",
                      "running_lora_adapters": ""}
    engine.step()
    assert info() == {"max_lora": "1", "waiting_lora_adapters": "all",
                      "running_lora_adapters": "low"}
    while engine.has_unfinished_requests():
        engine.step()
    assert info() == {"max_lora": "1", "waiting_lora_adapters": "", "running_lora_adapters": ""}
    base = make_llm(tiny_dir, torch.device("cpu"))
    assert "vllm:lora_requests_info" not in parse(prom.render(prom.snapshot(base.engine), "m"))


def test_prefix_cache_is_kept_apart_per_adapter(tiny_dir, adapters, prompts, oracle):
    """The same prompt (two full blocks and more) under the base model, then an adapter: the
    adapter's request takes no block of the base model's (its K/V differs) and gives the merged
    oracle's tokens; a second request of that adapter hits its own blocks."""
    llm = lora_llm(tiny_dir, max_loras=2)
    prompt = prompts[3]  # 34 tokens: two full blocks of 16
    req = adapters["all"][0]
    first = llm.generate(token_prompts([prompt]), GREEDY, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == oracle(None, 3)
    again = llm.generate(token_prompts([prompt]), GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32  # the base model's cache works
    out = llm.generate(token_prompts([prompt]), GREEDY, use_tqdm=False, lora_request=req)[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == oracle("all", 3)
    out = llm.generate(token_prompts([prompt]), GREEDY, use_tqdm=False, lora_request=req)[0]
    assert out.num_cached_tokens == 32 and out.outputs[0].token_ids == oracle("all", 3)
    other = adapters["rs"][0]
    out = llm.generate(token_prompts([prompt]), GREEDY, use_tqdm=False, lora_request=other)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == oracle("rs", 3)


def test_block_manager_roots_prefixes_by_adapter():
    from minivllm.runtime.block_manager import BlockManager
    from minivllm.runtime.sequence import Sequence

    bm = BlockManager(16, 4)
    ids = list(range(10))
    seqs = [Sequence(k, str(k), 0, ids, GREEDY, 0, lora=lora, lora_id=lid)
            for k, (lora, lid) in enumerate([(None, 0), (object(), 1), (object(), 2),
                                             (object(), 1)])]
    for seq in seqs[:3]:
        bm.allocate(seq, 10, bm.match_prefix(seq))
        bm.register_full_blocks(seq, 10)
    bm.commit()
    assert len(bm.match_prefix(seqs[3])) == 2  # adapter 1's blocks, only
    assert set(bm.match_prefix(seqs[3])) == set(seqs[1].block_table[:2])
    bm.check(seqs[:3])


# -- the compiled forward and the decode graphs --------------------------------------------------

SLOTS = {"all": 2, "rs": 0, "low": 3}  # slot 1 left empty


def lora_params(tiny_dir, adapters, max_loras: int = 4):
    """(params without LoRA, the same with slot weights holding the adapters at SLOTS)."""
    params = minivllm.load(tiny_dir)
    lora = init_lora(params.config, max_loras=max_loras, max_rank=MAX_RANK, dtype=params.dtype)
    for name, slot in SLOTS.items():
        write_slot(lora, slot, load_adapter(adapters[name][0].lora_path, params.config,
                                            MAX_RANK), params.config)
    return params, attrs.evolve(params, lora=lora)


def slot_of(name):
    return -1 if name is None else SLOTS[name]


def test_compiled_forward_runs_lora_steps_without_recompiling(tiny_dir, adapters, prompts):
    """compiled_forward (the engine's, as runtime/compiled.py binds it) on prefill, mixed and
    decode steps mixing adapters and base rows: the eager LoRA forward's logits (validated
    against transformers above), through the compiled LoRA layer. A second round of the same
    shapes with the rows' adapters moved about compiles nothing more (the slots are values; the
    mask's shape follows T and max_loras); a step without LoRA rows runs the compiled base
    layer, never the LoRA one, and gives the base params' logits bit for bit."""

    from torch._dynamo.testing import CompileCounterWithBackend
    from minivllm.runtime.compiled import compiled_forward

    torch._dynamo.reset()
    base, params = lora_params(tiny_dir, adapters)
    counter = CompileCounterWithBackend("aot_eager")
    fn = compiled_forward(counter)
    lora_calls = []
    inner = fn.keywords["lora_layer"]
    fn = functools.partial(fn, lora_layer=lambda *a, **k: lora_calls.append(1) or inner(*a, **k))
    p = prompts
    steps = [  # chunks, then two rounds of each chunk's adapter
        ([SeqChunk(p[0], 0, [0]), SeqChunk(p[1], 0, [1]), SeqChunk(p[2], 0, [2, 3])],
         ["all", None, "rs"], ["low", "all", None]),
        ([SeqChunk([7], len(p[0]), [0]), SeqChunk(p[3], 0, [4, 5, 6])],
         ["low", "all"], [None, "rs"]),
        ([SeqChunk([3], 5, [0]), SeqChunk([4], 11, [1]), SeqChunk([9], 19, [2, 3])],
         [None, "rs", "rs"], ["all", "low", None]),
    ]

    def logits(f, prm, chunks, names):
        slots = None if names is None else [slot_of(n) for n in names]
        cache = minivllm.init_cache(prm, num_blocks=8, block_size=16)
        return f(prm, cache, make_batch(chunks, block_size=16, lora_slots=slots))[0]

    compiles = []
    for round_ in (1, 2):
        for chunks, *rounds in steps:
            names = rounds[round_ - 1]
            torch.testing.assert_close(logits(fn, params, chunks, names),
                                       logits(forward, params, chunks, names),
                                       rtol=1e-5, atol=1e-5)
        compiles.append(counter.frame_count)
    assert len(lora_calls) == 2 * len(steps) * params.config.num_layers
    assert compiles[1] == compiles[0], compiles  # new mixes of adapters: no recompile
    # Stem, LoRA layer and head: each static at its first step, then dynamic in the step's
    # sizes; the layer once more for decode steps (is_decode is read off the shapes): at most
    # three each, far under the recompile limit.
    assert compiles[0] <= 9, compiles
    chunks = steps[0][0]
    got = logits(fn, params, chunks, None)
    assert len(lora_calls) == 2 * len(steps) * params.config.num_layers  # the base layer ran
    assert torch.equal(got, logits(fn, base, chunks, None))


def test_padded_lora_decode_equals_unpadded(tiny_dir, adapters, prompts):
    """The decode graphs' static batch with its LoRA slots (DecodeGraphs.fill, batch_view),
    padded to a bucket, run eagerly and through the compiled forward: each real row gets the
    unpadded LoRA batch's logits, adapters, base rows and padding mixed; padding rows run as
    the base model (slot -1) and write no cache; one set of buffers serves any mix of adapters,
    a step without any included, whose rows get the base layer's logits bit for bit."""
    from minivllm.runtime.compiled import compiled_forward
    from minivllm.runtime.graphs import DecodeGraphs
    from minivllm.state.batch import DecodeChunks

    torch._dynamo.reset()
    _, params = lora_params(tiny_dir, adapters)
    compiled = compiled_forward("aot_eager")
    plan = ["all", None, "rs", "low", "low", None, "all"]  # 7 rows: the bucket of 8
    tables = [[3 * k, 3 * k + 1, 3 * k + 2] for k in range(len(plan))]
    p = [prompts[k % 4] for k in range(len(plan))]
    caches = [minivllm.init_cache(params, num_blocks=24, block_size=16) for _ in range(3)]
    prefill = make_batch([SeqChunk(x, 0, t) for x, t in zip(p, tables)], block_size=16,
                         lora_slots=[slot_of(n) for n in plan])
    for i in range(3):
        first, caches[i] = forward(params, caches[i], prefill)
    graphs = DecodeGraphs(params, caches[1], None, max_num_seqs=8, max_blocks_per_seq=3,
                          compile_forward=False)
    before = [t.clone() for t in pytree.tree_leaves(caches[1])]
    tokens = first.argmax(-1).tolist()
    mixes = [plan, [None] * 5, ["rs", "low", None, "all", None, "all", "rs"]]
    for k, names in enumerate(mixes):
        n = len(names)
        chunks = DecodeChunks(tokens[:n], [len(x) + k for x in p[:n]], tables[:n])
        slots = [slot_of(x) for x in names]
        step_slots = None if all(s < 0 for s in slots) else tuple(slots)
        want, caches[0] = forward(params, caches[0], make_batch(chunks, block_size=16,
                                                                lora_slots=step_slots))
        bs = graphs.fill(chunks, lora_slots=step_slots)
        view = graphs.batch_view(bs)
        assert bs == 8 and view.lora_slots.tolist() == slots + [-1] * (bs - n)
        if step_slots is None:  # the same rows through the base layer: the same bits
            plain = pytree.tree_map(torch.clone, caches[1])
            base, _ = forward(params, plain, attrs.evolve(view, lora_slots=None))
        got, _ = forward(params, caches[1], view)
        torch.testing.assert_close(got[:n], want, rtol=1e-5, atol=1e-5)
        again, _ = compiled(params, caches[2], view)
        torch.testing.assert_close(again[:n], want, rtol=1e-5, atol=1e-5)
        if step_slots is None:
            assert torch.equal(got, base)
        tokens = got[:n].argmax(-1).tolist() + tokens[n:]
    for cache in caches[1:]:  # only the real rows were written
        for a, b in zip(pytree.tree_leaves(caches[0]), pytree.tree_leaves(cache)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert any((a != b).any() for a, b in zip(pytree.tree_leaves(caches[1]), before))


def test_engine_decode_graph_path_with_lora(tiny_dir, adapters, prompts, oracle):
    """The runner's decode-graph path of a LoRA engine: a step with adapter rows fills each
    row's slot into the LoRA graphs' static buffer with the rest, a step of base rows only the
    base graphs' (no slots: the forward without LoRA), each "replay" run as the eager forward
    over the static buffers so that it runs on the CPU. Every prompt gets transformers' merged
    greedy tokens, adapters and base rows mixed in each replayed LoRA bucket, with padding; the
    base rows' last steps, after the adapters' rows ended, replay the base graphs."""
    from minivllm.runtime.graphs import DecodeGraphs

    llm = lora_llm(tiny_dir, max_num_seqs=8)
    runner = llm.engine.runner
    replayed = {True: [], False: []}

    def decode_graphs(adapters):
        graphs = DecodeGraphs(runner.params, runner.cache, runner.backend, max_num_seqs=8,
                              max_blocks_per_seq=-(-llm.config.max_model_len //
                                                   llm.config.block_size),
                              compile_forward=False, adapters=adapters)

        def replay(b):
            bs = graphs.bucket(b)
            view = graphs.batch_view(bs)
            slots = None if view.lora_slots is None else view.lora_slots.tolist()
            replayed[adapters].append((b, bs, slots))
            logits, _ = forward(graphs.params, graphs.cache, view, graphs.backend)
            return logits[:b]
        graphs.replay = replay
        return graphs
    runner.graphs, runner.lora_graphs = decode_graphs(False), decode_graphs(True)
    plan = [("all", 0), (None, 1), ("rs", 2), ("low", 3), ("low", 1), (None, 2), ("all", 3)]
    short = 3  # the adapters' requests end first: the base rows' steps after them
    params = [SamplingParams(temperature=0.0, max_tokens=NEW if name is None else short,
                             ignore_eos=True) for name, _ in plan]
    got = [o.outputs[0].token_ids for o in llm.generate(
        token_prompts([prompts[i] for _, i in plan]), params, use_tqdm=False,
        lora_request=[None if name is None else adapters[name][0] for name, _ in plan])]
    assert got == [oracle(name, i)[:NEW if name is None else short] for name, i in plan]
    with_slots, base = replayed[True], replayed[False]
    assert any(b < bs for b, bs, _ in with_slots) and len(with_slots) >= short - 1
    assert all(slots[b:] == [-1] * (bs - b) for b, bs, slots in with_slots)  # padding: base
    mixed = [s[:b] for b, _, s in with_slots if -1 in s[:b]]
    assert any(len({x for x in s if x >= 0}) > 1 for s in mixed), "no replay mixed adapters"
    assert all(any(x >= 0 for x in s[:b]) for b, _, s in with_slots)
    assert len(base) >= NEW - short and all(slots is None and b == 2 for b, _, slots in base)


def test_engine_prefill_graph_path_with_lora(tiny_dir, adapters, prompts, oracle):
    """The runner's prefill-graph path of a LoRA engine: a step with prompt tokens and adapter
    rows fills each token's slot into a prefill graph with slots, a step without them the
    base model's graph, each "replay" run as the eager forward over the graph's padded
    buffers (the CPU has no graphs). Every prompt gets transformers' merged greedy tokens."""
    from minivllm.runtime.prefill_graph import PrefillGraph

    llm = lora_llm(tiny_dir, max_num_seqs=4, max_num_batched_tokens=64)
    runner = llm.engine.runner
    replays = []

    def stand_in(tokens, adapters):
        graph = PrefillGraph(runner.params, runner.cache, runner.backend, runner.prefill_forward,
                             num_tokens=tokens, max_num_seqs=4, adapters=adapters,
                             max_blocks_per_seq=-(-llm.config.max_model_len //
                                                  llm.config.block_size),
                             block_size=llm.config.block_size)

        def replay(n):  # what the captured graph would run
            slots = graph.batch.lora_slots
            replays.append((adapters, tokens, None if slots is None else slots.tolist()))
            logits, runner.cache = forward(runner.params, runner.cache, graph.batch,
                                           runner.backend)
            return logits[:n]
        graph.replay = replay
        return graph
    runner.prefill_graphs = [stand_in(64, False), stand_in(32, False)]  # largest first
    runner.lora_prefill_graphs = [stand_in(64, True), stand_in(32, True)]
    base = [(None, 3), (None, 2)]
    mixed = [("all", 3), (None, 1), ("rs", 2), ("low", 0), (None, 0), ("low", 1)]
    for plan in (base, mixed):
        got = run(llm, [prompts[i] for _, i in plan],
                  [None if name is None else adapters[name][0] for name, _ in plan])
        assert got == [oracle(name, i) for name, i in plan]
        if plan is base:
            assert replays and all(not a and s is None for a, _, s in replays), replays
            seen = len(replays)
    assert replays[seen:] and all(a for a, _, _ in replays[seen:]), replays
    slots = [s for _, _, s in replays[seen:]]
    assert any(len({x for x in s if x >= 0}) > 1 and -1 in s for s in slots), slots


def test_ngram_speculation_in_a_lora_engine_gives_each_adapters_tokens(tiny_dir, adapters,
                                                                       prompts, oracle):
    """n-gram speculative decoding in a LoRA engine: each verification step's chunks carry
    their rows' slots (a drafted chunk's k + 1 tokens all its adapter's), so greedy outputs are
    transformers' merged tokens, adapters and base rows mixed, with drafts proposed and some
    accepted."""
    llm = lora_llm(tiny_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                 "prompt_lookup_max": 2,
                                                 "prompt_lookup_min": 1})
    plan = [("all", 3), (None, 2), ("rs", 3), ("low", 1), (None, 3)]
    got = run(llm, [prompts[i] for _, i in plan],
              [None if name is None else adapters[name][0] for name, _ in plan])
    assert got == [oracle(name, i) for name, i in plan]
    assert llm.stats.spec_draft_tokens > 0 and llm.stats.spec_accepted_tokens > 0, llm.stats


def test_warm_up_compiles_the_lora_layer_too(tiny_dir, adapters):
    """With LoRA slot weights, the warm-up runs each of its steps with the rows in a slot as
    well, so that a compiled forward's LoRA layer compiles its variants at start-up."""
    from minivllm.kernels import select_backend
    from minivllm.runtime.warmup import warm_up_kernels

    _, params = lora_params(tiny_dir, adapters)
    seen = []

    def forward_fn(prm, cache, batch, backend):
        seen.append((batch.num_tokens, batch.num_seqs, batch.lora_slots is not None))
        return None, cache

    warm_up_kernels(params, select_backend("cpu", "reference"), block_size=16, max_num_seqs=2,
                    forward_fn=forward_fn, cuda_only=False)
    plain = [s[:2] for s in seen if not s[2]]
    assert plain and sorted(plain) == sorted(s[:2] for s in seen if s[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_graphs_with_lora_equal_eager_lora_engine(tiny_dir, adapters, prompts, oracle, dtype):
    """On a GPU: a LoRA engine with its decode CUDA graphs (captured through the LoRA layer,
    and the base model's for steps without adapter rows) and compiled forward gives the eager
    LoRA engine's greedy tokens, adapters and base rows mixed; in fp32 transformers' merged
    ones too, and its base rows a base engine's with graphs. bf16: the compiled and eager paths
    round differently (see tests/test_gpu_graphs.py), so there every prompt's first tokens must
    agree and most prompts throughout. Base prompts alone replay the base decode and prefill
    graphs only, and give a base engine's tokens bit for bit (the same kernels); prompt steps
    with adapter rows replay the prefill graphs with slots."""
    plan = [("all", 0), (None, 1), ("rs", 2), ("low", 3), ("low", 1), (None, 2), ("all", 3),
            ("rs", 0), (None, 3)]
    requests = [None if name is None else adapters[name][0] for name, _ in plan]
    ids = [prompts[i] for _, i in plan]
    cuda = torch.device("cuda")
    kw = dict(dtype=dtype, enable_lora=True, max_loras=3, max_lora_rank=MAX_RANK)
    eager = make_llm(tiny_dir, cuda, **kw)  # eager at 16 sequences
    fast = make_llm(tiny_dir, cuda, graphs=True, **kw)  # buckets of 2 and 4 rows
    runner = fast.engine.runner
    assert runner.lora_graphs.lora and not runner.graphs.lora and runner.prefill_graphs
    assert runner.prefill_forward is runner.graphs.fn is runner.lora_graphs.fn is not forward
    replays = {}
    assert len(runner.lora_prefill_graphs) == len(runner.prefill_graphs)
    for graphs in (runner.graphs, runner.lora_graphs, *runner.prefill_graphs,
                   *runner.lora_prefill_graphs):
        replays[graphs], inner = [], graphs.replay
        graphs.replay = lambda b, seen=replays[graphs], inner=inner: seen.append(b) or inner(b)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=5)

    def outputs(llm):
        return [o.outputs[0] for o in llm.generate(token_prompts(ids), params, use_tqdm=False,
                                                   lora_request=requests)]
    # First, before the prefix cache holds them: the base prompts alone.
    plain = make_llm(tiny_dir, cuda, graphs=True, dtype=dtype)
    base = [ids[k] for k, (name, _) in enumerate(plan) if name is None]
    assert run(fast, base) == run(plain, base)
    assert not replays[runner.lora_graphs] and len(replays[runner.graphs]) >= NEW - 1
    assert sum(len(replays[g]) for g in runner.prefill_graphs) > 0
    assert not any(replays[g] for g in runner.lora_prefill_graphs)
    want, got = outputs(eager), outputs(fast)
    assert len(replays[runner.lora_graphs]) >= NEW - 1
    # The first step's four prompts (69 tokens, the prefix cache holding none of them whole)
    # fill at least half of the 128-token graph.
    assert sum(len(replays[g]) for g in runner.lora_prefill_graphs) > 0
    if dtype == "float32":
        tokens = [c.token_ids for c in got]
        assert tokens == [c.token_ids for c in want] == [oracle(name, i) for name, i in plan]
        assert [t for t, (name, _) in zip(tokens, plan) if name is None] == run(plain, base)
        return
    for a, b in zip(got, want):  # where they part, the fast path's pick was a near-tie
        k = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if k is not None:
            best = max(lp.logprob for lp in b.logprobs[k].values())
            assert a.token_ids[k] in b.logprobs[k] and \
                best - b.logprobs[k][a.token_ids[k]].logprob < 0.5, k
    assert sum(a.token_ids == b.token_ids for a, b in zip(got, want)) > len(plan) // 2


# -- errors --------------------------------------------------------------------------------------


def _bad(tmp_path, tiny_dir, name, **spec):
    path = str(tmp_path / name)
    write_adapter(path, tiny_dir, **{**dict(r=2, alpha=2, targets=["q_proj"], seed=5), **spec})
    return path


def test_errors_before_any_work(tiny_dir, adapters, prompts, tmp_path, oracle):
    llm = lora_llm(tiny_dir, max_loras=1, max_lora_rank=4)
    good = adapters["all"][0]
    too_big = adapters["rs"][0]  # rank 8 > 4
    cases = [
        (too_big, "rank 8 exceeds max_lora_rank=4"),
        (LoRARequest("nope", 7, str(tmp_path / "missing")), "no such directory"),
    ]
    no_weights = _bad(tmp_path, tiny_dir, "noweights")
    os.remove(os.path.join(no_weights, "adapter_model.safetensors"))
    cases.append((LoRARequest("nw", 8, no_weights), "no adapter_model.safetensors"))
    for k, (name, extra, match) in enumerate([
            ("dora", dict(use_dora=True), "DoRA"),
            ("save", dict(modules_to_save=["lm_head"]), "modules_to_save"),
            ("bias", dict(bias="all"), "bias"),
    ]):
        cases.append((LoRARequest(name, 20 + k, _bad(tmp_path, tiny_dir, name, **extra)), match))
    bad_target = _bad(tmp_path, tiny_dir, "target")
    with open(os.path.join(bad_target, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg["target_modules"] = ["q_proj", "embed_tokens"]
    with open(os.path.join(bad_target, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    cases.append((LoRARequest("target", 30, bad_target), r"\['embed_tokens'\] are not supported"))
    unlisted = _bad(tmp_path, tiny_dir, "unlisted", targets=["q_proj", "o_proj"])
    with open(os.path.join(unlisted, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg["target_modules"] = ["q_proj"]
    with open(os.path.join(unlisted, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    cases.append((LoRARequest("unlisted", 31, unlisted), "o_proj is not in target_modules"))
    wrong_r = _bad(tmp_path, tiny_dir, "wrong_r")
    with open(os.path.join(wrong_r, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg["r"] = 3
    with open(os.path.join(wrong_r, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    cases.append((LoRARequest("wrong_r", 32, wrong_r), r"has shape \(2, 64\), expected \(3, 64\)"))
    head = _bad(tmp_path, tiny_dir, "head")
    save_file({"base_model.model.lm_head.lora_A.weight": torch.ones(2, 64),
               "base_model.model.lm_head.lora_B.weight": torch.ones(101, 2)},
              os.path.join(head, "adapter_model.safetensors"))
    cases.append((LoRARequest("head", 33, head), "not a LoRA A/B weight of a decoder layer"))
    for req, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate(token_prompts(prompts[:2]), GREEDY, use_tqdm=False,
                         lora_request=[good, req])
        assert not llm.engine.requests and not llm.engine.scheduler.has_unfinished()
    # Nothing was run or loaded for the good request of a refused call; the engine still serves.
    assert not llm.engine.loras.slot_of
    assert run(llm, prompts[:1], good) == [oracle("all", 0)]
    with pytest.raises(ValueError, match="lora requests"):
        llm.generate(token_prompts(prompts[:2]), GREEDY, lora_request=[good])
    # One id, one adapter.
    with pytest.raises(ValueError, match="one id per adapter"):
        llm.generate(token_prompts(prompts[:1]), GREEDY,
                     lora_request=LoRARequest("x", good.lora_int_id, adapters["low"][0].lora_path))


def test_an_id_keeps_its_adapter_after_the_read_cache_forgets_it(tiny_dir, adapters, prompts,
                                                                  oracle):
    """The engine keeps at most max(2 * max_loras, 8) adapters read; one pushed out of there
    still holds its slot and its prefix-cache blocks, so the same lora_int_id with another
    path is still refused ("one id per adapter"), never run with the first adapter's weights."""
    llm = lora_llm(tiny_dir, max_loras=1)
    good, other = adapters["all"][0], adapters["low"][0]
    assert run(llm, prompts[3:4], good) == [oracle("all", 3)]
    for k in range(10):  # push `good` out of the engine's read adapters
        llm.engine.add_lora(LoRARequest(f"x{k}", 100 + k, other.lora_path))
    with pytest.raises(ValueError, match="one id per adapter"):
        run(llm, prompts[3:4], LoRARequest("x", good.lora_int_id, other.lora_path))
    assert not llm.engine.requests
    assert run(llm, prompts[3:4], good) == [oracle("all", 3)]


def test_an_id_removed_then_given_another_adapter_runs_the_new_one(tiny_dir, adapters, prompts,
                                                                   oracle):
    """remove_lora(id) forgets the adapter: the id may then name another one (as vLLM), whose
    requests run its own weights and take none of the first adapter's prefix-cache blocks."""
    llm = lora_llm(tiny_dir, max_loras=2)
    good, other = adapters["all"][0], adapters["low"][0]
    assert run(llm, prompts[3:4], good) == [oracle("all", 3)]  # 34 tokens: two cached blocks
    assert llm.engine.remove_lora(good.lora_int_id)
    again = LoRARequest("again", good.lora_int_id, other.lora_path)
    out = llm.generate(token_prompts(prompts[3:4]), GREEDY, use_tqdm=False, lora_request=again)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == oracle("low", 3)
    assert run(llm, prompts[3:4], again) == [oracle("low", 3)]
    # Removed while its requests run: the id names no other adapter until they finish.
    engine = llm.engine
    engine.add_requests(token_prompts(prompts[:1]), [GREEDY], lora_requests=[again])
    engine.step()
    assert engine.remove_lora(again.lora_int_id)
    with pytest.raises(ValueError, match="still run"):
        engine.add_requests(token_prompts(prompts[:1]), [GREEDY], lora_requests=[good])
    while engine.scheduler.has_unfinished():
        engine.step()
    assert run(llm, prompts[3:4], good) == [oracle("all", 3)]


# -- tensor parallelism ----------------------------------------------------------------------------


def test_sharded_slots_hold_each_ranks_slice_of_the_whole_slots(tiny_dir, adapters):
    """write_slot on a rank of two writes the rows of the fused B that the rank's q / k / v
    heads and gate / up rows are, and the columns of o's and down's A of its heads and
    intermediate rows (as state/load.py cuts the base weights); the other weight whole."""
    from minivllm.state.shard import ShardSpec

    config = minivllm.load(tiny_dir).config
    d, nq, nkv = config.head_dim, config.num_heads, config.num_kv_heads
    i = config.intermediate_size

    def slots(shard):
        lora = init_lora(config, max_loras=2, max_rank=MAX_RANK, dtype=torch.float32, shard=shard)
        for slot, name in enumerate(("all", "rs")):
            write_slot(lora, slot, load_adapter(adapters[name][0].lora_path, config, MAX_RANK),
                       config, shard)
        return lora.layers[1]

    whole = slots(ShardSpec())
    for rank in range(2):
        got = slots(ShardSpec(rank=rank, world_size=2))
        q = torch.arange(rank * nq // 2 * d, (rank + 1) * nq // 2 * d)
        kv = torch.arange(rank * nkv // 2 * d, (rank + 1) * nkv // 2 * d)
        qkv_rows = torch.cat([q, nq * d + kv, (nq + nkv) * d + kv])
        inter = torch.arange(rank * i // 2, (rank + 1) * i // 2)
        assert torch.equal(got.qkv_a, whole.qkv_a)
        assert torch.equal(got.qkv_b, whole.qkv_b[qkv_rows])
        assert torch.equal(got.gate_up_a, whole.gate_up_a)
        assert torch.equal(got.gate_up_b, whole.gate_up_b[torch.cat([inter, i + inter])])
        assert torch.equal(got.o_a, whole.o_a[:, q]) and torch.equal(got.o_b, whole.o_b)
        assert torch.equal(got.down_a, whole.down_a[:, inter])
        assert torch.equal(got.down_b, whole.down_b)
        assert got.qkv_b.abs().sum() > 0 and got.o_a.abs().sum() > 0  # the slices hold weights


def test_tp2_lora_engine_equals_tp1(tiny_dir, adapters, prompts, oracle):
    """LLM(tensor_parallel_size=2, enable_lora=True) on CPU (gloo, a spawned worker): a mixed
    batch of three adapters (all-linear; k / o / gate / up; q / v / down: deltas on the
    column-parallel qkv and gate_up and on the row-parallel o_proj and down) and base rows gives
    transformers' merged greedy tokens and the TP=1 LoRA engine's fp32 logprobs. max_loras=2 <
    three adapters: slots are rewritten between steps, on both ranks."""
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2)
    plan = [("all", 0), (None, 1), ("low", 2), ("rs", 3), (None, 0), ("all", 2), ("low", 1)]
    requests = [None if name is None else adapters[name][0] for name, _ in plan]

    def outputs(llm):
        outs = [o.outputs[0] for o in llm.generate(token_prompts([prompts[i] for _, i in plan]),
                                                   greedy, use_tqdm=False,
                                                   lora_request=requests)]
        return ([o.token_ids for o in outs],
                [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs])

    kw = dict(enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK, num_kv_blocks=64,
              attention_backend="reference", max_num_batched_tokens=32, device="cpu")
    with LLM(tiny_dir, async_scheduling=False, **kw) as llm:
        want = outputs(llm)
    with LLM(tiny_dir, tensor_parallel_size=2, **kw) as llm:
        from minivllm.runtime.executor import TPExecutor

        executor = llm.engine.runner
        assert isinstance(executor, TPExecutor)
        writes = []
        real = executor.set_lora

        def set_lora(slot, adapter):
            writes.append(adapter.path)
            real(slot, adapter)
        executor.set_lora = set_lora
        got = outputs(llm)
    assert len(set(writes)) == 3, writes  # three adapters in two slots: one slot rewritten
    assert got[0] == [oracle(name, i) for name, i in plan]
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-4)
    # The base rows are a TP=2 engine's without LoRA (its partials all-reduced unchanged).
    base = [k for k, (name, _) in enumerate(plan) if name is None]
    kw.pop("enable_lora"), kw.pop("max_loras"), kw.pop("max_lora_rank")
    with LLM(tiny_dir, tensor_parallel_size=2, **kw) as llm:
        outs = [o.outputs[0] for o in llm.generate(
            token_prompts([prompts[plan[k][1]] for k in base]), greedy, use_tqdm=False)]
    assert [got[0][k] for k in base] == [o.token_ids for o in outs]
    torch.testing.assert_close([got[1][k] for k in base],
                               [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]
                                for o in outs], rtol=0, atol=1e-5)


def test_lora_request_without_enable_lora_and_refused_configs(tiny_dir, adapters, prompts):
    plain = make_llm(tiny_dir, torch.device("cpu"))
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate(token_prompts(prompts[:1]), GREEDY, lora_request=adapters["all"][0])
    for bad in (0, -1):
        with pytest.raises(ValueError, match="lora_int_id"):
            LoRARequest("a", bad, "/x")
    # On the CPU the runner compiles nothing and captures no graphs, as without LoRA (on a GPU:
    # test_gpu_graphs_with_lora_equal_eager_lora_engine).
    llm = lora_llm(tiny_dir)
    runner = llm.engine.runner
    assert runner.graphs is None and runner.lora_graphs is None and not runner.prefill_graphs
    assert runner.small_decode_forward is None and runner.prefill_forward is forward


def test_persistent_decode_runs_a_lora_engines_steps_without_adapters(tiny_dir, adapters,
                                                                      prompts, oracle, device):
    """The persistent decode kernel adds no LoRA deltas: a LoRA engine keeps it for its decode
    steps of base rows only (here eager: under the interpreter on a CPU), and runs every step
    with an adapter row through the LoRA layers. Each prompt gets transformers' merged
    tokens."""
    from minivllm.kernels.decode_layer import MAX_ROWS

    llm = make_llm(tiny_dir, device, dtype="float32", enable_lora=True, max_loras=3,
                   max_lora_rank=MAX_RANK, persistent_decode=True, max_num_seqs=MAX_ROWS)
    runner = llm.engine.runner
    assert llm.config.persistent_decode and runner.small_decode_forward is not None
    small, seen = runner.small_decode_forward, []
    runner.small_decode_forward = lambda params, cache, batch, backend: \
        seen.append(batch.lora_slots) or small(params, cache, batch, backend)
    plan = [(None, 1), ("rs", 2), (None, 3), (None, 0), ("all", 3), ("low", 0)]
    got = run(llm, [prompts[i] for _, i in plan],
              [None if name is None else adapters[name][0] for name, _ in plan])
    assert got == [oracle(name, i) for name, i in plan]
    assert seen and all(slots is None for slots in seen)  # the base rows' steps only


def test_lora_request_refuses_a_path_that_is_not_a_string_or_path():
    """lora_path is text or an os.PathLike (vLLM's str): None, a number or bytes is a TypeError
    naming it when the LoRARequest is made, not an error from os.path when a request runs."""
    from pathlib import Path

    assert LoRARequest("a", 1, Path("/x/y")).lora_path == "/x/y"
    for bad in (None, 5, b"/x/y"):
        with pytest.raises(TypeError, match="lora_path"):
            LoRARequest("a", 1, bad)

def test_moe_refuses_enable_lora(tmp_path):
    from hf_tiny import make_hf_moe_model
    from minivllm.runtime.config import EngineConfig

    path = save_checkpoint(make_hf_moe_model(), tmp_path / "moe")
    with pytest.raises(ValueError, match="mixture-of-experts"):
        EngineConfig.create(path, device="cpu", enable_lora=True)


# -- slots ---------------------------------------------------------------------------------------


@given(st.integers(1, 4), st.lists(st.tuples(st.sets(st.integers(1, 7), max_size=4),
                                             st.sets(st.integers(1, 7), max_size=4)),
                                   max_size=30))
def test_slots_never_evict_an_adapter_in_use(max_loras, steps):
    """Any sequence of steps, each needing some adapters while others run: an adapter in use
    keeps its slot (and its weights: it is never rewritten), each needed one is in a slot of its
    own, and a slot is written only for an adapter that was not in it."""
    slots = LoRASlots(max_loras)
    content: dict[int, int] = {}  # slot -> the adapter whose weights it holds
    for needed, running in steps:
        needed = sorted(needed)[:max_loras]
        in_use = set(needed) | set(sorted(running)[:max_loras - len(needed)])
        before = dict(slots.slot_of)
        slot_of, loads = slots.assign(needed, in_use)
        for slot, lid in loads:
            assert content.get(slot) != lid
            assert content.get(slot) not in in_use  # an adapter in use is never overwritten
            content[slot] = lid
        for lid in in_use & set(before):
            assert slots.slot_of.get(lid) == before[lid]
        assert all(content[slot_of[lid]] == lid for lid in needed)
        assert len(set(slot_of.values())) == len(needed)
        assert all(0 <= s < max_loras for s in slots.slot_of.values())
        assert len(slots.slot_of) <= max_loras


def test_slots_refuse_more_adapters_than_slots():
    slots = LoRASlots(2)
    slots.assign([1, 2])
    with pytest.raises(RuntimeError, match="more than max_loras"):
        slots.assign([1, 2, 3])
    with pytest.raises(RuntimeError, match="in use"):
        slots.assign([3], in_use=[1, 2])


# -- the server and the CLI ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from minivllm.runtime.demo import ensure_demo_model

    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))


def test_server_selects_the_adapter_by_model_name(demo_dir, tmp_path):
    import urllib.error
    import urllib.request
    from minivllm.runtime.server import OpenAIServer

    path = str(tmp_path / "ad")
    write_adapter(path, demo_dir, r=4, alpha=8, targets="all-linear", seed=9, std=0.5)
    modules = {"myad": path}
    srv = OpenAIServer(lora_llm(demo_dir, max_loras=1, max_model_len=256), port=0,
                       model_name="base", lora_modules=modules)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    host, port = srv.address

    def call(route, body=None):
        req = urllib.request.Request(f"http://{host}:{port}{route}",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        ref = lora_llm(demo_dir, max_loras=1, max_model_len=256)
        req = LoRARequest("myad", 1, path)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompt = "The quick brown fox"
        want_lora = ref.generate([prompt], params, use_tqdm=False, lora_request=req)[0]
        want_base = ref.generate([prompt], params, use_tqdm=False)[0]
        assert want_lora.outputs[0].token_ids != want_base.outputs[0].token_ids
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        status, got = call("/v1/completions", {**body, "model": "myad"})
        assert status == 200 and got["model"] == "myad"
        assert got["choices"][0]["text"] == want_lora.outputs[0].text
        status, got = call("/v1/completions", {**body, "model": "base"})
        assert status == 200 and got["model"] == "base"
        assert got["choices"][0]["text"] == want_base.outputs[0].text
        messages = [{"role": "user", "content": "Hi there"}]
        want_chat = ref.chat(messages, params, use_tqdm=False, lora_request=req)[0]
        status, got = call("/v1/chat/completions", {"model": "myad", "messages": messages,
                                                    "max_tokens": 8, "temperature": 0,
                                                    "ignore_eos": True})
        assert status == 200 and got["model"] == "myad"
        assert got["choices"][0]["message"]["content"] == want_chat.outputs[0].text
        status, got = call("/v1/completions", {**body, "model": "other"})
        assert status == 404
        status, models = call("/v1/models")
        assert status == 200
        cards = {c["id"]: c for c in models["data"]}
        assert set(cards) == {"base", "myad"}
        assert cards["myad"]["parent"] == "base" and cards["myad"]["root"] == path
        assert "parent" not in cards["base"]
    finally:
        srv.shutdown()
        thread.join(timeout=10)


class Client:
    """JSON calls to a server started on a thread of its own (stop() shuts it down)."""

    def __init__(self, srv):
        self.srv = srv
        self.thread = threading.Thread(target=srv.serve_forever, daemon=True)
        self.thread.start()
        self.host, self.port = srv.address

    def call(self, route, body=None, method=None):
        """(status, the JSON body, or the text of a plain-text answer)."""
        import urllib.error
        import urllib.request

        req = urllib.request.Request(f"http://{self.host}:{self.port}{route}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                status, raw, kind = r.status, r.read(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            status, raw, kind = e.code, e.read(), e.headers.get("Content-Type", "")
        return status, json.loads(raw) if "json" in kind else raw.decode()

    def models(self) -> dict:
        status, models = self.call("/v1/models")
        assert status == 200
        return {c["id"]: c for c in models["data"]}

    def stop(self):
        self.srv.shutdown()
        self.thread.join(timeout=10)


def lora_server(demo_dir, **kw):
    from minivllm.runtime.server import OpenAIServer

    return Client(OpenAIServer(lora_llm(demo_dir, max_loras=1, max_model_len=256), port=0,
                               model_name="base", **kw))


def reference_text(demo_dir, prompt, path, max_tokens):
    ref = lora_llm(demo_dir, max_loras=1, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    req = None if path is None else LoRARequest("ref", 1, path)
    return ref.generate([prompt], params, use_tqdm=False, lora_request=req)[0].outputs[0].text


def test_server_loads_and_unloads_adapters_at_runtime(demo_dir, tmp_path, monkeypatch):
    """As vLLM's, with MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING=1 only (else no such route):
    /v1/load_lora_adapter serves a new module (listed, and a request naming it runs it),
    refusing a name already loaded (unless load_inplace), a missing field, the served model's
    name and an adapter that cannot be served (400, nothing changes);
    /v1/unload_lora_adapter removes one (no longer listed, a request naming it a 404, its slot
    freed), an unknown name a 404; a name unloaded may be loaded again, with other weights."""
    paths = [str(tmp_path / name) for name in ("a", "b")]
    for seed, path in enumerate(paths):
        write_adapter(path, demo_dir, r=4, alpha=8, targets="all-linear", seed=9 + seed, std=0.5)
    prompt = "The quick brown fox"
    want = {path: reference_text(demo_dir, prompt, path, 8) for path in paths}
    assert len(set(want.values())) == 2
    load = {"lora_name": "myad", "lora_path": paths[0]}
    monkeypatch.delenv("MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    client = lora_server(demo_dir)
    try:
        assert client.call("/v1/load_lora_adapter", load)[0] == 404
        assert client.call("/v1/unload_lora_adapter", {"lora_name": "x"})[0] == 404
    finally:
        client.stop()
    monkeypatch.setenv("MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    client = lora_server(demo_dir)
    engine = client.srv.llm.engine
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def text(model):
        status, got = client.call("/v1/completions", {**body, "model": model})
        return got["choices"][0]["text"] if status == 200 else status

    try:
        assert text("myad") == 404
        assert client.call("/v1/load_lora_adapter", load) == (
            200, "Success: LoRA adapter 'myad' added successfully.")
        cards = client.models()
        assert set(cards) == {"base", "myad"}
        assert cards["myad"]["root"] == paths[0] and cards["myad"]["parent"] == "base"
        assert text("myad") == want[paths[0]]
        status, err = client.call("/v1/load_lora_adapter", load)
        assert status == 400 and "has already been loaded" in err["error"]["message"]
        for bad, match in [({"lora_name": "x"}, "Both 'lora_name' and 'lora_path'"),
                           ({"lora_name": "base", "lora_path": paths[1]}, "served model"),
                           ({"lora_name": "x", "lora_path": str(tmp_path / "none")},
                            "no such directory"),
                           ({"lora_name": "x", "lora_path": str(tmp_path)}, "adapter_config")]:
            status, err = client.call("/v1/load_lora_adapter", bad)
            assert status == 400 and match in err["error"]["message"], (bad, err)
        assert set(client.models()) == {"base", "myad"}
        status, err = client.call("/v1/unload_lora_adapter", {"lora_name": "nope"})
        assert status == 404 and "cannot be found" in err["error"]["message"]
        assert client.call("/v1/unload_lora_adapter", {})[0] == 400
        assert client.call("/v1/load_lora_adapter", method="GET")[0] == 405
        lid = client.srv.lora_modules["myad"].lora_int_id
        assert lid in engine.list_loras()
        assert client.call("/v1/unload_lora_adapter", {"lora_name": "myad"}) == (
            200, "Success: LoRA adapter 'myad' removed successfully.")
        assert set(client.models()) == {"base"}
        assert text("myad") == 404
        assert lid not in engine.list_loras() and not engine.loras.slot_of
        # Loaded again under the name, with other weights; then those replaced in place.
        assert client.call("/v1/load_lora_adapter", {**load, "lora_path": paths[1]})[0] == 200
        assert text("myad") == want[paths[1]]
        assert client.call("/v1/load_lora_adapter", {**load, "load_inplace": True})[0] == 200
        assert text("myad") == want[paths[0]] and client.models()["myad"]["root"] == paths[0]
        assert text("base") == reference_text(demo_dir, prompt, None, 8)
    finally:
        client.stop()


def test_unloading_an_adapter_in_use_lets_its_requests_finish(demo_dir, tmp_path, monkeypatch):
    """An adapter unloaded while a request streams with it (the engine held after its fourth
    step, so that the request is mid-way): the request finishes with the adapter's own tokens,
    a new request naming it is a 404, and another adapter loaded at once into the only slot
    (max_loras=1) waits for the slot and gives its own tokens: neither is corrupted."""
    import http.client

    paths = [str(tmp_path / name) for name in ("a", "b")]
    for seed, path in enumerate(paths):
        write_adapter(path, demo_dir, r=4, alpha=8, targets="all-linear", seed=9 + seed, std=0.5)
    prompt, n = "The quick brown fox", 64
    want = [reference_text(demo_dir, prompt, path, n) for path in paths]
    monkeypatch.setenv("MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    client = lora_server(demo_dir, lora_modules={"a": paths[0]})
    engine = client.srv.llm.engine
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    entered, gate, steps = threading.Event(), threading.Event(), []
    real_step = engine.step

    def step(*args, **kw):  # the engine's thread, in EngineLoop._step
        out = real_step(*args, **kw)
        steps.append(1)
        if len(steps) == 4:
            entered.set()
            gate.wait()
        return out
    engine.step = step
    try:
        conn = http.client.HTTPConnection(client.host, client.port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({**body, "model": "a",
                                                            "stream": True}),
                     {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200
        assert entered.wait(60)
        lid = client.srv.lora_modules["a"].lora_int_id
        assert any(seq.lora_id == lid for seq in engine.scheduler.running)
        unloaded = []
        unloader = threading.Thread(target=lambda: unloaded.append(
            client.call("/v1/unload_lora_adapter", {"lora_name": "a"})))
        unloader.start()
        while "a" in client.srv.lora_modules:  # gone from the table before the engine is told
            unloader.join(0.01)
        assert client.call("/v1/completions", {**body, "model": "a"})[0] == 404
        gate.set()
        unloader.join(60)
        assert unloaded[0][0] == 200
        assert client.call("/v1/load_lora_adapter", {"lora_name": "b",
                                                      "lora_path": paths[1]})[0] == 200
        other = []
        second = threading.Thread(target=lambda: other.append(
            client.call("/v1/completions", {**body, "model": "b"})))
        second.start()
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"]
                           for line in iter(stream.readline, b"") if line.startswith(b"data: {"))
        second.join(120)
        assert streamed == want[0]
        assert other[0][0] == 200 and other[0][1]["choices"][0]["text"] == want[1]
        assert lid not in engine.list_loras()  # its slot went to b
    finally:
        gate.set()
        client.stop()


def test_server_refuses_bad_modules(demo_dir, tmp_path):
    from minivllm.runtime.server import OpenAIServer

    with pytest.raises(ValueError, match="no such directory"):
        OpenAIServer(lora_llm(demo_dir, max_model_len=256), port=0,
                     lora_modules={"x": str(tmp_path / "none")})
    with pytest.raises(ValueError, match="enable_lora"):
        OpenAIServer(make_llm(demo_dir, torch.device("cpu"), max_model_len=256), port=0,
                     lora_modules={"x": str(tmp_path / "none")})


def test_cli_lora_flags(monkeypatch):
    import argparse
    from minivllm import cli

    args = cli.build_parser().parse_args(
        ["serve", "m", "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
         "--max-loras", "2", "--max-lora-rank", "32"])
    assert args.enable_lora and args.max_loras == 2 and args.max_lora_rank == 32
    assert args.lora_modules == [("a", "/x"), ("b", "/y")]
    with pytest.raises(argparse.ArgumentTypeError):
        cli._lora_module("no-equals-sign")
    seen = {}
    monkeypatch.setattr("minivllm.runtime.llm.LLM", lambda model, **kw: seen.update(kw))
    args.model = "m"
    cli._make_llm(args, "m")
    assert seen["enable_lora"] and seen["max_loras"] == 2 and seen["max_lora_rank"] == 32


def test_cli_refuses_a_lora_module_name_given_twice(monkeypatch):
    """--lora-modules a=/x a=/y: vLLM refuses the second load of a name at start-up; the
    server's module dict kept only the last path, silently."""
    from minivllm import cli

    args = cli.build_parser().parse_args(
        ["serve", "m", "--enable-lora", "--lora-modules", "a=/x", "a=/y"])
    monkeypatch.setattr(cli, "_resolve_model", lambda args: pytest.fail("got past the check"))
    with pytest.raises(SystemExit, match="'a' is given twice"):
        cli.cmd_serve(args)
