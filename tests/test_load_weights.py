"""LLM.load_weights: in-place weight updates from (Hugging Face name, tensor) pairs, as RL loops
(TRL, OpenRLHF) push a trainer's weights into vLLM. The oracle is an engine (or load) built from
the checkpoint holding the new weights: fp32 on the CPU, so tokens and logprobs match exactly."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._pytree import tree_leaves

from minivllm import LLM, SamplingParams
from minivllm.state.load import Placement, assign_hf_weights, hf_placements, load
from minivllm.state.shard import ShardSpec

from hf_tiny import make_hf_model, make_hf_moe_model, save_checkpoint

ENGINE = dict(num_kv_blocks=64, attention_backend="reference", device="cpu", block_size=4,
              max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
# 23 tokens: five full blocks of 4, which the prefix cache registers.
PROMPTS = [{"prompt_token_ids": torch.randint(0, 101, (n,), generator=torch.Generator()
                                              .manual_seed(n)).tolist()} for n in (23, 6)]


@pytest.fixture(scope="module")
def models():
    return make_hf_model(seed=1), make_hf_model(seed=2)


@pytest.fixture(scope="module")
def dirs(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("loadw")
    return tuple(save_checkpoint(m, root / name) for m, name in zip(models, "ab"))


def run(llm, prompts=PROMPTS):
    outs = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return ([o.token_ids for o in outs],
            [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs])


def leaves(params):
    return [t.clone() for t in tree_leaves(params) if isinstance(t, torch.Tensor)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_update_gives_the_new_checkpoints_engine_and_resets_the_prefix_cache(models, dirs):
    with LLM(dirs[1], **ENGINE) as want_llm:
        want = run(want_llm)
        want_params = leaves(want_llm.engine.runner.params)
    with LLM(dirs[0], **ENGINE) as llm:
        before = run(llm)
        run(llm)  # the long prompt again: its blocks are cached under A's weights
        sched = llm.engine.scheduler
        assert sched.num_prefix_cache_hits > 0  # a hit that a missing reset would reuse
        assert before != want
        llm.load_weights(models[1].state_dict().items())
        assert same(leaves(llm.engine.runner.params), want_params)
        hits = sched.num_prefix_cache_hits
        assert run(llm) == want
        assert sched.num_prefix_cache_hits == hits  # nothing of A's K/V was reused
        # B's own blocks are cached and hit as usual (a cached prefix's attention sums in
        # another order: logprobs equal to fp32 rounding).
        again = run(llm)
        assert sched.num_prefix_cache_hits > hits
        assert again[0] == want[0]
        torch.testing.assert_close(again[1], want[1], rtol=0, atol=1e-5)


def test_partial_update_equals_the_checkpoint_with_that_tensor_changed(models, dirs, tmp_path):
    name = "model.layers.1.self_attn.q_proj.weight"
    new = models[1].state_dict()[name]
    edited = make_hf_model(seed=1)
    edited.load_state_dict({**edited.state_dict(), name: new})
    with LLM(save_checkpoint(edited, tmp_path / "c"), **ENGINE) as want_llm:
        want = run(want_llm)
        want_params = leaves(want_llm.engine.runner.params)
    with LLM(dirs[0], **ENGINE) as llm:
        old = leaves(llm.engine.runner.params)
        llm.load_weights([(name, new)])
        got = leaves(llm.engine.runner.params)
        assert same(got, want_params)
        # Only qkv of layer 1 changed, and of it only the q rows (4 heads x 16).
        changed = [i for i, (x, y) in enumerate(zip(old, got)) if not torch.equal(x, y)]
        assert len(changed) == 1
        qkv = got[changed[0]]
        assert torch.equal(qkv[64:], old[changed[0]][64:]) and torch.equal(qkv[:64], new)
        assert run(llm) == want


@pytest.mark.parametrize("bad, match", [
    (("model.layers.2.mlp.up_proj.weight", torch.zeros(96, 64)), "not a weight of this model"),
    (("model.layers.0.mlp.up_proj.weight", torch.zeros(64, 96)), r"shape \(64, 96\), expected \(96, 64\)"),
    (("model.norm.weight", [1.0] * 64), "list, not a tensor"),
    (("model.norm.weight", torch.ones(64, dtype=torch.int32)), "weights are floats"),
    ("model.norm.weight", "pairs"),
])
def test_a_bad_pair_changes_nothing(models, dirs, bad, match):
    good = list(models[1].state_dict().items())
    with LLM(dirs[0], **ENGINE) as llm:
        old = leaves(llm.engine.runner.params)
        before = run(llm)
        with pytest.raises(ValueError, match=match):
            llm.load_weights(good[:5] + [bad] + good[5:])  # good pairs on either side
        assert same(leaves(llm.engine.runner.params), old)
        # The same tokens, now from the prefix cache, which a refused update leaves alone.
        hits = llm.engine.scheduler.num_prefix_cache_hits
        assert run(llm)[0] == before[0]
        assert llm.engine.scheduler.num_prefix_cache_hits > hits


def test_refused_while_requests_run(models, dirs):
    with LLM(dirs[0], **ENGINE) as llm:
        old = leaves(llm.engine.runner.params)
        rid = llm.engine.add_request(PROMPTS[0], GREEDY)
        llm.engine.step()
        with pytest.raises(ValueError, match="would mix weights"):
            llm.load_weights(models[1].state_dict().items())
        assert same(leaves(llm.engine.runner.params), old)
        llm.engine.abort_request(rid)
        llm.load_weights(models[1].state_dict().items())  # accepted once none runs
        assert not same(leaves(llm.engine.runner.params), old)


def test_tied_embeddings(tmp_path):
    """A tied model's lm_head.weight is skipped, as load skips it in a checkpoint that has both:
    the head is the embedding, which model.embed_tokens.weight updates."""
    a, b = (make_hf_model(seed=s, tie_word_embeddings=True) for s in (1, 2))
    assert "lm_head.weight" in b.state_dict()  # transformers lists the tied head too
    with LLM(save_checkpoint(b, tmp_path / "b"), **ENGINE) as want_llm:
        want = run(want_llm)
    with LLM(save_checkpoint(a, tmp_path / "a"), **ENGINE) as llm:
        old = leaves(llm.engine.runner.params)
        llm.load_weights([("lm_head.weight", torch.zeros(101, 64))])
        assert same(leaves(llm.engine.runner.params), old)
        llm.load_weights(b.state_dict().items())
        assert run(llm) == want


def test_assign_hf_weights_is_pure_and_casts(models, dirs):
    """The functional form: new Params equal to load's of the new checkpoint, in the params'
    dtype (bf16 from fp32 tensors), the old Params untouched; names without "model." too."""
    a = load(dirs[0], dtype=torch.bfloat16)
    old = leaves(a)
    pairs = [(n.removeprefix("model."), t) for n, t in models[1].state_dict().items()]
    got = assign_hf_weights(a, pairs)
    assert same(leaves(got), leaves(load(dirs[1], dtype=torch.bfloat16)))
    assert same(leaves(a), old)


@pytest.mark.parametrize("rank", [0, 1])
def test_placements_are_loads_layout_on_each_tensor_parallel_rank(models, dirs, rank):
    """Each rank's slices of the update are what load reads for that rank (vocabulary 101
    padded to 102: rank 1's last embedding row is padding, left zero)."""
    shard = ShardSpec(rank=rank, world_size=2)
    a = load(dirs[0], shard=shard)
    assert hf_placements(a.config, shard)["model.layers.0.self_attn.k_proj.weight"].src_rows \
        == (rank * 16, rank * 16 + 16)
    got = assign_hf_weights(a, models[1].state_dict().items())
    assert same(leaves(got), leaves(load(dirs[1], shard=shard)))


