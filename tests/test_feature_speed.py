"""benchmarks/feature_speed.py runs every feature it names over the same prompts, and each
decodes the same number of tokens (so that their tok/s compare): ignore_eos with fixed lengths,
n4 over a quarter of the prompts, beam4's beams over a quarter."""

import json

import pytest
from hf_tiny import make_hf_model, save_checkpoint

from benchmarks.feature_speed import feature_params, main


def test_every_feature_decodes_the_same_tokens(tmp_path):
    path = save_checkpoint(make_hf_model(vocab_size=300), tmp_path / "model")
    out = tmp_path / "r.json"
    assert main(["--model", path, "--num-seqs", "4", "--prompt-len", "8", "--output-len", "3",
                 "--device", "cpu", "--enforce-eager", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    results = written["results"]
    assert 0 < written["engine_start_s"] < sum(r["seconds"] for r in results) + 600
    names = [r["feature"] for r in results]
    # plain sampling first and last, every other feature once between
    assert names[0] == names[-1] == "sample"
    assert sorted(names[1:-1]) == sorted(set(feature_params(300, 3)) - {"sample"})
    assert all(r["output_tokens"] == 4 * 3 for r in results), results
    assert results[0]["ratio_to_plain"] == 1.0
    assert all(r["cuda_mallocs"] is None for r in results)  # counted on CUDA only
    # Prompts of 8 tokens fill no block: nothing to find cached (beam search counts none).
    assert {r["feature"] for r in results if r["cached_prompt_share"] is None} == {"beam4"}
    assert all(r["cached_prompt_share"] == 0 for r in results if r["feature"] != "beam4")


def test_an_unknown_feature_is_refused_before_the_engine_starts(tmp_path):
    with pytest.raises(ValueError, match="unknown features \\['nucleus'\\]"):
        main(["--model", str(tmp_path / "no-such-model"), "--features", "greedy,nucleus"])


def test_lora_runs_every_request_with_the_random_adapter(tmp_path):
    """--lora-rank: the engine takes the adapter written for the model's shape, and the lora
    feature's requests run with it: their greedy tokens differ from the base model's."""
    import minivllm
    from benchmarks.feature_speed import write_random_adapter

    path = save_checkpoint(make_hf_model(vocab_size=300), tmp_path / "model")
    out = tmp_path / "r.json"
    # Outputs long enough to fill blocks of their own, many enough to evict (session 68 found
    # the adapter's run at 36% of its prompts cached on the H200; here 80% without the priming)
    assert main(["--model", path, "--num-seqs", "32", "--prompt-len", "128", "--output-len",
                 "64", "--device", "cpu", "--enforce-eager", "--lora-rank", "4",
                 "--features", "greedy,lora", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["feature"] for r in results] == ["sample", "greedy", "lora", "sample"]
    assert all(r["output_tokens"] == 32 * 64 for r in results)
    # Every timed run finds its prompts' full blocks (all but the last of 128 tokens' 8, which
    # the prompt's last token is computed in) in the prefix cache, the base model's and the
    # adapter's alike: the runs differ by their decode steps only.
    assert [r["cached_prompt_share"] for r in results] == [112 / 128] * 4
    llm = minivllm.LLM(path, device="cpu", enforce_eager=True, enable_lora=True,
                       max_lora_rank=4)
    adapter = write_random_adapter(str(tmp_path / "lora"), llm.engine.model_config, 4)
    # a large scale, so that the delta moves the greedy tokens of a random tiny model
    cfg = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 4000
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps(cfg))
    prompt = [{"prompt_token_ids": list(range(10, 30))}]
    greedy = minivllm.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    tuned = llm.generate(prompt, greedy, use_tqdm=False,
                         lora_request=minivllm.LoRARequest("a", 1, adapter))[0].outputs[0].token_ids
    assert list(base) != list(tuned)
