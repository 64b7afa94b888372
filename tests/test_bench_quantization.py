"""`minivllm bench --quantization {awq,fp8}`: random weights of a shape whose decoder linears are
held as the engine holds an AWQ or a block-fp8 checkpoint's (state/params.random_params), the
engine that runs them (the dense-only kernels off), the floor that counts their bytes, and the
combinations refused before any engine starts."""

import json
import math

import pytest
import torch

import minivllm
from minivllm.cli import main
from minivllm.runtime.config import EngineConfig, _quantized_linears, random_model
from minivllm.runtime.workload import quantized_linear_bytes, traffic_floor_bytes, weight_bytes
from minivllm.state import ModelConfig, ShardSpec
from minivllm.state.config import SHAPES
from minivllm.state.params import AWQ_FIELDS, check_params, expected_shapes, has_quantized
from minivllm.state.quant import (AwqWeight, Fp8BlockWeight, dequantize_awq, dequantize_fp8_weight,
                                  unpack_awq)

# Inputs of whole AWQ groups of 128 and outputs of whole fp8 blocks of 128 (q, k and v rows too,
# so that the merges keep fp8), as the real shapes have.
CONFIG = ModelConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=128, dtype=torch.float32,
                     tie_word_embeddings=False)
# The same as a bench shape (the workload's prompt ids go up to 10,000).
TINY = dict(vocab_size=10_050, hidden_size=256, intermediate_size=384, num_layers=2, num_heads=2,
            num_kv_heads=1, head_dim=128, tie_word_embeddings=False)
KIND = {"awq": AwqWeight, "fp8": Fp8BlockWeight}


@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setitem(SHAPES, "tiny-test", TINY)
    monkeypatch.setenv("MINIVLLM_FP8_WEIGHTS", "fp8")
    return "tiny-test"


def _dense(w, dtype=torch.float32):
    """[out, in] of a quantized linear."""
    if isinstance(w, AwqWeight):
        return dequantize_awq(w, dtype).T
    return dequantize_fp8_weight(w, dtype)


