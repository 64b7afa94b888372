"""YaRN RoPE scaling (Qwen3's long context) and hf_overrides (vLLM's): the inverse frequencies
and attention scale equal transformers' for each of YaRN's options; the engine scores prompts
past original_max_position_embeddings as transformers does, through the reference attention, the
Triton kernels and the persistent decode's stem kernel; an override of a checkpoint without
YaRN is the checkpoint with it; max_model_len defaults to original x factor (vLLM's); bad values
are refused at load."""

from __future__ import annotations

import json

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.functional.rope import rope_attention_scale, rope_cos_sin, rope_inv_freq
from minivllm.kernels.decode_stem import decode_stem
from minivllm.state.config import ModelConfig

from engine_helpers import make_llm
from hf_tiny import hf_config, make_hf_model, save_checkpoint

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0}


def yarn_model(**scaling):
    return make_hf_model(seed=2, std=0.3, max_position_embeddings=256,
                         rope_parameters={**YARN, **scaling})


@pytest.fixture(scope="module")
def hf_yarn():
    return yarn_model()


@pytest.fixture(scope="module")
def yarn_dir(hf_yarn, tmp_path_factory):
    return save_checkpoint(hf_yarn, tmp_path_factory.mktemp("yarn") / "model", layout="v4")


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(4)
    return torch.randint(0, 101, (200,), generator=g).tolist()  # past 64 positions, to 199


@pytest.mark.parametrize("scaling", [
    {}, {"factor": 2.5}, {"beta_fast": 16, "beta_slow": 2}, {"truncate": False},
    {"attention_factor": 0.8}, {"mscale": 1.0, "mscale_all_dim": 0.5},
    {"original_max_position_embeddings": 100}, {"beta_fast": 4, "beta_slow": 4, "truncate": False}])
def test_frequencies_and_scale_equal_transformers(scaling, tmp_path):
    model = yarn_model(**scaling)
    ours = ModelConfig.from_json(save_checkpoint(model, tmp_path / "m"))
    assert torch.equal(rope_inv_freq(ours), model.model.rotary_emb.inv_freq)
    assert rope_attention_scale(ours) == pytest.approx(model.model.rotary_emb.attention_scaling,
                                                       rel=1e-12)
    positions = torch.arange(0, 256)
    cos, sin = rope_cos_sin(ours, positions)
    want_cos, want_sin = model.model.rotary_emb(torch.zeros(1, 1, 1), positions[None])
    torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=1e-6)


def test_both_config_layouts_read_alike(hf_yarn, yarn_dir, tmp_path):
    v5 = ModelConfig.from_json(save_checkpoint(hf_yarn, tmp_path / "v5"))
    assert v5 == ModelConfig.from_json(yarn_dir)
    assert v5.rope_scaling_dict["rope_type"] == "yarn" and v5.rope_theta == 10000.0
    assert v5.max_context_len == 64 * 4


def scores(llm, prompt):
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return [e[t].logprob for t, e in zip(prompt[1:], out.prompt_logprobs[1:])]


def reference_scores(model, prompt):
    with torch.no_grad():
        lps = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    return [lps[i - 1, t].item() for i, t in enumerate(prompt) if i]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_prompts_past_the_original_context_score_as_transformers(hf_yarn, yarn_dir, device,
                                                                 prompt, backend):
    from minivllm.kernels import available_backends

    if backend not in available_backends(device):
        pytest.skip(f"no {backend} backend on this device")
    llm = make_llm(yarn_dir, device, attention_backend=backend, block_size=16)
    assert llm.config.max_model_len == 256  # original 64 x factor 4
    assert scores(llm, prompt) == pytest.approx(reference_scores(hf_yarn, prompt), abs=2e-4)


def test_greedy_decoding_past_the_original_context_equals_transformers(hf_yarn, yarn_dir, device,
                                                                        prompt):
    """Decode steps of one row through the persistent decode (its stem kernel computes cos and
    sin, times YaRN's scale) where Triton runs, else the usual layers."""
    from minivllm.kernels import available_backends

    kw = {}
    if "triton" in available_backends(device):
        kw = dict(attention_backend="triton", persistent_decode=True)
    llm = make_llm(yarn_dir, device, block_size=16, **kw)
    got = llm.generate([{"prompt_token_ids": prompt[:120]}], SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        # An explicit mask: without one generate takes the prompt's 0 ids for padding.
        want = hf_yarn.generate(torch.tensor([prompt[:120]]), max_new_tokens=8, do_sample=False,
                                attention_mask=torch.ones(1, 120, dtype=torch.long),
                                eos_token_id=None, pad_token_id=0)[0, 120:].tolist()
    assert got == want


def test_the_stem_kernel_scales_cos_and_sin(device):
    config = ModelConfig.from_dict({**hf_config(max_position_embeddings=256).to_dict(),
                                    "rope_parameters": YARN})
    inv_freq = rope_inv_freq(config, device)
    positions = torch.tensor([0, 63, 64, 255], device=device)
    ids = torch.tensor([1, 2, 3, 4], device=device)
    embed = torch.randn(101, 64, device=device)
    _, _, cos, sin = decode_stem(ids, positions, embed, inv_freq, scale=rope_attention_scale(config))
    want_cos, want_sin = rope_cos_sin(config, positions)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=2e-6)


