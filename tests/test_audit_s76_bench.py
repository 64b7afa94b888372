"""Audit of `minivllm bench` (session 76): its workload against an independent re-drawing of
nano-vllm's bench.py, its memory-traffic floor against a count by hand, what the throughput and
latency runs time, and the flags and output paths it must refuse before an engine starts."""

from __future__ import annotations

import datetime
import json
import random
import types

import pytest

from minivllm.cli import main


def nano_vllm_draws(num_seqs=256, max_input_len=1024, max_ouput_len=1024):
    """nano-vllm's bench.py, its draws as written there: the module-level generator."""
    from random import randint, seed

    state = random.getstate()
    try:
        seed(0)
        prompt_token_ids = [[randint(0, 10000) for _ in range(randint(100, max_input_len))]
                            for _ in range(num_seqs)]
        max_tokens = [randint(100, max_ouput_len) for _ in range(num_seqs)]
    finally:
        random.setstate(state)
    return prompt_token_ids, max_tokens


@pytest.mark.parametrize("cut", [(256, 1024, 1024), (4, 120, 110), (7, 100, 300)])
def test_the_workload_is_nano_vllms_draws(cut):
    from minivllm.runtime.workload import throughput_workload

    assert throughput_workload(*cut) == nano_vllm_draws(*cut)


def test_the_full_workload_has_nano_vllms_token_counts():
    prompts, max_tokens = nano_vllm_draws()
    assert (sum(map(len, prompts)), sum(max_tokens)) == (142_827, 133_966)


def test_the_floor_of_a_real_shape_against_a_count_by_hand():
    """qwen3-0.6b (tied head), bf16: the weights a decode step reads are every decoder layer's
    (QKV, o_proj, gate/up, down, two norms, q/k norms), the final norm and the head; each output
    token j of a sequence with a p-token prompt reads p + j positions of K and V."""
    from minivllm.runtime.workload import traffic_floor_bytes
    from minivllm.state.config import config_for_shape

    c = config_for_shape("qwen3-0.6b")
    h, inter, hd = c.hidden_size, c.intermediate_size, c.head_dim
    layer = ((c.num_heads + 2 * c.num_kv_heads) * hd * h + h * c.num_heads * hd
             + 3 * inter * h + 2 * h + 2 * hd)
    step = 2 * (c.num_layers * layer + h + c.vocab_size * h)
    assert step == 1_192_099_840  # 596M parameters read a step (the embedding as the head)
    prompts, max_tokens = nano_vllm_draws(16, 300, 200)
    kv_token = 2 * 2 * c.num_layers * c.num_kv_heads * hd
    kv = sum(kv_token * (len(p) + j) for p, n in zip(prompts, max_tokens) for j in range(n))
    floor = traffic_floor_bytes(c, [len(p) for p in prompts], max_tokens)
    assert floor["kv_bytes"] == kv
    assert floor["weight_bytes"] == step * max(max_tokens)
    assert floor["total_bytes"] == kv + step * max(max_tokens)


def _no_engine(monkeypatch):
    import minivllm.runtime.llm as llm

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine started")

    monkeypatch.setattr(llm, "LLM", no_engine)


@pytest.mark.parametrize("flag", ["--json", "--step-times", "--trace"])
def test_an_output_path_that_is_a_directory_is_refused_before_the_run(flag, tmp_path, capsys,
                                                                      monkeypatch):
    """The folder around it is writable, but open(path, "w") fails on a directory: the check
    passed it, and the finished run's result was lost to an IsADirectoryError."""
    _no_engine(monkeypatch)
    target = tmp_path / "out"
    target.mkdir()
    assert main(["bench", "--shape", "qwen3-0.6b", flag, str(target)]) == 2
    assert f"{flag} {target}" in capsys.readouterr().err


@pytest.mark.parametrize("backend, match", [("flashattn", "unknown attention backend"),
                                            ("flash_attn", "not available on cpu")])
def test_an_unusable_attention_backend_is_refused_before_the_weights(backend, match, capsys,
                                                                     monkeypatch):
    """It was named only once the weights had loaded (seconds for a small shape; far more for
    an 8B checkpoint): EngineConfig now names it, before the runner makes any weight."""
    import minivllm.runtime.runner as runner

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were made")

    monkeypatch.setattr(runner, "load", no_weights)
    monkeypatch.setattr(runner, "random_params", no_weights)
    assert main(["bench", "--shape", "qwen3-0.6b", "--attention-backend", backend]) == 2
    err = capsys.readouterr().err
    assert match in err and backend in err


