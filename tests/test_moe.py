"""Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B) against transformers'
implementation: the config's expert fields, the loaded weights, the mixture-of-experts MLP
(grouped GEMMs over expert-sorted rows, and their fallback), the whole model's logits and
gradients, the engine's greedy generation (chunked prefill, prefix cache, TP=2), block-fp8
experts, and the fast paths on a GPU."""

from __future__ import annotations

import json
import os

import attrs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import minivllm
from minivllm import LLM, SamplingParams
from minivllm.functional import moe
from minivllm.state import MoELayerParams, ModelConfig, SeqChunk, ShardSpec, make_batch
from minivllm.state.params import LayerParams, check_params, random_params

from hf_tiny import DEVICE, MOE_TINY, contiguous_tables, make_hf_moe_model, save_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

# Each case: the model's overrides of MOE_TINY, and the config.json layout written.
CASES = {
    # every layer sparse, top-2 renormalized (Qwen3-30B-A3B's norm_topk_prob), Qwen's layout
    "norm-v4": (dict(), "v4"),
    # unnormalized top-3 of 6 experts, layer 1 dense (mlp_only_layers), transformers 5's layout
    "raw-mixed-v5": (dict(norm_topk_prob=False, num_experts=6, num_experts_per_tok=3,
                          mlp_only_layers=[1]), "v5"),
    # every second layer sparse (decoder_sparse_step 2), tied embeddings, 4 layers
    "step2-tied-v5": (dict(decoder_sparse_step=2, tie_word_embeddings=True, num_hidden_layers=4),
                      "v5"),
    # every expert taken (top_k == num_experts), sparse step 3 with layer 5 dense: only layer 2
    # is sparse
    "all4-step3-v4": (dict(num_experts=4, num_experts_per_tok=4, decoder_sparse_step=3,
                           num_hidden_layers=6, mlp_only_layers=[5]), "v4"),
}