def check_tensor_parallel_update(models, dirs):
    """A TP=2 engine from dirs[0], updated to models[1]'s weights, runs as a TP=1 engine from
    dirs[1]: the same tokens, logprobs within 1e-5."""
    with LLM(dirs[1], **ENGINE) as want_llm:
        want = run(want_llm)
    with LLM(dirs[0], tensor_parallel_size=2, **ENGINE) as llm:
        run(llm)
        llm.load_weights(models[1].state_dict().items())
        got = run(llm)
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)


def test_tensor_parallel_engine(models, dirs):
    """tensor_parallel_size=2 (gloo, a spawned worker): the update reaches the worker's shard."""
    check_tensor_parallel_update(models, dirs)


def test_the_tensors_keep_their_addresses(models, dirs):
    """What CUDA graphs, compiled code and the persistent decode's layer table rely on: the
    update writes into the params' own storage (checked here on the CPU; the GPU's replay of
    the captured graphs after an update: test_gpu_graphs_run_the_new_weights_without_recapture)."""
    with LLM(dirs[0], **ENGINE) as llm:
        params = llm.engine.runner.params
        ptrs = [t.data_ptr() for t in tree_leaves(params)]
        llm.load_weights(models[1].state_dict().items())
        assert llm.engine.runner.params is params
        assert [t.data_ptr() for t in tree_leaves(params)] == ptrs


@pytest.mark.parametrize("quantization", ["awq", "fp8"])
def test_quantized_params_are_refused(dirs, quantization):
    from minivllm.state.load import check_hf_weights
    from minivllm.state.params import random_params

    import attrs

    # Shapes AWQ groups and fp8 blocks of 128 divide.
    config = attrs.evolve(load(dirs[0]).config, hidden_size=128, head_dim=128,
                          intermediate_size=128)
    params = random_params(config, quantization=quantization, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="quantized"):
        check_hf_weights(params, [("model.norm.weight", torch.ones(128))])


