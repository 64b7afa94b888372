"""`minivllm bench --speculative-config JSON`: the config reaches the engine, the result records
it and the timed run's acceptance; a draft model given as random weights of a shape
("random:SHAPE") is drawn with the engine's seed, so that a draft of the target's own shape is
the target itself (every greedy draft accepted: the best case) and another shape's is not (the
worst case); a config that cannot run is refused before an engine starts."""

import json

import pytest
import torch

from minivllm.cli import main
from minivllm.runtime.config import EngineConfig
from minivllm.state.config import SHAPES

# Bench shapes (the workload's prompt ids go up to 10,000): the target, and a smaller draft of
# its vocabulary.
TINY = dict(vocab_size=10_050, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
            num_kv_heads=1, head_dim=32, tie_word_embeddings=False)
SMALLER = dict(TINY, hidden_size=32, intermediate_size=64, num_layers=1, head_dim=16)
OTHER_VOCAB = dict(TINY, vocab_size=10_100)


@pytest.fixture
def shapes(monkeypatch):
    monkeypatch.setitem(SHAPES, "tiny-spec", TINY)
    monkeypatch.setitem(SHAPES, "tiny-spec-draft", SMALLER)
    monkeypatch.setitem(SHAPES, "tiny-spec-vocab", OTHER_VOCAB)


CPU = ["--device", "cpu", "--dtype", "float32", "--attention-backend", "reference",
       "--enforce-eager"]
LATENCY = ["bench", "--shape", "tiny-spec", "--latency", *CPU, "--max-input-len", "16",
           "--max-output-len", "24", "--max-model-len", "64"]


def bench(argv, tmp_path, spec=None):
    out = tmp_path / "r.json"
    extra = ["--speculative-config", json.dumps(spec)] if spec is not None else []
    assert main([*argv, *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_self_draft_of_random_weights_accepts_every_greedy_draft(shapes, tmp_path, capsys):
    spec = {"model": "random:tiny-spec", "num_speculative_tokens": 4}
    result = bench(LATENCY, tmp_path, spec)
    assert result["speculative_config"] == spec
    assert result["async_scheduling"] is False  # speculation turns it off
    # 3 timed streams of 24 tokens (and 3 one-token ones): greedy, all drafts accepted
    assert result["spec_draft_tokens"] > 0 and result["spec_drafts"] > 0
    assert result["spec_accepted_tokens"] == result["spec_draft_tokens"]
    assert result["spec_acceptance"] == 1.0
    assert result["spec_accepted_per_draft"] > 3
    line = capsys.readouterr().out
    assert "speculative (draft model random:tiny-spec, k=4): 100.0% of" in line


def test_the_draft_holds_the_targets_weights_only_at_its_shape(shapes):
    from minivllm import LLM

    kw = dict(device="cpu", dtype="float32", attention_backend="reference", enforce_eager=True,
              max_model_len=64, num_kv_blocks=8, seed=3)
    llm = LLM("random:tiny-spec", speculative_config={"model": "random:tiny-spec",
                                                      "num_speculative_tokens": 2}, **kw)
    runner = llm.engine.runner
    assert torch.equal(runner.draft_params.embed, runner.params.embed)
    assert torch.equal(runner.draft_params.layers[1].down, runner.params.layers[1].down)
    llm = LLM("random:tiny-spec", speculative_config={"model": "random:tiny-spec-draft",
                                                      "num_speculative_tokens": 2}, **kw)
    assert llm.engine.runner.draft_params.config.hidden_size == 32


def test_a_smaller_shapes_draft_is_mostly_rejected(shapes, tmp_path, capsys):
    spec = {"model": "random:tiny-spec-draft", "num_speculative_tokens": 3}
    result = bench(LATENCY, tmp_path, spec)
    assert result["speculative_config"] == spec
    assert result["spec_draft_tokens"] > 0
    assert result["spec_acceptance"] < 1


def test_without_speculation_the_result_says_none(shapes, tmp_path):
    result = bench(LATENCY, tmp_path)
    assert result["speculative_config"] is None
    assert result["spec_draft_tokens"] == 0 and result["spec_acceptance"] is None


def test_ngram_throughput_records_its_acceptance(shapes, tmp_path, capsys):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2,
            "prompt_lookup_min": 1}
    result = bench(["bench", "--shape", "tiny-spec", *CPU, "--num-seqs", "2",
                    "--max-input-len", "100", "--max-output-len", "100", "--max-model-len", "256"],
                   tmp_path, spec)
    assert result["workload"] == "throughput" and result["speculative_config"] == spec
    # random ids over 10,000 and random weights: lookups rarely match, nearly nothing accepted
    assert result["spec_acceptance"] is None or 0 <= result["spec_acceptance"] <= 1
    assert "speculative (n-gram, k=4)" in capsys.readouterr().out


@pytest.mark.parametrize("spec, match", [
    ({"model": "random:tiny-spec-vocab", "num_speculative_tokens": 2}, "vocab_size"),
    ({"model": "random:tiny-spec:awq", "num_speculative_tokens": 2}, "16-bit dense"),
    ({"model": "random:no-such-shape", "num_speculative_tokens": 2}, "no-such-shape"),
    ({"model": "random:qwen3-30b-a3b", "num_speculative_tokens": 2}, "16-bit dense"),
    ({"model": "random:tiny-spec", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"model": "/no/such/dir", "num_speculative_tokens": 2}, "not a checkpoint directory"),
    ({"method": "ngram", "num_speculative_tokens": 2, "foo": 1}, "does not take"),
])
def test_bench_refuses_a_bad_config_before_starting_an_engine(shapes, spec, match, capsys,
                                                              monkeypatch):
    import minivllm.runtime.llm as llm

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine started")

    monkeypatch.setattr(llm, "LLM", no_engine)
    assert main([*LATENCY, "--speculative-config", json.dumps(spec)]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("text", ["{not json", "[1, 2]",
                                  # past any version's C recursion limit (3.12's: 8,000)
                                  '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"])
def test_bench_refuses_what_is_not_a_json_object(text, capsys, monkeypatch):
    import minivllm.runtime.llm as llm

    monkeypatch.setattr(llm, "LLM", lambda *a, **k: pytest.fail("an engine started"))
    with pytest.raises(SystemExit):
        main(["bench", "--latency", "--speculative-config", text])
    assert "--speculative-config" in capsys.readouterr().err


def test_engine_config_takes_a_random_draft_and_checks_it(shapes):
    config = EngineConfig.create("random:tiny-spec", device="cpu", max_model_len=64,
                                 speculative_config={"model": "random:tiny-spec-draft",
                                                     "num_speculative_tokens": 2})
    assert config.speculative.draft_config.hidden_size == 32
    with pytest.raises(ValueError, match="vocab_size"):
        EngineConfig.create("random:tiny-spec", device="cpu", max_model_len=64,
                            speculative_config={"model": "random:tiny-spec-vocab",
                                                "num_speculative_tokens": 2})