PROMPTS = [[3, 17, 25, 4, 99, 60, 12, 8, 41], [7, 1, 55],
           [90, 34, 2, 2, 18, 76, 43, 21, 9, 10, 64, 5, 30, 31, 77, 50, 19, 88, 6, 14, 23]]


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(case name, transformers model, checkpoint path)."""
    overrides, layout = CASES[request.param]
    model = make_hf_moe_model(seed=len(request.param), std=0.3, **overrides)
    path = save_checkpoint(model, tmp_path_factory.mktemp(request.param), layout=layout)
    return request.param, model, path


def sparse_in_transformers(model) -> tuple[int, ...]:
    return tuple(n for n, layer in enumerate(model.model.layers)
                 if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock))


# --- the config ------------------------------------------------------------------------------

def test_config_reads_the_experts_as_transformers_builds_them(pair):
    """Which layers are sparse is transformers' decision (the modules it built); the expert
    fields are read from either spelling of the expert count."""
    name, model, path = pair
    config = ModelConfig.from_json(path)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    assert ("num_experts" in raw) == name.endswith("v4")  # both spellings are covered
    hf = model.config
    assert config.sparse_layers == sparse_in_transformers(model) and config.is_moe
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.norm_topk_prob) == (hf.num_experts, hf.num_experts_per_tok,
                                       hf.moe_intermediate_size, hf.norm_topk_prob)
    params = minivllm.load(path)
    check_params(params)
    assert [isinstance(lp, MoELayerParams) for lp in params.layers] == \
        [n in config.sparse_layers for n in range(config.num_layers)]


def _moe_dict(**changes):
    d = dict(MOE_TINY, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
             num_hidden_layers=3, decoder_sparse_step=1, mlp_only_layers=[])
    d.update(changes)
    return {k: v for k, v in d.items() if v is not None}


@pytest.mark.parametrize("changes, message", [
    (dict(num_experts=None), "needs num_experts"),
    (dict(num_experts_per_tok=None), "needs num_experts_per_tok"),
    (dict(moe_intermediate_size=None), "needs moe_intermediate_size"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok must be in \[1, num_experts=8\]"),
    (dict(num_experts_per_tok=0), r"num_experts_per_tok must be in"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size must be a positive integer"),
    (dict(num_local_experts=16), "num_experts .* and num_local_experts .* disagree"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step must be a positive integer"),
    (dict(mlp_only_layers="1"), "mlp_only_layers must be a list"),
    (dict(norm_topk_prob="true"), "norm_topk_prob must be true or false"),
    (dict(model_type="qwen3"), "model_type 'qwen3' does not match"),
    (dict(model_type="qwen2_moe"), "unsupported model_type 'qwen2_moe'"),
])
def test_bad_moe_configs_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(_moe_dict(**changes))


def test_a_config_without_architectures_is_read_by_its_model_type():
    d = _moe_dict()
    del d["architectures"]
    assert ModelConfig.from_dict(d).sparse_layers == (0, 1, 2)


def test_moe_intermediate_must_split_over_the_ranks():
    config = ModelConfig.from_dict(_moe_dict(moe_intermediate_size=34))
    ShardSpec(0, 2).check(config)  # 34 / 2
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(34\) is not divisible by the "
                                         r"tensor-parallel size \(4\)"):
        ShardSpec(0, 4).check(config)
    # intermediate_size is the dense MLP's: with every layer sparse it is never cut
    ShardSpec(0, 4).check(ModelConfig.from_dict(_moe_dict(intermediate_size=99)))
    with pytest.raises(ValueError, match=r"intermediate_size \(99\) is not divisible"):
        ShardSpec(0, 4).check(ModelConfig.from_dict(_moe_dict(intermediate_size=99,
                                                              mlp_only_layers=[1])))


def test_a_dense_layer_where_a_sparse_one_belongs_is_named():
    config = ModelConfig.from_dict(_moe_dict(mlp_only_layers=[1]))
    params = random_params(config, dtype="float32")
    layers = list(params.layers)
    check_params(params)
    layers[0] = LayerParams(**{f: getattr(layers[1], f) for f in
                               ("input_norm", "qkv", "q_norm", "k_norm", "o_proj", "post_norm",
                                "gate_up", "down")})
    with pytest.raises(TypeError, match=r"layers\[0\] must be a MoELayerParams, got LayerParams "
                                        r"\(the config makes it a mixture-of-experts layer\)"):
        check_params(attrs.evolve(params, layers=tuple(layers)))


def test_random_params_shard_the_experts_as_the_whole():
    """Every rank's expert slices are the TP=1 tensors' columns of its intermediate range."""
    config = ModelConfig.from_dict(_moe_dict(mlp_only_layers=[1]))
    whole = random_params(config, dtype="float32", seed=3)
    m = config.moe_intermediate_size // 2
    for rank in range(2):
        part = random_params(config, dtype="float32", seed=3, shard=ShardSpec(rank, 2))
        check_params(part)
        w, p = whole.layers[0], part.layers[0]
        assert torch.equal(p.router, w.router)
        gate, up = w.experts_gate_up.split(config.moe_intermediate_size, dim=1)
        cut = slice(rank * m, (rank + 1) * m)
        assert torch.equal(p.experts_gate_up, torch.cat([gate[:, cut], up[:, cut]], dim=1))
        assert torch.equal(p.experts_down, w.experts_down[:, :, cut])


# --- the mixture-of-experts MLP ---------------------------------------------------------------

def _block_pair(seed, dtype, **overrides):
    """transformers' sparse block and the same weights as minivllm holds them."""
    model = make_hf_moe_model(seed=seed, std=0.3, **overrides)
    block = model.model.layers[0].mlp.to(dtype)
    config = ModelConfig.from_dict(_moe_dict(**overrides))
    return block, config


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)],
                         ids=["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("norm", [True, False])
def test_moe_mlp_equals_transformers_block(dtype, tol, tokens, norm):
    """On the device the tests run on (a GPU's bf16 takes CUTLASS's grouped GEMM, its fp32 the
    fallback; the CPU's either dtype torch's grouped GEMM). One token leaves most experts
    empty; 64 fill them all."""
    block, config = _block_pair(tokens, dtype, norm_topk_prob=norm)
    h = torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        want = block(h.to(dtype)[None]).float()[0]
        got = moe.moe_mlp(h.to(dtype).to(DEVICE), block.gate.weight.to(DEVICE),
                          block.experts.gate_up_proj.to(DEVICE),
                          block.experts.down_proj.to(DEVICE), config, ShardSpec())
    assert got.dtype == dtype
    scale = want.abs().max().item()
    assert (got.float().cpu() - want).abs().max().item() <= tol * max(scale, 1.0)


def test_route_picks_transformers_experts_and_weights():
    block, config = _block_pair(2, torch.float32, norm_topk_prob=True)
    h = torch.randn(40, config.hidden_size)
    _, want_w, want_e = block.gate(h)
    got_w, got_e = moe.route(h, block.gate.weight, config.num_experts_per_tok, True)
    assert torch.equal(got_e, want_e)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_w.sum(-1), torch.ones(40))


