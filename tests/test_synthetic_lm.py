"""benchmarks/synthetic_lm.py: the synthetic language's chain, a tiny model that learns it, and
benchmarks/agreement.py run on the checkpoint it writes (the GPU's agreement check, on the CPU)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.synthetic_lm import (LANGUAGE_FILE, MarkovLanguage, make_language, most_likely_next, sample,
                                     write_trained_checkpoint)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, tie_word_embeddings=True)


def test_language_uses_distinct_ids_and_distinct_successors():
    lang = make_language(vocab_size=500, states=40, seed=3, classes=3)
    assert lang.tokens.unique().numel() == 40 and 0 <= int(lang.tokens.min()) and int(lang.tokens.max()) < 500
    assert lang.successors.shape == (40, 3, 4)
    for row in lang.successors.view(-1, 4):
        assert row.unique().numel() == 4  # so the most likely next token is unique
    assert lang.entropy() == pytest.approx(-sum(p * torch.tensor(p).log().item() for p in (0.7, 0.15, 0.1, 0.05)))


def test_sampled_sequences_follow_the_chain_from_the_current_state_and_the_class_before():
    lang = make_language(vocab_size=300, states=12, seed=1, classes=2)
    ids = sample(lang, batch=64, length=50, generator=torch.Generator().manual_seed(0))
    index = {int(t): i for i, t in enumerate(lang.tokens)}
    states = torch.tensor([[index[int(t)] for t in row] for row in ids])
    modes, total = 0, 0
    for row, row_ids in zip(states, ids):
        want = most_likely_next(lang, row_ids)
        before = 0  # the first state's predecessor counts as class 0
        for i in range(len(row) - 1):
            allowed = lang.successors[row[i], before % 2]
            assert row[i + 1] in allowed
            modes += int(lang.tokens[row[i + 1]] == want[i])
            total += 1
            before = int(row[i])
    assert modes / total == pytest.approx(0.7, abs=0.03)


def test_bad_languages_and_foreign_ids_are_clear_errors():
    with pytest.raises(ValueError, match="states"):
        make_language(vocab_size=10, states=11, seed=0)
    with pytest.raises(ValueError, match="probs"):
        make_language(vocab_size=10, states=5, seed=0, probs=(0.5, 0.4))
    with pytest.raises(ValueError, match="classes"):
        make_language(vocab_size=10, states=5, seed=0, classes=0)
    lang = make_language(vocab_size=100, states=5, seed=0)
    foreign = next(t for t in range(100) if t not in set(lang.tokens.tolist()))
    with pytest.raises(ValueError, match="does not use"):
        most_likely_next(lang, torch.tensor([foreign]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("trained"))
    result = write_trained_checkpoint(path, TINY_SHAPE, states=16, classes=2, steps=150, batch=16,
                                      length=32, lr=3e-3, seed=0, dtype=torch.float32,
                                      device=torch.device("cpu"))
    return path, result


def test_a_tiny_model_learns_the_chain_including_the_class_before(trained):
    from transformers import Qwen3ForCausalLM

    path, result = trained
    assert result["first_loss"] > 4.0 and result["final_loss"] < 1.2  # from ~ln(128) toward 0.91
    lang = MarkovLanguage.load(os.path.join(path, LANGUAGE_FILE))
    model = Qwen3ForCausalLM.from_pretrained(path).eval()
    ids = sample(lang, batch=8, length=32, generator=torch.Generator().manual_seed(9))  # held out
    with torch.no_grad():
        top = model(ids).logits.argmax(-1)
    want = torch.stack([most_likely_next(lang, row) for row in ids])
    learned = (top == want).float().mean().item()
    # The best any predictor that sees only the current token could do: one guess per token,
    # right where that token's mode (set also by the class before) is the guess.
    by_token: dict[int, list[int]] = {}
    for t, m in zip(ids.flatten().tolist(), want.flatten().tolist()):
        by_token.setdefault(t, []).append(m)
    bigram_best = sum(max(ms.count(m) for m in ms) for ms in by_token.values()) / ids.numel()
    assert learned > 0.9 and learned > bigram_best + 0.1, (learned, bigram_best)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_agreement_script_on_the_trained_checkpoint_agrees_everywhere(trained, dtype):
    """In fp32 the logits match to rounding; in bf16 (the GPU's check, here on the reference
    backend) the trained model's margins keep every arg-max where transformers' is."""
    path, _ = trained
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "agreement.py"),
                          "--checkpoint", path, "--positions", "32", "--dtype", dtype,
                          "--engine-prompts", "2", "--max-tokens", "6"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout[out.stdout.rindex("\n{") + 1:])  # the last report
    assert result["checkpoint"] == path and result["language"] and result["positions"] == 32
    for key in ("prefill_top1_agreement", "decode_top1_agreement", "transformers_vs_fp32_top1_agreement"):
        assert result[key] == 1.0, key
    tolerance = 1e-4 if dtype == "float32" else 0.1
    assert result["max_abs_logit_diff_prefill"] < tolerance and result["max_abs_logit_diff_decode"] < tolerance
    assert result["fp32_top1_is_the_chains_mode"] > 0.9
    engine = result["engine_greedy_vs_transformers"]
    assert engine["prompts"] == 2 and engine["identical_sequences"] == 1.0
