"""Audit of LoRA adapter loading and application (state/lora.py, runtime/lora.py,
functional/lora.py), against vLLM's loader (lora/peft_helper.py, lora/lora_model.py,
lora/utils.py) and against transformers' Qwen3 with each adapter merged by hand (test_lora's
oracle).

Bugs found and fixed: a PEFT config that makes the tensors mean something other than plain
LoRA on every token (Activated LoRA's alora_invocation_tokens, QA-LoRA, BD-LoRA, Arrow,
lora_bias) was served as plain LoRA; an adapter with a nan / inf weight, or one whose x @ A
overflows float16, turned the other rows of its batches (other adapters', the base model's)
to nan; a file with two tensors for one module's A (or B) kept one of them silently;
"~/adapter" paths (vLLM expands them) were refused as missing. Guarded here
too, as probed: a regex target_modules and PEFT's "lora_A.default.weight" names against the
merged oracle; an aborted adapter request at max_loras=1 leaves the slot to the next adapter."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm import LoRARequest, SamplingParams
from minivllm.state.lora import load_adapter

from test_lora import (GREEDY, MAX_RANK, NEW, hf_model, lora_llm, merged,  # noqa: F401
                       run, tiny_dir, token_prompts, write_adapter)
from hf_tiny import hf_greedy

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [2, 71, 82, 81, 82, 84, 59, 0, 45]]


def _config(path) -> dict:
    with open(os.path.join(path, "adapter_config.json")) as f:
        return json.load(f)


def _set_config(path, **fields) -> None:
    cfg = {**_config(path), **fields}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)


def _adapter(tmp_path, tiny_dir, name, **spec):  # noqa: F811
    path = str(tmp_path / name)
    weights, scale = write_adapter(path, tiny_dir, **{**dict(r=2, alpha=4, targets=["q_proj",
                                                                                 "down_proj"],
                                                           seed=11), **spec})
    return path, weights, scale


# -- PEFT configs whose tensors are not plain LoRA -------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("alora_invocation_tokens", [7, 8]),
    ("use_qalora", True),
    ("use_bdlora", {"target_modules_bd_a": ["down_proj"], "nblocks": 2}),
    ("arrow_config", {"top_k": 2}),
    ("lora_bias", True),
])
def test_configs_that_change_what_the_tensors_mean_are_refused_before_any_work(
        tiny_dir, tmp_path, field, value):  # noqa: F811
    """An Activated LoRA (PEFT's alora_invocation_tokens) runs the base model on the tokens
    before its invocation sequence; served as plain LoRA every token got the delta, and the
    adapter loaded without a word. QA-LoRA, BD-LoRA, Arrow and lora_bias are other variants
    whose outputs plain LoRA does not give. Each is a ValueError naming the field, for the whole
    call, before anything runs."""
    path, _, _ = _adapter(tmp_path, tiny_dir, field)
    _set_config(path, **{field: value})
    good, _, _ = _adapter(tmp_path, tiny_dir, "good")
    with pytest.raises(ValueError, match=field):
        load_adapter(path, _model_config(tiny_dir), MAX_RANK)
    llm = lora_llm(tiny_dir, max_loras=1)
    with pytest.raises(ValueError, match=field):
        llm.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False,
                     lora_request=[LoRARequest("good", 1, good), LoRARequest("bad", 2, path)])
    assert not llm.engine.requests and not llm.engine.scheduler.has_unfinished()
    assert not llm.engine.loras.slot_of
    # Empty or false values are PEFT's defaults: a plain LoRA adapter.
    _set_config(path, **{field: [] if isinstance(value, list) else
                         {} if isinstance(value, dict) else False})
    load_adapter(path, _model_config(tiny_dir), MAX_RANK)


def _model_config(tiny_dir):  # noqa: F811
    import minivllm
    return minivllm.load(tiny_dir).config


# -- weights that would spoil other rows --------------------------------------------------------


def test_non_finite_weights_are_refused_before_any_work(tiny_dir, tmp_path):  # noqa: F811
    """A row's delta multiplies every slot's B by zeros but its own slot's, and 0 * nan is nan:
    an adapter with a nan (or inf) weight loaded fine and turned every row of its batches to
    nan, the base model's and the other adapters' too (vLLM's kernels read only a row's own
    adapter, so there it spoils only its own requests). Now a ValueError naming the weight;
    so is a lora_alpha of Infinity, and, given the slots' dtype, a scaled B past its range."""
    config = _model_config(tiny_dir)
    good, _, _ = _adapter(tmp_path, tiny_dir, "good")
    llm = lora_llm(tiny_dir, max_loras=2)
    for k, (which, value) in enumerate([("lora_B", float("nan")), ("lora_A", float("inf"))]):
        path, _, _ = _adapter(tmp_path, tiny_dir, f"bad{k}")
        file = os.path.join(path, "adapter_model.safetensors")
        tensors = load_file(file)
        tensors[f"base_model.model.model.layers.0.self_attn.q_proj.{which}.weight"][1, 0] = value
        save_file(tensors, file)
        match = rf"layer 0's q_proj {which} holds nan or inf"
        with pytest.raises(ValueError, match=match):
            load_adapter(path, config, MAX_RANK)
        with pytest.raises(ValueError, match=match):
            llm.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False,
                         lora_request=[LoRARequest("good", 1, good),
                                       LoRARequest("bad", 2 + k, path)])
        assert not llm.engine.requests and not llm.engine.loras.slot_of
    _set_config(good, lora_alpha=float("inf"))
    with pytest.raises(ValueError, match="lora_alpha inf is not finite"):
        load_adapter(good, config, MAX_RANK)
    _set_config(good, lora_alpha=4e6)  # B (std 0.3) times 2e6: past float16's 65504
    with pytest.raises(ValueError, match=r"lora_B reaches .* \(times the scale\), past "
                                         r"torch\.float16"):
        load_adapter(good, config, MAX_RANK, dtype=torch.float16)
    load_adapter(good, config, MAX_RANK, dtype=torch.bfloat16)
    load_adapter(good, config, MAX_RANK)