def test_route_breaks_exact_ties_by_the_lower_expert():
    """Experts 1, 3 and 4 share one router row (equal probabilities), 0 scores lower, 2 higher:
    the top 3 are 2, then the lower indices of the tie, 1 and 3, as vLLM's kernel picks."""
    h = torch.randn(6, 16)
    router = torch.randn(5, 16)
    router[3] = router[4] = router[1]
    router[0] = -router[1]
    router[2] = 3 * router[1]
    h = h * torch.sign(h @ router[1])[:, None]  # every token prefers router[1]'s direction
    weights, experts = moe.route(h, router, 3, False)
    assert experts.tolist() == [[2, 1, 3]] * 6
    assert torch.equal(weights[:, 1], weights[:, 2])


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=5).filter(lambda s: sum(s) > 0),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_grouped_linear_both_paths_equal_per_row_products(sizes, dtype):
    """Rows grouped by expert, empty groups included: torch's grouped GEMM and the fallback
    (every group's product, each row keeping its own) give each row its group's product."""
    g = torch.Generator().manual_seed(sum(sizes) * 7 + len(sizes))
    rows = sum(sizes)
    x = torch.randn(rows, 16, generator=g).to(dtype)
    w = torch.randn(len(sizes), 8, 16, generator=g).to(dtype)
    offsets = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    group = [e for e, n in enumerate(sizes) for _ in range(n)]
    want = torch.stack([x[r].float() @ w[group[r]].float().T for r in range(rows)])
    tol = 1e-5 if dtype == torch.float32 else 2e-2 * max(want.abs().max().item(), 1.0)
    assert moe._grouped_mm_applies(x, w.transpose(1, 2))
    got = moe.grouped_linear(x, w, offsets)
    assert (got.float() - want).abs().max().item() <= tol
    original = moe._grouped_mm_applies
    moe._grouped_mm_applies = lambda *a: False
    try:
        got = moe.grouped_linear(x, w, offsets)
    finally:
        moe._grouped_mm_applies = original
    assert (got.float() - want).abs().max().item() <= tol


def test_the_fallback_runs_where_grouped_mm_cannot():
    """An odd size (rows not 16-byte aligned) takes the fallback, and it is right."""
    x = torch.randn(7, 6)
    w = torch.randn(3, 5, 6)
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)
    assert not moe._grouped_mm_applies(x, w.transpose(1, 2))
    want = torch.cat([x[:2] @ w[0].T, x[2:] @ w[2].T])
    torch.testing.assert_close(moe.grouped_linear(x, w, offsets), want)


# --- the whole model ---------------------------------------------------------------------------