def test_hf_overrides_turn_yarn_on(hf_yarn, device, prompt, tmp_path):
    """The same weights saved without YaRN, and YaRN asked for through hf_overrides: as the
    checkpoint with it. The override merges into the file's rope_parameters (rope_theta kept)."""
    plain_model = make_hf_model(seed=2, std=0.3, max_position_embeddings=256,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    plain_model.load_state_dict(hf_yarn.state_dict())
    plain = save_checkpoint(plain_model, tmp_path / "plain")
    scaling = {k: v for k, v in YARN.items() if k != "rope_theta"}
    llm = make_llm(plain, device, hf_overrides={"rope_parameters": scaling})
    assert llm.config.model_config.rope_theta == 10000.0
    assert scores(llm, prompt) == pytest.approx(reference_scores(hf_yarn, prompt), abs=2e-4)
    # vLLM's other spelling, rope_scaling, does the same.
    same = make_llm(plain, device, hf_overrides={"rope_scaling": scaling})
    assert same.config.model_config == llm.config.model_config
    # Without the override the positions past 64 score otherwise.
    assert scores(make_llm(plain, device), prompt) != pytest.approx(scores(llm, prompt), abs=2e-4)


@pytest.mark.parametrize("scaling, match", [
    ({"factor": "4"}, "factor"),
    ({"factor": -1.0}, "factor"),
    ({"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ({"original_max_position_embeddings": 10.5}, "original_max_position_embeddings"),
    ({"beta_fast": -2}, "beta_fast"),
    ({"attention_factor": float("inf")}, "attention_factor"),
    ({"truncate": "yes"}, "truncate"),
    ({"rope_type": "longrope"}, "unsupported rope scaling type 'longrope'"),
])
def test_bad_yarn_values_are_refused(yarn_dir, scaling, match):
    with pytest.raises(ValueError, match=match):
        LLM(yarn_dir, device="cpu", num_kv_blocks=8, hf_overrides={"rope_scaling": scaling})


def test_max_model_len_is_bounded_by_yarns_context(yarn_dir):
    with pytest.raises(ValueError, match="YaRN.*256"):
        LLM(yarn_dir, device="cpu", num_kv_blocks=8, max_model_len=257)
    with pytest.raises(ValueError, match="hf_overrides must be a dict"):
        LLM(yarn_dir, device="cpu", num_kv_blocks=8, hf_overrides=[("rope_scaling", None)])


def test_the_cli_takes_rope_scaling(hf_yarn, tmp_path, capsys, monkeypatch):
    """--rope-scaling JSON and --hf-overrides JSON reach LLM as its hf_overrides (which
    test_hf_overrides_turn_yarn_on checks); a value that is not a JSON object is refused."""
    from minivllm import cli

    plain_model = make_hf_model(seed=2, std=0.3, max_position_embeddings=256,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    plain_model.load_state_dict(hf_yarn.state_dict())
    plain = save_checkpoint(plain_model, tmp_path / "plain")
    seen = []
    real = LLM.__init__

    def spy(self, model, **kw):
        seen.append(kw.get("hf_overrides"))
        raise SystemExit(0)  # the flag reached LLM: no need to run it

    monkeypatch.setattr(LLM, "__init__", spy)
    scaling = {k: v for k, v in YARN.items() if k != "rope_theta"}
    for flags in (["--rope-scaling", json.dumps(scaling)],
                  ["--hf-overrides", json.dumps({"rope_scaling": scaling})]):
        with pytest.raises(SystemExit):
            cli.main(["generate", "--model", plain, *flags, "--max-tokens", "2"])
    assert seen == [{"rope_scaling": scaling}] * 2
    monkeypatch.setattr(LLM, "__init__", real)
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", plain, "--rope-scaling", "[1]"])
    assert e.value.code == 2 and "a JSON object is needed" in capsys.readouterr().err