def test_a_slots_overflow_stays_out_of_the_other_rows():
    """lora_delta computes every slot's x @ A for every row and keeps the row's own: a slot
    whose projection overflows float16 (inf) gave the other rows inf * 0 = nan, the base
    rows included. They now get exactly what they get with that slot empty."""
    from minivllm.functional.lora import lora_delta, slot_mask

    g = torch.Generator().manual_seed(0)
    r, n_in, n_out = 2, 64, 8
    x = torch.randn(3, n_in, generator=g).half()
    a = (torch.randn(2 * r, n_in, generator=g) * 0.1).half()
    a[r:] = 60000.0  # slot 1: x @ A far past float16's range
    b = (torch.randn(n_out, 2 * r, generator=g) * 0.1).half()
    mask = slot_mask(torch.tensor([0, -1, 1]), 2, torch.float16)
    got = lora_delta(x, a, b, mask)
    assert not torch.isfinite(got[2]).all()  # the overflowing slot's own row: its problem
    empty = a.clone()
    empty[r:] = 0
    want = lora_delta(x, empty, b, mask)
    assert torch.isfinite(got[:2]).all()
    assert torch.equal(got[:2], want[:2]) and not want[1].any()


# -- tensor names ------------------------------------------------------------------------------


def test_two_tensors_for_one_lora_weight_are_refused(tiny_dir, tmp_path):  # noqa: F811
    """PEFT writes lora_A.weight (an adapter name, lora_A.default.weight, is accepted too). A
    file holding both names for one module, or two adapter names, kept whichever came last
    and dropped the other silently: now a ValueError naming the tensor."""
    path, _, _ = _adapter(tmp_path, tiny_dir, "dup")
    file = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(file)
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    tensors[key.replace("lora_A.weight", "lora_A.default.weight")] = 2 * tensors[key]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj\.lora_A.*second lora_A"):
        load_adapter(path, _model_config(tiny_dir), MAX_RANK)
    # Two adapter names, no plain name.
    tensors = {k.replace(".weight", ".one.weight"): v for k, v in load_file(file).items()
               if ".default." not in k}
    tensors.update({k.replace(".one.", ".two."): 2 * v for k, v in tensors.items()})
    save_file(tensors, file)
    with pytest.raises(ValueError, match="second lora_"):
        load_adapter(path, _model_config(tiny_dir), MAX_RANK)