@pytest.mark.parametrize("argv, match", [
    (["--num-seqs", "-3"], "num_seqs -3"),
    (["--max-output-len", "-1"], "max_output_len"),
    (["--latency", "--max-input-len", "0"], "--max-input-len must be at least 1"),
])
def test_negative_counts_are_refused_before_an_engine_starts(argv, match, capsys, monkeypatch):
    _no_engine(monkeypatch)
    assert main(["bench", "--shape", "qwen3-0.6b", *argv]) == 2
    assert match in capsys.readouterr().err


def test_an_unknown_shape_is_refused_listing_the_shapes(capsys):
    from minivllm.state.config import SHAPES

    with pytest.raises(SystemExit) as e:
        main(["bench", "--shape", "qwen3-9b"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "qwen3-9b" in err and all(name in err for name in SHAPES)


@pytest.fixture(scope="module")
def wide_vocab_model(tmp_path_factory):
    """A tiny checkpoint whose vocabulary takes the workload's ids (up to 10,000)."""
    from hf_tiny import make_hf_model, save_checkpoint

    return save_checkpoint(make_hf_model(vocab_size=10_001),
                           tmp_path_factory.mktemp("bench") / "model")


def test_the_throughput_run_passes_nano_vllms_requests_and_writes_its_json(
        wide_vocab_model, tmp_path, monkeypatch, capsys):
    """One warm-up request, then one generate() of the drawn prompts as token ids, each with
    temperature 0.6, ignore_eos and its drawn max_tokens; the JSON's fields, types and values."""
    from minivllm.runtime import llm as llm_module

    calls = []
    real_generate = llm_module.LLM.generate

    def generate(self, prompts, params=None, **kw):
        calls.append((prompts, params))
        return real_generate(self, prompts, params, **kw)

    monkeypatch.setattr(llm_module.LLM, "generate", generate)
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "reference")
    out = tmp_path / "r.json"
    assert main(["bench", "--model", wide_vocab_model, "--num-seqs", "3", "--max-input-len",
                 "120", "--max-output-len", "110", "--max-model-len", "512", "--dtype",
                 "float32", "--device", "cpu", "--json", str(out)]) == 0
    prompts, max_tokens = nano_vllm_draws(3, 120, 110)
    assert len(calls) == 2 and len(calls[0][0]) == 1  # the warm-up, then the timed run
    timed, params = calls[1]
    assert timed == [{"prompt_token_ids": p} for p in prompts]
    assert [(p.temperature, p.ignore_eos, p.max_tokens) for p in params] == [
        (0.6, True, m) for m in max_tokens]
    result = json.loads(out.read_text())
    assert result["workload"] == "throughput"
    assert result["output_tokens"] == sum(max_tokens) and type(result["output_tokens"]) is int
    assert isinstance(result["seconds"], float) and result["seconds"] > 0
    assert result["output_tok_per_s"] == pytest.approx(sum(max_tokens) / result["seconds"])
    assert result["device"] == "cpu" and result["tensor_parallel_size"] == 1
    assert result["shape"] is None and result["model"] == wide_vocab_model
    assert result["backend"] == "reference"
    assert result["date"] == datetime.date.today().isoformat()
    printed = capsys.readouterr().out
    assert f"{sum(max_tokens)} output tokens in {result['seconds']:.2f} s" in printed


def test_latency_times_from_submission_not_the_prompts_drawing(wide_vocab_model, monkeypatch):
    """run_latency's clock against a fake one that only the prompt's random draws advance (1 s
    a token): the time to first token and the stream's time were taken before the prompt was
    drawn, so they counted drawing its ids (about 80 us for 512 on a CPU) as the model's time.
    Every prompt is prompt_len fresh ids; the TTFT request asks for one token."""
    from minivllm import LLM
    from minivllm.runtime import bench

    clock = [0.0]

    class SlowRandom(random.Random):
        def randrange(self, *args):
            clock[0] += 1.0
            return super().randrange(*args)

    monkeypatch.setattr(bench, "random", types.SimpleNamespace(Random=SlowRandom))
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    llm = LLM(wide_vocab_model, device="cpu", dtype="float32", attention_backend="reference",
              max_model_len=256, max_num_seqs=2)
    seen = []
    real_generate = llm.generate

    def generate(prompts, params=None, **kw):
        seen.append((prompts[0]["prompt_token_ids"], params.max_tokens))
        return real_generate(prompts, params, **kw)

    llm.generate = generate
    result = bench.run_latency(llm, prompt_len=20, output_len=4, repeats=2)
    assert result["ttft_s"] < 1.0, result["ttft_s"]
    assert [n for _, n in seen] == [8, 4, 1, 4, 1, 4]  # warm-up, untimed, 2 x (TTFT, stream)
    assert all(len(ids) == 20 for ids, _ in seen)
    assert len({tuple(ids) for ids, _ in seen}) == len(seen)  # none served by the prefix cache
