"""generation_config.json's sampling defaults (vLLM's generation_config="auto"): they apply to
requests that pass no SamplingParams, never to those that pass one; "vllm" turns them off; bad
values are named at construction."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from minivllm import LLM, SamplingParams
from minivllm.cli import main
from minivllm.runtime.demo import ensure_demo_model

from engine_helpers import small_cli_engines
from hf_tiny import make_hf_model, save_checkpoint

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}


def write_generation_config(directory, **values) -> None:
    path = os.path.join(directory, "generation_config.json")
    with open(path) as f:
        gen = json.load(f)
    gen.update(values)
    with open(path, "w") as f:
        json.dump(gen, f)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return save_checkpoint(make_hf_model(seed=3), tmp_path_factory.mktemp("gen") / "plain")


@pytest.fixture(scope="module")
def qwen_like_dir(plain_dir, tmp_path_factory):
    """The checkpoint with a generation_config.json shaped like Qwen3's (plus max_new_tokens)."""
    path = str(tmp_path_factory.mktemp("gen") / "qwen_like")
    shutil.copytree(plain_dir, path)
    write_generation_config(path, do_sample=True, temperature=0.6, top_p=0.95, top_k=20,
                            max_new_tokens=7, min_p=None)
    return path


def make(path, device, **kw):
    return LLM(path, device=device, num_kv_blocks=32, block_size=4, max_num_seqs=4,
               max_num_batched_tokens=64, enforce_eager=device.type == "cuda",
               attention_backend="reference" if device.type == "cpu" else None, **kw)


def tokens(outputs):
    return [c.token_ids for o in outputs for c in o.outputs]


QWEN_DEFAULTS = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_tokens=7)


def test_requests_without_params_take_the_models_defaults(qwen_like_dir, device):
    llm = make(qwen_like_dir, device)
    assert llm.get_default_sampling_params() == QWEN_DEFAULTS  # the null min_p is left out
    assert llm.get_diff_sampling_param() == dict(temperature=0.6, top_p=0.95, top_k=20, max_tokens=7)
    got = tokens(llm.generate([PROMPT] * 3, use_tqdm=False))
    # The same engine seed draws the same request seeds: the explicit params give the same tokens.
    want = tokens(make(qwen_like_dir, device).generate([PROMPT] * 3, QWEN_DEFAULTS, use_tqdm=False))
    assert got == want and all(len(t) == 7 for t in got)
    streamed: dict[str, list[int]] = {}
    for delta in make(qwen_like_dir, device).stream([PROMPT] * 3):
        streamed.setdefault(delta.request_id, []).extend(tokens([delta])[0])
    assert [streamed[i] for i in sorted(streamed, key=int)] == want


def test_a_request_that_passes_params_gets_exactly_those(qwen_like_dir, plain_dir, device):
    # Sampled at temperature 1 with no top-k / top-p: a field filled in from the file (top_k 20,
    # temperature 0.6) would change the draws.
    plain = SamplingParams(seed=1, max_tokens=12, ignore_eos=True)
    got = tokens(make(qwen_like_dir, device).generate([PROMPT] * 4, plain, use_tqdm=False))
    assert got == tokens(make(plain_dir, device).generate([PROMPT] * 4, plain, use_tqdm=False))
    assert got != tokens(make(plain_dir, device).generate(
        [PROMPT] * 4, SamplingParams(seed=1, max_tokens=12, ignore_eos=True, temperature=0.6,
                                     top_p=0.95, top_k=20), use_tqdm=False))


def test_vllm_turns_the_defaults_off(qwen_like_dir, plain_dir, device):
    off = make(qwen_like_dir, device, generation_config="vllm")
    assert off.get_default_sampling_params() == SamplingParams() and off.get_diff_sampling_param() == {}
    plain = make(plain_dir, device)  # transformers writes no sampling keys
    assert plain.get_default_sampling_params() == SamplingParams()
    got = tokens(off.generate([PROMPT], use_tqdm=False))
    assert got == tokens(plain.generate([PROMPT], use_tqdm=False))
    assert len(got[0]) == SamplingParams().max_tokens or got[0][-1] in off.engine.eos_ids