# --- mixture of experts (Qwen3MoeForCausalLM) ---------------------------------------------------
# Layers 0 and 2 sparse (8 experts of moe_intermediate 32), layer 1 dense (mlp_only_layers).
MOE = dict(mlp_only_layers=[1])


@pytest.fixture(scope="module")
def moe_models():
    return make_hf_moe_model(seed=1, std=0.3, **MOE), make_hf_moe_model(seed=2, std=0.3, **MOE)


@pytest.fixture(scope="module")
def moe_dirs(moe_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("moelw")
    return tuple(save_checkpoint(m, root / name) for m, name in zip(moe_models, "ab"))


def moe_pairs(moe_models, moe_dirs, layout):
    """B's weights as transformers 5 holds them ("fused": mlp.experts.gate_up_proj [experts,
    2 * moe_intermediate, hidden], mlp.experts.down_proj) or as its checkpoint names them
    ("checkpoint": mlp.experts.E.gate_proj.weight, ..., what load reads)."""
    if layout == "fused":
        pairs = list(moe_models[1].state_dict().items())
        assert "model.layers.0.mlp.experts.gate_up_proj" in dict(pairs)
        return pairs
    pairs = list(load_file(os.path.join(moe_dirs[1], "model.safetensors")).items())
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in dict(pairs)
    return pairs


@pytest.mark.parametrize("layout", ["fused", "checkpoint"])
def test_moe_update_gives_the_new_checkpoints_engine(moe_models, moe_dirs, layout):
    with LLM(moe_dirs[1], **ENGINE) as want_llm:
        want = run(want_llm)
        want_params = leaves(want_llm.engine.runner.params)
    with LLM(moe_dirs[0], **ENGINE) as llm:
        assert llm.engine.runner.params.config.sparse_layers == (0, 2)
        before = run(llm)
        assert before != want
        llm.load_weights(moe_pairs(moe_models, moe_dirs, layout))
        assert same(leaves(llm.engine.runner.params), want_params)
        assert run(llm) == want


@pytest.mark.parametrize("layout", ["fused", "checkpoint"])
@pytest.mark.parametrize("rank", [0, 1])
def test_moe_placements_are_loads_layout_on_each_tensor_parallel_rank(moe_models, moe_dirs,
                                                                      layout, rank):
    """Every expert's intermediate size is cut in two (32 -> 16 a rank): each rank's gate, up
    rows and down columns of each expert are what load reads for it."""
    shard = ShardSpec(rank=rank, world_size=2)
    a = load(moe_dirs[0], shard=shard)
    places = hf_placements(a.config, shard)
    assert places["model.layers.2.mlp.experts.3.up_proj.weight"] == Placement(
        ("layers", 2, "experts_gate_up", 3), rows=(16, 32), src_rows=(rank * 16, rank * 16 + 16))
    assert places["model.layers.0.mlp.experts.5.down_proj.weight"] == Placement(
        ("layers", 0, "experts_down", 5), src_cols=(rank * 16, rank * 16 + 16))
    assert places["model.layers.0.mlp.gate.weight"] == Placement(("layers", 0, "router"))
    assert "model.layers.1.mlp.gate.weight" not in places  # the dense layer
    assert places["model.layers.1.mlp.up_proj.weight"].src_rows == (rank * 48, rank * 48 + 48)
    got = assign_hf_weights(a, moe_pairs(moe_models, moe_dirs, layout))
    assert same(leaves(got), leaves(load(moe_dirs[1], shard=shard)))


def test_moe_partial_update_of_one_expert(moe_models, moe_dirs):
    """One expert's down_proj: only that expert's slice of its layer's experts_down changes."""
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    new = load_file(os.path.join(moe_dirs[1], "model.safetensors"))[name]
    with LLM(moe_dirs[0], **ENGINE) as llm:
        params = llm.engine.runner.params
        old = leaves(params)
        before = run(llm)
        llm.load_weights([(name, new)])
        got = leaves(params)
        changed = [i for i, (x, y) in enumerate(zip(old, got)) if not torch.equal(x, y)]
        assert len(changed) == 1
        down = got[changed[0]]
        assert torch.equal(down, params.layers[2].experts_down)
        assert torch.equal(down[5], new)
        keep = [e for e in range(8) if e != 5]
        assert torch.equal(down[keep], old[changed[0]][keep])
        assert run(llm) != before


@pytest.mark.parametrize("bad, match", [
    (("model.layers.0.mlp.experts.8.down_proj.weight", torch.zeros(64, 32)),
     "not a weight of this model"),  # 8 experts: 0..7
    (("model.layers.1.mlp.experts.0.up_proj.weight", torch.zeros(32, 64)),
     "not a weight of this model"),  # layer 1 is dense
    (("model.layers.1.mlp.experts.gate_up_proj", torch.zeros(8, 64, 64)),
     "not a weight of this model"),
    (("model.layers.1.mlp.gate.weight", torch.zeros(8, 64)), "not a weight of this model"),
    (("model.layers.0.mlp.experts.3.gate_proj.weight", torch.zeros(64, 32)),
     r"shape \(64, 32\), expected \(32, 64\)"),
    (("model.layers.2.mlp.experts.gate_up_proj", torch.zeros(8, 32, 64)),
     r"shape \(8, 32, 64\), expected \(8, 64, 64\)"),
    (("model.layers.2.mlp.gate.weight", torch.zeros(6, 64)), r"expected \(8, 64\)"),
    (("model.layers.0.mlp.experts.down_proj", torch.zeros(8, 64, 32, dtype=torch.int8)),
     "weights are floats"),
])
def test_moe_a_bad_pair_changes_nothing(moe_models, moe_dirs, bad, match):
    good = list(moe_models[1].state_dict().items())
    with LLM(moe_dirs[0], **ENGINE) as llm:
        old = leaves(llm.engine.runner.params)
        with pytest.raises(ValueError, match=match):
            llm.load_weights(good[:12] + [bad] + good[12:])  # good pairs on either side
        assert same(leaves(llm.engine.runner.params), old)


def test_moe_tensor_parallel_engine(moe_models, moe_dirs):
    """tensor_parallel_size=2: the fused experts reach the worker whole, which cuts its slice."""
    check_tensor_parallel_update(moe_models, moe_dirs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_graphs_run_the_new_weights_without_recapture(models, dirs, dtype, monkeypatch):
    """On a GPU: an engine compiled with its decode CUDA graphs (and, where it takes them, the
    persistent decode kernel's layer table and the prefill graphs), built from checkpoint A,
    updated to B's weights, gives a fresh engine from B its greedy tokens, in bf16 and fp32,
    without capturing anything again: the graphs' replays read the new weights in place.
    Both engines run the same compiled kernels and graphs on equal weights (load_weights casts
    as the load does), so tokens are equal exactly, logprobs too up to fp32's rounding."""
    from engine_helpers import make_llm
    from minivllm.runtime.graphs import DecodeGraphs
    from minivllm.runtime.prefill_graph import PrefillGraph

    captures = []
    for cls in (DecodeGraphs, PrefillGraph):
        inner = cls.capture

        def counted(self, *a, _inner=inner, **kw):
            captures.append(type(self).__name__)
            return _inner(self, *a, **kw)
        monkeypatch.setattr(cls, "capture", counted)
    cuda = torch.device("cuda")
    # Two prompts (the persistent decode's 1-2 rows where it applies) and four (the bucket of 4).
    batches = [PROMPTS, PROMPTS + [{"prompt_token_ids": [7, 8, 9, 7, 8]},
                                   {"prompt_token_ids": list(range(40, 52))}]]
    kw = dict(dtype=dtype, block_size=16)

    def runs(llm):
        return [run(llm, b) for b in batches]
    want_llm = make_llm(dirs[1], cuda, graphs=True, **kw)
    assert want_llm.engine.runner.graphs is not None
    want = runs(want_llm)
    del want_llm
    llm = make_llm(dirs[0], cuda, graphs=True, **kw)
    runner = llm.engine.runner
    assert runner.graphs is not None
    replays, inner_replay = [], runner.graphs.replay
    runner.graphs.replay = lambda b: replays.append(b) or inner_replay(b)
    before = runs(llm)
    assert [b[0] for b in before] != [w[0] for w in want]
    captured, graphs, prefill = len(captures), runner.graphs, list(runner.prefill_graphs)
    ptrs = [t.data_ptr() for t in tree_leaves(runner.params) if isinstance(t, torch.Tensor)]
    llm.load_weights(models[1].state_dict().items())
    replays.clear()
    got = runs(llm)
    assert len(captures) == captured  # nothing captured again
    assert runner.graphs is graphs and runner.prefill_graphs == prefill
    assert [t.data_ptr() for t in tree_leaves(runner.params)
            if isinstance(t, torch.Tensor)] == ptrs
    assert replays  # the decode steps replayed the graphs captured under A's weights
    for (g_tokens, g_lps), (w_tokens, w_lps) in zip(got, want):
        assert g_tokens == w_tokens
        torch.testing.assert_close(g_lps, w_lps, rtol=0,
                                   atol=1e-5 if dtype == "float32" else 1e-2)
