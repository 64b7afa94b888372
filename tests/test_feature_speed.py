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
    results = json.loads(out.read_text())["results"]
    names = [r["feature"] for r in results]
    # plain sampling first and last, every other feature once between
    assert names[0] == names[-1] == "sample"
    assert sorted(names[1:-1]) == sorted(set(feature_params(300, 3)) - {"sample"})
    assert all(r["output_tokens"] == 4 * 3 for r in results), results
    assert results[0]["ratio_to_plain"] == 1.0


def test_an_unknown_feature_is_refused_before_the_engine_starts(tmp_path):
    with pytest.raises(ValueError, match="unknown features \\['nucleus'\\]"):
        main(["--model", str(tmp_path / "no-such-model"), "--features", "greedy,nucleus"])