def test_a_directory_and_an_override(qwen_like_dir, plain_dir, device):
    from_dir = make(plain_dir, device, generation_config=qwen_like_dir)
    assert from_dir.get_default_sampling_params() == QWEN_DEFAULTS
    over = make(qwen_like_dir, device, override_generation_config={"temperature": 0, "top_k": None})
    # A null override unsets the file's value (vLLM's too), as a null in the file leaves the
    # default.
    assert over.get_diff_sampling_param() == dict(temperature=0, top_p=0.95, max_tokens=7)
    greedy = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    assert (tokens(over.generate([PROMPT], use_tqdm=False))
            == tokens(make(plain_dir, device).generate([PROMPT], greedy, use_tqdm=False)))
    only_override = make(plain_dir, device, generation_config="vllm",
                         override_generation_config={"max_new_tokens": 3})
    assert only_override.get_default_sampling_params() == SamplingParams(max_tokens=3)


def test_the_named_file_gives_the_eos_ids_too(plain_dir, tmp_path, device, monkeypatch):
    """As vLLM: generation_config=DIR's file gives the extra EOS ids ("vllm" keeps the model's),
    and a bad one is named before any work starts."""
    other = str(tmp_path / "other")
    os.makedirs(other)
    with open(os.path.join(other, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [77, 78], "temperature": 0.5}, f)
    llm = make(plain_dir, device, generation_config=other)
    assert {77, 78} <= set(llm.engine.eos_ids) and llm.get_diff_sampling_param() == {"temperature": 0.5}
    assert not {77, 78} & set(make(plain_dir, device).engine.eos_ids)
    with open(os.path.join(other, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": "77"}, f)
    import minivllm.runtime.llm as llm_module

    def no_start(config):
        raise AssertionError("the engine started before the file was checked")
    monkeypatch.setattr(llm_module, "make_executor", no_start)
    with pytest.raises(ValueError, match=r"other.generation_config.json: eos_token_id must be"):
        LLM(plain_dir, device="cpu", generation_config=other)


@pytest.mark.parametrize("values, match", [
    ({"temperature": -1}, r"qwen_bad.*generation_config.json: SamplingParams: temperature"),
    ({"top_p": 0}, r"generation_config.json: SamplingParams: top_p"),
    ({"top_k": 2.5}, r"generation_config.json: SamplingParams: top_k"),
    ({"max_new_tokens": 0}, r"generation_config.json: SamplingParams: max_tokens"),
])
def test_bad_values_in_the_file_are_named_at_construction(plain_dir, tmp_path, values, match):
    path = str(tmp_path / "qwen_bad")
    shutil.copytree(plain_dir, path)
    write_generation_config(path, **values)
    with pytest.raises(ValueError, match=match):
        LLM(path, device="cpu", num_kv_blocks=8)
    # Not read at all when turned off.
    assert LLM(path, device="cpu", num_kv_blocks=8,
               generation_config="vllm").get_default_sampling_params() == SamplingParams()


def test_bad_arguments_are_refused(plain_dir, tmp_path):
    with pytest.raises(ValueError, match="'auto', 'vllm' or a directory.*'nope' is not a directory"):
        LLM(plain_dir, device="cpu", generation_config="nope")
    with pytest.raises(TypeError, match="generation_config must be 'auto', 'vllm' or a directory, got int"):
        LLM(plain_dir, device="cpu", generation_config=1)
    with pytest.raises(ValueError, match="has no generation_config.json"):
        LLM(plain_dir, device="cpu", generation_config=str(tmp_path))
    with pytest.raises(ValueError, match=r"unknown keys \['temprature'\]"):
        LLM(plain_dir, device="cpu", override_generation_config={"temprature": 0.5})
    with pytest.raises(TypeError, match="override_generation_config must be a dict, got list"):
        LLM(plain_dir, device="cpu", override_generation_config=[("temperature", 0.5)])
    with pytest.raises(ValueError, match="override_generation_config: SamplingParams: top_p"):
        LLM(plain_dir, device="cpu", override_generation_config={"top_p": 2})
    bad_file = str(tmp_path / "bad_file")
    shutil.copytree(plain_dir, bad_file)
    write_generation_config(bad_file, top_k=-5)
    with pytest.raises(ValueError, match=r"bad_file.generation_config.json: SamplingParams: top_k"):
        LLM(bad_file, device="cpu", override_generation_config={"top_p": 0.5})
    bad = str(tmp_path / "list")
    shutil.copytree(plain_dir, bad)
    with open(os.path.join(bad, "generation_config.json"), "w") as f:
        json.dump([1, 2], f)
    with pytest.raises(ValueError, match="generation_config.json: must hold a JSON object, got list"):
        LLM(bad, device="cpu")


@pytest.fixture
def demo_with_defaults(tmp_path, device, monkeypatch):
    """The demo model with max_new_tokens 3 and top_k 1 (sampling that is greedy) in its file."""
    path = ensure_demo_model(str(tmp_path / "demo"))
    write_generation_config(path, max_new_tokens=3, top_k=1, temperature=0.7)
    small_cli_engines(device, monkeypatch)
    if device.type == "cpu":
        monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "reference")
    return path


def cli_outputs(capsys, argv):
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_the_cli_checks_flags_against_the_files_values_before_start_up(demo_with_defaults, capsys,
                                                                        monkeypatch):
    base = ["generate", "--model", demo_with_defaults, "-p", "Hello", "--ignore-eos", "--json",
            "--num-kv-blocks", "64"]
    # --min-tokens 5 exceeds the file's max_new_tokens 3: named before any engine starts.
    import minivllm.runtime.llm as llm_module

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine started before the flags were checked")
    with monkeypatch.context() as m:
        m.setattr(llm_module, "LLM", no_engine)
        assert main(base + ["--min-tokens", "5"]) == 2
        assert "min_tokens (5) must be <= max_tokens (3)" in capsys.readouterr().err
    # and 40 is fine when the file allows 50, though the command's own default is 32
    write_generation_config(demo_with_defaults, max_new_tokens=50)
    row = cli_outputs(capsys, base + ["--min-tokens", "40"])[0]
    assert len(row["token_ids"]) == 50


def test_the_cli_layers_flags_over_the_file_over_its_defaults(demo_with_defaults, capsys):
    base = ["generate", "--model", demo_with_defaults, "-p", "Hello", "--ignore-eos", "--json",
            "--num-kv-blocks", "64"]
    from_file = cli_outputs(capsys, base)[0]
    greedy = cli_outputs(capsys, base + ["--temperature", "0", "--max-tokens", "3"])[0]
    assert from_file["token_ids"] == greedy["token_ids"] and len(greedy["token_ids"]) == 3
    assert len(cli_outputs(capsys, base + ["--max-tokens", "5"])[0]["token_ids"]) == 5
    off = cli_outputs(capsys, base + ["--generation-config", "vllm", "--temperature", "0"])[0]
    assert len(off["token_ids"]) == 32 and off["token_ids"][:3] == greedy["token_ids"]


def test_eos_proper_has_no_stop_reason_the_files_other_eos_ids_do(plain_dir, tmp_path):
    """vLLM treats generation_config.json's EOS ids other than the tokenizer's as stop ids: a
    completion they end has stop_reason that id (Qwen3's <|endoftext|> beside <|im_end|>)."""
    from types import SimpleNamespace

    from minivllm.runtime.engine import read_eos_ids
    from minivllm.runtime.scheduler import stop_by_token
    from minivllm.runtime.sequence import Sequence

    write_dir = str(tmp_path / "eos")
    shutil.copytree(plain_dir, write_dir)
    write_generation_config(write_dir, eos_token_id=[9, 4])
    config = SimpleNamespace(eos_token_ids=(4,))
    assert read_eos_ids(write_dir, config, None) == (4, 9)  # no tokenizer: the config's first
    assert read_eos_ids(write_dir, config, SimpleNamespace(eos_token_id=9)) == (9, 4)

    def stop(last, eos_ids, **kw):
        seq = Sequence(0, "0", 0, [1, 2, 3], SamplingParams(**kw), 0, eos_ids=eos_ids)
        seq.token_ids.append(last)
        return stop_by_token(seq, 100)

    assert stop(4, (4, 9)) == ("stop", None)
    assert stop(9, (4, 9)) == ("stop", 9)
    assert stop(9, (9, 4)) == ("stop", None)
    assert stop(9, (4, 9), ignore_eos=True) is None
    assert stop(9, (4, 9), ignore_eos=True, stop_token_ids=[9]) == ("stop", 9)