def test_regex_targets_and_adapter_named_tensors_equal_the_merged_model(
        tiny_dir, hf_model, tmp_path):  # noqa: F811
    """target_modules as PEFT's regex string (vLLM's is_regex_target_modules) with tensors
    named lora_A.default.weight: the engine's greedy tokens are the merged model's."""
    path, weights, scale = _adapter(tmp_path, tiny_dir, "regex", r=3, alpha=5,
                                    targets=["k_proj", "o_proj", "up_proj"], rslora=True)
    _set_config(path, target_modules=r".*\.(k_proj|o_proj|up_proj)$")
    file = os.path.join(path, "adapter_model.safetensors")
    save_file({k.replace(".weight", ".default.weight"): v for k, v in load_file(file).items()},
              file)
    oracle = merged(hf_model, weights, scale)
    llm = lora_llm(tiny_dir, max_loras=1)
    want = [hf_greedy(oracle, p, NEW) for p in PROMPTS]
    assert want != [hf_greedy(hf_model, p, NEW) for p in PROMPTS]
    assert run(llm, PROMPTS, LoRARequest("regex", 1, path)) == want


# -- paths -------------------------------------------------------------------------------------


def test_a_home_relative_path_is_expanded_and_a_file_is_named(tiny_dir, hf_model, tmp_path,
                                                               monkeypatch):  # noqa: F811
    """vLLM resolves lora_path "~/..." (get_adapter_absolute_path: os.path.expanduser); it was
    refused here as "no such directory". A path that is a file says so."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    _, weights, scale = _adapter(home, tiny_dir, "mine")
    llm = lora_llm(tiny_dir, max_loras=1)
    got = run(llm, PROMPTS[:1], LoRARequest("mine", 1, "~/mine"))
    assert got == [hf_greedy(merged(hf_model, weights, scale), PROMPTS[0], NEW)]
    with pytest.raises(ValueError, match="a file, not a directory"):
        run(llm, PROMPTS[:1], LoRARequest("file", 2, str(home / "mine" / "adapter_config.json")))
    with pytest.raises(ValueError, match="no such directory"):
        run(llm, PROMPTS[:1], LoRARequest("none", 3, "~/missing"))


# -- slots -------------------------------------------------------------------------------------


def test_an_aborted_adapter_request_frees_its_slot_for_the_next(tiny_dir, hf_model,
                                                                tmp_path):  # noqa: F811
    """max_loras=1: a request of adapter X aborted mid-decode; the next call's adapter Y gets
    the slot and Y's own outputs, and X's again after it."""
    x, wx, sx = _adapter(tmp_path, tiny_dir, "x", targets="all-linear", r=4, seed=21)
    y, wy, sy = _adapter(tmp_path, tiny_dir, "y", seed=22)
    rx, ry = LoRARequest("x", 1, x), LoRARequest("y", 2, y)
    llm = lora_llm(tiny_dir, max_loras=1)
    engine = llm.engine
    ids = engine.add_requests(token_prompts(PROMPTS[:1]),
                              [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)],
                              lora_requests=[rx])
    engine.step()
    engine.step()
    engine.abort_request(ids[0])
    while engine.scheduler.has_unfinished():
        engine.step()
    assert run(llm, PROMPTS, ry) == [hf_greedy(merged(hf_model, wy, sy), p, NEW) for p in PROMPTS]
    assert run(llm, PROMPTS[1:], rx) == [hf_greedy(merged(hf_model, wx, sx), PROMPTS[1], NEW)]