@pytest.mark.parametrize("quantization", ["awq", "fp8"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_random_params_hold_the_linears_as_a_quantized_checkpoint_loads(quantization, world_size):
    shard = ShardSpec(rank=world_size - 1, world_size=world_size)
    params = minivllm.random_params(CONFIG, seed=0, shard=shard, quantization=quantization)
    check_params(params)  # each quantized weight's check(), shapes against the shard's
    assert has_quantized(params)
    shapes = expected_shapes(CONFIG, shard)
    for layer in params.layers:
        for field in AWQ_FIELDS:
            w = getattr(layer, field)
            assert type(w) is KIND[quantization] and tuple(w.shape) == shapes[field]
            if quantization == "awq":
                assert w.group_size == 128 and w.scales.dtype == torch.float16
                assert w.qweight.dtype == w.qzeros.dtype == torch.int32
                assert w.qzeros.shape == (w.in_features // 128, w.out_features // 8)
                values = unpack_awq(w.qweight)
                assert values.min() == 0 and values.max() == 15  # random 4-bit values
            else:
                assert w.block == (128, 128) and w.weight.dtype == torch.float8_e4m3fn
                assert w.scale_inv.dtype == torch.float32
                assert w.scale_inv.shape == (math.ceil(w.out_features / 128),
                                             math.ceil(w.in_features / 128))
            dense = _dense(w)
            assert 0.01 < dense.std().item() < 0.04 and abs(dense.mean().item()) < 0.005
        # norms (and the embedding, the head) stay in the model's dtype
        assert layer.input_norm.dtype == torch.float32
    assert params.lm_head.dtype == params.embed.dtype == torch.float32


def test_random_params_merge_qkv_and_gate_up_as_load_does():
    """Three (two) independently drawn parts, concatenated along the output: the merged
    weight's parts are not copies of one another, and each fills its rows."""
    for quantization in ("awq", "fp8"):
        layer = minivllm.random_params(CONFIG, seed=1, quantization=quantization).layers[0]
        qkv, gate_up = _dense(layer.qkv), _dense(layer.gate_up)
        q, k, v = qkv.split([256, 128, 128])
        assert not torch.equal(k, v) and not torch.equal(q[:128], k)
        gate, up = gate_up.split(512)
        assert not torch.equal(gate, up)


def test_random_params_refuse_what_no_checkpoint_loads():
    with pytest.raises(ValueError, match="not one of"):
        minivllm.random_params(CONFIG, quantization="int4")
    moe = ModelConfig(**{**SHAPES["qwen3-30b-a3b"], "num_layers": 1, "sparse_layers": (0,)})
    with pytest.raises(ValueError, match="mixtures of experts"):
        minivllm.random_params(moe, quantization="awq")


@pytest.mark.parametrize("quantization", ["awq", "fp8"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_floor_counts_the_quantized_weights_bytes(quantization, world_size):
    """The weight bytes a decode step reads: exactly the bytes the built params hold (all but
    the embedding, which is not tied here), on each rank."""
    shard = ShardSpec(rank=0, world_size=world_size)
    params = minivllm.random_params(CONFIG, seed=0, shard=shard, quantization=quantization)
    held = sum(t.numel() * t.element_size()
               for t in torch.utils._pytree.tree_leaves((params.layers, params.lm_head,
                                                        params.final_norm)))
    assert weight_bytes(CONFIG, 4, shard, quantization) == held
    assert weight_bytes(CONFIG, 4, shard, quantization) < weight_bytes(CONFIG, 4, shard)
    floor = traffic_floor_bytes(CONFIG, [5, 9], [4, 7], dtype_bytes=4,
                                tensor_parallel_size=world_size, quantization=quantization)
    assert floor["weight_bytes"] == held * 7


def test_quantized_bytes_of_qwen3_8b():
    """Per element: AWQ half a byte plus a zero point (half a byte) and an fp16 scale per 128
    inputs; fp8 one byte plus a float32 scale per 128 x 128 block."""
    assert quantized_linear_bytes("awq", 4096, 12288) == 4096 * 12288 * (0.5 + 2.5 / 128)
    assert quantized_linear_bytes("fp8", 4096, 12288) == 4096 * 12288 + 4 * 32 * 96
    config = minivllm.state.config_for_shape("qwen3-8b")
    dense, awq, fp8 = (weight_bytes(config, 2, quantization=q) for q in (None, "awq", "fp8"))
    head = 2 * config.vocab_size * config.hidden_size  # bf16 in every run
    assert (awq - head) / (dense - head) == pytest.approx((0.5 + 2.5 / 128) / 2, rel=1e-3)
    assert (fp8 - head) / (dense - head) == pytest.approx(0.5, rel=1e-3)


@pytest.mark.parametrize("quantization", ["awq", "fp8"])
def test_engine_runs_random_quantized_weights_with_the_dense_only_kernels_off(quantization,
                                                                              tiny_shape):
    llm = minivllm.LLM(f"random:{tiny_shape}:{quantization}", device="cpu", dtype="float32",
                       attention_backend="reference", num_kv_blocks=64, max_model_len=256,
                       enforce_eager=True)
    params = llm.engine.runner.params
    assert all(type(getattr(lp, f)) is KIND[quantization] for lp in params.layers
               for f in AWQ_FIELDS)
    assert llm.config.persistent_decode is False
    assert _quantized_linears({}, llm.config.model_config, quantization)
    greedy = minivllm.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = [{"prompt_token_ids": [1, 2, 3, 4, 5]}]
    first, again = (llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
                    for _ in range(2))
    assert len(first) == 4 and first == again
    # The dense-only persistent decode kernel is refused outright, as for a loaded checkpoint.
    with pytest.raises(ValueError, match="persistent_decode runs 16-bit dense layers"):
        EngineConfig.create(f"random:{tiny_shape}:{quantization}", device="cpu",
                            persistent_decode=True)


# The two bench runs in bf16: on a CPU the linears then take the torch path (dequantize, matmul)
# rather than the Triton interpreter (the engine test above runs the kernels, in float32).
def test_bench_latency_with_awq_records_its_quantization(tiny_shape, tmp_path):
    out = tmp_path / "r.json"
    assert main(["bench", "--shape", tiny_shape, "--quantization", "awq", "--latency",
                 "--device", "cpu", "--dtype", "bfloat16", "--attention-backend", "reference",
                 "--enforce-eager", "--max-input-len", "16", "--max-output-len", "4",
                 "--max-model-len", "64", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["quantization"] == "awq" and result["shape"] == tiny_shape
    assert result["output_tok_per_s"] > 0 and result["persistent_decode"] is False
    # The single stream's floor: its 4 tokens each read the packed weights once and the
    # context so far (16, 17, 18, 19 tokens of 2 layers' K and V, 1 KV head of 128, bf16).
    config = minivllm.state.config_for_shape(tiny_shape)
    kv = sum(16 + j for j in range(4)) * 2 * 2 * 1 * 128 * 2
    assert result["floor_bytes"] == 4 * weight_bytes(config, 2, ShardSpec(), "awq") + kv


def test_bench_throughput_with_fp8_counts_fp8_bytes_in_its_floor(tiny_shape, tmp_path):
    from minivllm.runtime.workload import throughput_workload

    out = tmp_path / "r.json"
    assert main(["bench", "--shape", tiny_shape, "--quantization", "fp8", "--num-seqs", "2",
                 "--max-input-len", "100", "--max-output-len", "100", "--device", "cpu",
                 "--dtype", "bfloat16", "--attention-backend", "reference", "--enforce-eager",
                 "--max-model-len", "256", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    prompts, max_tokens = throughput_workload(2, 100, 100)
    config = minivllm.state.config_for_shape(tiny_shape)
    floor = traffic_floor_bytes(config, [len(p) for p in prompts], max_tokens, dtype_bytes=2,
                                quantization="fp8")
    assert result["quantization"] == "fp8" and result["floor_bytes"] == floor["total_bytes"]
    assert result["floor_bytes"] < traffic_floor_bytes(
        config, [len(p) for p in prompts], max_tokens, dtype_bytes=2)["total_bytes"]
    assert result["output_tokens"] == sum(max_tokens)


@pytest.mark.parametrize("argv, env, match", [
    (["--model", "some/dir", "--quantization", "awq"], None,
     "a checkpoint's config.json decides its own quantization"),
    (["--shape", "qwen3-30b-a3b", "--quantization", "awq"], None,
     "quantized random weights are for dense shapes; qwen3-30b-a3b is a mixture of experts"),
    (["--shape", "qwen3-8b", "--quantization", "fp8"], "dequantize",
     "fp8 weights are kept in fp8 only with MINIVLLM_FP8_WEIGHTS=fp8"),
    (["--shape", "qwen3-8b", "--quantization", "fp8"], None,
     "fp8 weights are kept in fp8 only with MINIVLLM_FP8_WEIGHTS=fp8"),
])
def test_bench_refuses_quantization_it_cannot_measure_before_starting_an_engine(
        argv, env, match, capsys, monkeypatch):
    import minivllm.runtime.llm as llm

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine started")

    monkeypatch.setattr(llm, "LLM", no_engine)
    monkeypatch.setattr("minivllm.state.load.DEFAULT_FP8_WEIGHTS", "dequantize")
    if env is None:
        monkeypatch.delenv("MINIVLLM_FP8_WEIGHTS", raising=False)
    else:
        monkeypatch.setenv("MINIVLLM_FP8_WEIGHTS", env)
    assert main(["bench", *argv]) == 2
    assert match in capsys.readouterr().err


def test_bench_takes_only_the_known_quantizations(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--shape", "qwen3-8b", "--quantization", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_random_model_spec_is_checked_where_the_engine_is_configured(monkeypatch):
    monkeypatch.setenv("MINIVLLM_FP8_WEIGHTS", "fp8")
    assert random_model("random:qwen3-8b") == (minivllm.state.config_for_shape("qwen3-8b"), None)
    assert random_model("random:qwen3-8b:fp8")[1] == "fp8"
    with pytest.raises(ValueError, match="quantization 'int4' is not one of awq, fp8"):
        EngineConfig.create("random:qwen3-0.6b:int4", device="cpu")
    with pytest.raises(ValueError, match="unknown shape 'qwen3-9b'"):
        EngineConfig.create("random:qwen3-9b:awq", device="cpu")
    with pytest.raises(ValueError, match="mixture of experts"):
        EngineConfig.create("random:qwen3-30b-a3b:fp8", device="cpu")


def test_a_trailing_colon_names_no_quantization():
    """"random:SHAPE:" is refused (an empty quantization), not taken as dense weights."""
    from minivllm.runtime.config import random_model

    assert random_model("random:qwen3-0.6b")[1] is None
    with pytest.raises(ValueError, match="quantization '' is not one of"):
        random_model("random:qwen3-0.6b:")


@pytest.mark.parametrize("field, name", [("_AWQ_KERNEL", "MINIVLLM_AWQ_KERNEL"),
                                         ("_FP8_KERNEL", "MINIVLLM_FP8_KERNEL")])
def test_an_unknown_quantized_kernel_is_refused_when_configured(monkeypatch, field, name):
    """MINIVLLM_AWQ_KERNEL / MINIVLLM_FP8_KERNEL outside triton/torch: a ValueError naming the
    variable before any weight is drawn (not a silent torch path)."""
    from minivllm.functional import linear
    from minivllm.runtime.config import EngineConfig

    monkeypatch.setattr(linear, field, "cuda")
    with pytest.raises(ValueError, match=f"{name}='cuda' is not one of"):
        EngineConfig.create("random:qwen3-0.6b", device="cpu")


def test_bench_of_an_awq_checkpoint_counts_its_packed_bytes_in_its_floor(tmp_path):
    """`bench --model` on a quantized checkpoint: the floor's weights are the bytes the engine
    holds (the packed AWQ linears, their zero points and scales), not the dense model's."""
    import torch.utils._pytree as pytree
    from test_awq import write_awq_checkpoint

    from minivllm.runtime.workload import throughput_workload

    path, _ = write_awq_checkpoint(tmp_path / "awq", vocab_size=TINY["vocab_size"])
    out = tmp_path / "r.json"
    assert main(["bench", "--model", str(path), "--num-seqs", "2", "--max-input-len", "100",
                 "--max-output-len", "100", "--device", "cpu", "--dtype", "float32",
                 "--attention-backend", "reference", "--enforce-eager", "--max-model-len", "256",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    params = minivllm.load(str(path), dtype=torch.float32)
    assert isinstance(params.layers[0].qkv, AwqWeight)
    held = sum(t.numel() * t.element_size()
               for t in pytree.tree_leaves((params.layers, params.final_norm, params.lm_head)))
    prompts, max_tokens = throughput_workload(2, 100, 100)
    lens = [len(p) for p in prompts]
    dense = traffic_floor_bytes(params.config, lens, max_tokens, dtype_bytes=4)
    assert result["floor_bytes"] == dense["kv_bytes"] + held * max(max_tokens)
    assert result["floor_bytes"] < dense["total_bytes"]


def test_bench_keeps_its_result_when_measuring_the_bandwidth_runs_out_of_memory(
        tiny_shape, tmp_path, monkeypatch, caplog):
    """The bandwidth copies after the run need 2-4 GiB beside the engine's memory: where they
    do not fit, the result is still written, without the floor's share."""
    from minivllm.runtime import bench

    def no_memory(device):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(bench, "copy_bandwidth", no_memory)
    out = tmp_path / "r.json"
    assert main(["bench", "--shape", tiny_shape, "--latency", "--device", "cpu", "--dtype",
                 "float32", "--attention-backend", "reference", "--enforce-eager",
                 "--max-input-len", "8", "--max-output-len", "3", "--max-model-len", "32",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["output_tok_per_s"] > 0 and result["floor_bytes"] > 0
    assert "floor_fraction" not in result and "read_floor_fraction" not in result
    assert "no memory left to measure the GPU's bandwidth" in caplog.text