def test_prefill_and_decode_logits_equal_transformers(pair):
    name, model, path = pair
    params = minivllm.load(path, device=DEVICE)
    tables, n = contiguous_tables(PROMPTS, 4, extra=1)
    cache = minivllm.init_cache(params, num_blocks=n, block_size=4)
    batch = make_batch([SeqChunk(p, 0, t) for p, t in zip(PROMPTS, tables)], block_size=4,
                       device=DEVICE, every_row=True)
    logits, cache = minivllm.forward(params, cache, batch)
    nxt = [11, 42, 97]
    step = make_batch([SeqChunk([t], len(p), tb) for p, t, tb in zip(PROMPTS, nxt, tables)],
                      block_size=4, device=DEVICE)
    decode, cache = minivllm.forward(params, cache, step)
    with torch.no_grad():
        want = torch.cat([model(torch.tensor([p])).logits[0] for p in PROMPTS])
        want_decode = torch.stack([model(torch.tensor([p + [t]])).logits[0, -1]
                                   for p, t in zip(PROMPTS, nxt)])
    assert (logits.cpu() - want).abs().max().item() <= 1e-4, name
    assert (decode.cpu() - want_decode).abs().max().item() <= 1e-4, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_compiled_forward_equals_eager(tmp_path, dtype):
    """The engine's compiled forward (each part traced whole, fullgraph) on a model with a sparse
    and a dense layer: fp32 compiles the fallback (torch._grouped_mm's meta function takes bf16
    only), bf16 the grouped GEMM; aot_eager, so the traced ops themselves run."""
    from minivllm.runtime.compiled import compiled_forward

    model = make_hf_moe_model(seed=8, std=0.3, mlp_only_layers=[1])
    params = minivllm.load(save_checkpoint(model, tmp_path / "moe"), dtype=dtype)
    tables, n = contiguous_tables(PROMPTS, 4)
    batch = make_batch([SeqChunk(p, 0, t) for p, t in zip(PROMPTS, tables)], block_size=4,
                       every_row=True)
    want, _ = minivllm.forward(params, minivllm.init_cache(params, num_blocks=n, block_size=4),
                               batch)
    calls, real = [], moe.grouped_linear
    try:
        moe.grouped_linear = lambda *a: calls.append(moe._grouped_mm_applies(
            a[0], a[1].transpose(1, 2))) or real(*a)
        got, _ = compiled_forward("aot_eager")(
            params, minivllm.init_cache(params, num_blocks=n, block_size=4), batch)
    finally:
        moe.grouped_linear = real
    assert calls and all(c == (dtype == torch.bfloat16) for c in calls)
    tol = 1e-5 if dtype == torch.float32 else 0.1
    assert (got.float() - want.float()).abs().max().item() <= tol


def test_gradients_equal_transformers(tmp_path):
    """torch.func.grad of a loss on the logits, through the grouped GEMMs and the routing
    weights, against transformers' autograd: the router's and every expert's gradient."""
    model = make_hf_moe_model(seed=4, std=0.3)
    path = save_checkpoint(model, tmp_path / "moe")
    params = minivllm.load(path)
    prompt = PROMPTS[2]
    batch = make_batch([SeqChunk(prompt, 0, list(range(6)))], block_size=4, every_row=True)

    def loss(p):
        cache = minivllm.init_cache(p, num_blocks=6, block_size=4)
        logits, _ = minivllm.forward(p, cache, batch)
        return logits.square().mean()

    grads = torch.func.grad(loss)(params)
    out = model(torch.tensor([prompt])).logits[0]
    out.square().mean().backward()
    mlp = model.model.layers[1].mlp
    g = grads.layers[1]
    torch.testing.assert_close(g.router, mlp.gate.weight.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(g.experts_gate_up, mlp.experts.gate_up_proj.grad, rtol=1e-4,
                               atol=1e-6)
    torch.testing.assert_close(g.experts_down, mlp.experts.down_proj.grad, rtol=1e-4, atol=1e-6)


# --- the engine --------------------------------------------------------------------------------

def _greedy_reference(model, prompts, n):
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def test_engine_greedy_equals_transformers(pair):
    """Chunked prefill (8-token steps mix prompt chunks with decodes) and the prefix cache (two
    prompts share their first 12 tokens). Eager on a GPU too: compiling each case's layers took
    90-210 s there (session 53), and the compiled layers and graphs have their own test below."""
    name, model, path = pair
    prompts = PROMPTS + [PROMPTS[2][:12] + [5, 6, 7]]
    want = _greedy_reference(model, prompts, 10)
    with LLM(path, device=DEVICE, max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=64,
             block_size=4, dtype="float32", enforce_eager=True) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want, name


def test_tp2_engine_equals_tp1(tmp_path):
    """Each rank holds every expert's half of the intermediate size: TP=2's greedy tokens and
    logprobs are TP=1's."""
    model = make_hf_moe_model(seed=9, std=0.3, mlp_only_layers=[1])
    path = save_checkpoint(model, tmp_path / "moe")
    engine = dict(num_kv_blocks=64, attention_backend="reference", max_num_batched_tokens=16,
                  device="cpu", dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run(**kw):
        with LLM(path, **engine, **kw) as llm:
            outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return ([o.token_ids for o in outs],
                [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs])

    tokens1, lps1 = run(async_scheduling=False)
    tokens2, lps2 = run(tensor_parallel_size=2)
    assert tokens2 == tokens1
    torch.testing.assert_close(torch.tensor(lps2), torch.tensor(lps1), rtol=0, atol=1e-4)


def test_speculative_decoding_gives_the_same_tokens(tmp_path):
    """N-gram drafts verified through the MoE layers (several rows a sequence in one step):
    greedy tokens equal the engine's without speculation, and drafts were accepted."""
    model = make_hf_moe_model(seed=2, std=0.3, mlp_only_layers=[1])
    path = save_checkpoint(model, tmp_path / "moe")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + [[5] * 20, [9, 4, 9, 4, 9, 4, 9]]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine = dict(device="cpu", num_kv_blocks=64, dtype="float32", async_scheduling=False)
    with LLM(path, **engine) as base:
        want = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    with LLM(path, speculative_config=spec, **engine) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats
    assert got == want
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0


def test_persistent_decode_is_refused_for_a_moe(pair):
    _, _, path = pair
    with pytest.raises(ValueError, match="persistent_decode runs dense Qwen3 layers"):
        LLM(path, device="cpu", persistent_decode=True)


def test_an_unknown_moe_kernel_is_refused_before_loading(pair, monkeypatch):
    """MINIVLLM_MOE_KERNEL outside auto/triton/grouped: a ValueError naming the value and the
    choices when the engine is configured, not at its first step."""
    _, _, path = pair
    monkeypatch.setattr(moe, "_MOE_KERNEL", "fused")
    with pytest.raises(ValueError, match=r"MINIVLLM_MOE_KERNEL='fused' is not one of \('auto'"):
        LLM(path, device="cpu")


# --- block-fp8 experts ---------------------------------------------------------------------------

def test_fp8_experts_load_as_their_dequantization(tmp_path):
    """Qwen3-30B-A3B-FP8's layout: attention and every expert's linears in fp8 blocks, the
    router (mlp.gate) bf16. The loaded experts equal the block-by-block dequantization."""
    from test_fp8_checkpoint import FP8_CONFIG, dequantize_blocks, quantize_blocks

    model = make_hf_moe_model(seed=6, std=0.3, mlp_only_layers=[1])
    path = save_checkpoint(model, tmp_path / "fp8moe")
    file = os.path.join(path, "model.safetensors")
    out, reference = {}, {}
    for name, t in load_file(file).items():
        if name.endswith("_proj.weight") and ".layers." in name:
            q, s = quantize_blocks(t)
            out[name], out[name + "_scale_inv"] = q, s
            reference[name] = dequantize_blocks(q, s)
        else:
            out[name] = t.to(torch.bfloat16)
            reference[name] = out[name].float()
    save_file(out, file, metadata={"format": "pt"})
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    # Qwen3-30B-A3B-FP8's config lists every router (and the LM head) as not converted
    skip = ["lm_head"] + [f"model.layers.{n}.mlp.gate" for n in (0, 2)]
    cfg.update(dtype="bfloat16", quantization_config=dict(FP8_CONFIG, modules_to_not_convert=skip))
    json.dump(cfg, open(cfg_path, "w"))
    for shard in (ShardSpec(), ShardSpec(1, 2)):
        params = minivllm.load(path, dtype="float32", shard=shard)
        m = 32 // shard.world_size
        cut = slice(shard.rank * m, (shard.rank + 1) * m)
        for n in (0, 2):
            p, lp = f"model.layers.{n}.mlp.", params.layers[n]
            assert torch.equal(lp.router, reference[p + "gate.weight"])
            for e in range(8):
                r = {k: reference[f"{p}experts.{e}.{k}_proj.weight"] for k in ("gate", "up", "down")}
                assert torch.equal(lp.experts_gate_up[e], torch.cat([r["gate"][cut], r["up"][cut]]))
                assert torch.equal(lp.experts_down[e], r["down"][:, cut])
        i = 96 // shard.world_size  # the dense layer's intermediate slice
        assert torch.equal(params.layers[1].down, reference["model.layers.1.mlp.down_proj.weight"]
                           [:, shard.rank * i:(shard.rank + 1) * i])
    # A router stored in fp8 blocks with its scales (vLLM quantizes the gate too) loads as its
    # dequantization; its scales without the fp8 weight are refused by name.
    name = "model.layers.2.mlp.gate.weight"
    q, s = quantize_blocks(out[name].float())
    out[name], out[name + "_scale_inv"] = q, s
    save_file(out, file, metadata={"format": "pt"})
    assert torch.equal(minivllm.load(path, dtype="float32").layers[2].router,
                       dequantize_blocks(q, s))
    out[name] = reference[name].to(torch.bfloat16)
    save_file(out, file, metadata={"format": "pt"})
    with pytest.raises(minivllm.CheckpointError, match=f"tensor {name} is stored as BF16"):
        minivllm.load(path)


# --- the GPU's fast paths ------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_on_a_hopper_gpu_takes_the_grouped_gemm(monkeypatch):
    """A silent fallback would pass every equality test at experts x the work."""
    block, config = _block_pair(3, torch.bfloat16)
    calls, real = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    h = torch.randn(9, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    moe.moe_mlp(h, block.gate.weight.cuda(), block.experts.gate_up_proj.cuda(),
                block.experts.down_proj.cuda(), config, ShardSpec())
    hopper = torch.cuda.get_device_capability()[0] in (9, 10)
    assert len(calls) == (2 if hopper else 0)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_and_compiled_layer_equal_eager_on_the_gpu(tmp_path, dtype):
    """The compiled layers (a sparse and a dense one: two graphs of one function), the decode
    CUDA graphs (a single sequence's bucket of 1 too) and the prefill graphs against the eager
    engine. fp32 (the fallback's products): the same tokens. bf16 (CUTLASS's grouped GEMM,
    compiled): each shared position's logprob within bf16's reach (see test_gpu_graphs), the
    first token everywhere the same."""
    model = make_hf_moe_model(seed=1, std=0.3, num_hidden_layers=4, hidden_size=128,
                              intermediate_size=256, moe_intermediate_size=64,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                              vocab_size=257, mlp_only_layers=[2])
    path = save_checkpoint(model, tmp_path / "moe")
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 257, (n,), generator=g).tolist()}
               for n in (1, 5, 17, 33, 64, 100, 3, 250)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)

    def run(**kw):
        llm = LLM(path, dtype=dtype, num_kv_blocks=256, max_num_seqs=16, **kw)
        return llm, [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    eager, want = run(enforce_eager=True, async_scheduling=False)
    fast, got = run()
    assert eager.engine.runner.graphs is None and fast.engine.runner.graphs is not None
    assert fast.engine.runner.small_decode_forward is None  # no persistent decode for a MoE
    # A single sequence replays the bucket of 1 row (no padding row's experts to read).
    assert fast.engine.runner.graphs.buckets[0] == 1
    for llm, outs in ((eager, want), (fast, got)):
        outs += [o.outputs[0] for o in llm.generate(prompts[2:3], params, use_tqdm=False)]
    if dtype == "float32":
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        return
    for a, b in zip(got, want):
        k = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                 len(a.token_ids))
        for i in range(k):
            tok = a.token_ids[i]
            assert abs(a.logprobs[i][tok].logprob - b.logprobs[i][tok].logprob) < 0.5
        if k < len(a.token_ids):
            best = max(lp.logprob for lp in b.logprobs[k].values())
            assert a.token_ids[k] in b.logprobs[k]
            assert best - b.logprobs[k][a.token_ids[k]].logprob < 0.5
