"""The `minivllm` command on the built-in demo model (built into a temporary directory)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest

from engine_helpers import make_llm, small_cli_engines
from minivllm import SamplingParams
from minivllm.cli import DEFAULT_PROMPTS, main
from minivllm.runtime.demo import ensure_demo_model


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory):
    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))


@pytest.fixture(autouse=True)
def demo_env(demo_path, device, monkeypatch):
    monkeypatch.setenv("MINIVLLM_DEMO_DIR", demo_path)
    small_cli_engines(device, monkeypatch)
    if device.type == "cpu":  # not the Triton interpreter that the test setup enables
        monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "reference")


def test_generate_demo_prints_completions_and_labels_the_model(capsys):
    assert main(["generate", "--demo", "--prompt", "Hello", "--max-tokens", "5", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert "Prompt: 'Hello'" in out and "Generated:" in out and "[5 tokens, length]" in out
    assert "RANDOM weights" in err and "meaningless" in err
    assert "no --model given" not in err


def test_no_model_falls_back_to_the_demo_and_matches_the_api(capsys, demo_path, device):
    assert main(["generate", "--max-tokens", "6", "--ignore-eos", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "no --model given" in err and "RANDOM weights" in err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == DEFAULT_PROMPTS
    llm = make_llm(demo_path, device, num_kv_blocks=32)
    want = llm.generate(DEFAULT_PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [r["token_ids"] for r in rows] == [o.outputs[0].token_ids for o in want]
    assert [r["text"] for r in rows] == [o.outputs[0].text for o in want]


def test_generate_stream_and_sampling_flags(capsys):
    argv = ["generate", "--demo", "-p", "a", "-p", "b c", "--max-tokens", "4", "--temperature",
            "0.8", "--top-p", "0.9", "--seed", "3", "--n", "2", "--stream"]
    assert main(argv) == 0
    out, _ = capsys.readouterr()
    labels = {line.split("]")[0] + "]" for line in out.splitlines() if line.startswith("[")}
    assert labels <= {"[0.0]", "[0.1]", "[1.0]", "[1.1]"} and len(labels) >= 2
    # --prompt-logprobs: each prompt's logprob once, as --json's scores sum it.
    assert main(argv + ["--prompt-logprobs", "0"]) == 0
    sums = [line for line in capsys.readouterr().out.splitlines() if "prompt logprob" in line]
    assert main(argv + ["--prompt-logprobs", "0", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # prompt_logprobs 0: each scored position holds the prompt's own token only
    want = {row["prompt"]: sum(v for e in row["prompt_logprobs"][1:] for v in e.values())
            for row in rows}
    assert len(sums) == 2 and sorted(float(s.split(": ")[1]) for s in sums) == \
        pytest.approx(sorted(want.values()), abs=1e-3)


def test_generate_with_an_fp8_kv_cache(capsys):
    assert main(["generate", "--demo", "--prompt", "Hello", "--max-tokens", "4", "--ignore-eos",
                 "--kv-cache-dtype", "fp8"]) == 0
    assert "[4 tokens, length]" in capsys.readouterr().out
    assert main(["generate", "--demo", "--kv-cache-dtype", "int4"]) == 2
    assert "unknown kv_cache_dtype 'int4'" in capsys.readouterr().err


def test_chat_reads_turns_and_streams_replies(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n\n/reset\nhow are you\n/exit\nignored\n"))
    assert main(["chat", "--demo", "--max-tokens", "6", "--temperature", "0", "--system", "be brief"]) == 0
    out, _ = capsys.readouterr()
    assert len(out.splitlines()) == 2  # one reply per turn, then /exit


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}=>"


@pytest.mark.parametrize("how", ["tokenizer's", "file", "literal"])
def test_generate_formats_prompts_with_a_chat_template(how, capsys, demo_path, device, tmp_path):
    template = None if how == "tokenizer's" else TEMPLATE
    flag = {"tokenizer's": [], "literal": [TEMPLATE], "file": [str(tmp_path / "t.jinja")]}[how]
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    rows = cli_json(capsys, ["generate", "--demo", "-p", "Hi there", "--max-tokens", "5",
                             "--temperature", "0", "--ignore-eos", "--json", "--chat-template", *flag])
    llm = make_llm(demo_path, device, num_kv_blocks=32)
    prompt = llm.chat_prompts([{"role": "user", "content": "Hi there"}], chat_template=template)
    if template is not None:
        assert prompt[0]["prompt"] == "[user] Hi there =>"
    want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    assert rows[0]["token_ids"] == want[0].outputs[0].token_ids


def test_chat_takes_a_chat_template_and_a_bad_one_is_named(capsys, monkeypatch, demo_path, device):
    assert main(["generate", "--demo", "--chat-template", "missing.jinja"]) == 2
    assert "--chat-template 'missing.jinja' is neither a file nor a Jinja template" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/exit\n"))
    assert main(["chat", "--demo", "--max-tokens", "4", "--temperature", "0", "--ignore-eos",
                 "--chat-template", TEMPLATE]) == 0
    llm = make_llm(demo_path, device, num_kv_blocks=32)
    want = llm.chat([{"role": "user", "content": "hello"}], chat_template=TEMPLATE, use_tqdm=False,
                    sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert capsys.readouterr().out == want[0].outputs[0].text + "\n"


def test_chat_without_a_tokenizer_is_one_error_not_one_a_line(capsys, monkeypatch, tmp_path):
    """No tokenizer, no conversation: /reset cannot mend it, so chat stops at once (exit 2)."""
    from hf_tiny import make_hf_model, save_checkpoint

    model = save_checkpoint(make_hf_model(), tmp_path / "model")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nhello\n/reset\nagain\n"))
    assert main(["chat", "--model", model, "--max-tokens", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("chat needs a tokenizer") == 1 and "/reset" not in err


def test_a_broken_tokenizer_is_named_before_the_weights_load(demo_path, tmp_path, monkeypatch):
    import shutil

    import minivllm.runtime.llm as llm_mod

    broken = shutil.copytree(demo_path, tmp_path / "broken")
    (broken / "tokenizer.json").write_text("not json")

    def no_weights(config):
        raise AssertionError("the weights were loaded before the tokenizer was checked")

    monkeypatch.setattr(llm_mod, "make_executor", no_weights)
    with pytest.raises(ValueError, match=f"cannot load the tokenizer in {broken}"):
        llm_mod.LLM(str(broken), device="cpu")


def cli_json(capsys, argv):
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_chat_goes_on_after_a_turn_that_does_not_fit(capsys, monkeypatch):
    """A conversation that outgrows max_model_len loses that turn, not the session."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n" + "word " * 80 + "\n/reset\nhello\n"))
    assert main(["chat", "--demo", "--max-model-len", "64", "--max-tokens", "4",
                 "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert "maximum model length of 64" in err and "/reset starts the conversation over" in err
    assert len(out.splitlines()) == 2  # the replies to "hi" and to "hello"


def test_errors_are_reported_not_raised(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--demo", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--demo", "--model", str(tmp_path)])


def test_stream_json_gives_what_json_gives_with_logprobs_and_stop_reason(capsys):
    argv = ["generate", "--demo", "-p", "Hello", "-p", "a b", "--max-tokens", "6", "--ignore-eos",
            "--logprobs", "2", "--prompt-logprobs", "1", "--json"]
    assert main(argv) == 0
    whole = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(argv + ["--stream"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == whole
    for row in whole:
        assert row["stop_reason"] is None and len(row["logprobs"]) == len(row["token_ids"]) == 6
        for entry, tok in zip(row["logprobs"], row["token_ids"]):
            assert str(tok) in entry and 2 <= len(entry) <= 3  # the top 2 and the sampled id
        assert abs(sum(e[str(t)] for e, t in zip(row["logprobs"], row["token_ids"]))
                   - row["cumulative_logprob"]) < 1e-4
    # The prompts' scores (with the stream too: its deltas carry them once): the API's.
    from hf_tiny import DEVICE
    from minivllm.runtime.demo import ensure_demo_model

    llm = make_llm(ensure_demo_model(), DEVICE)
    for row in whole:
        want = llm.generate([row["prompt"]], SamplingParams(max_tokens=1, prompt_logprobs=1),
                            use_tqdm=False)[0].prompt_logprobs
        got = row["prompt_logprobs"]
        assert got[0] is None and want[0] is None and len(got) == len(want) > 1
        for g, w in zip(got[1:], want[1:]):
            assert list(g) == [str(t) for t in w]
            assert [g[str(t)] for t in w] == pytest.approx([lp.logprob for lp in w.values()],
                                                           abs=1e-4)


@pytest.mark.parametrize("argv, match", [
    (["-tp", "0"], "tensor_parallel_size must be a positive integer, got 0"),
    (["--max-num-seqs", "0"], "max_num_seqs must be a positive integer, got 0"),
    (["--device", "nonsense"], "unknown device 'nonsense'"),
    (["--top-p", "1.5"], "top_p"),
    (["--n", "0"], "n must be"),
    (["--n", "99999999999"], "n must be an integer in [1, 16384]"),  # ran out of memory
    (["--generation-config", "nope"], "'nope' is not a directory"),
    (["--chat-template", "{{ x }"], "--chat-template: not a valid Jinja template"),
    (["--speculative-config", '{"method": "eagle"}'], "method must be one of"),
])
def test_bad_flags_are_refused_before_the_engine_starts(argv, match, capsys, monkeypatch):
    import minivllm.runtime.llm as llm
    from minivllm.runtime.config import EngineConfig

    def check_only(model, **kwargs):  # the engine's config checks run; no engine starts
        kwargs.pop("generation_config")  # the CLI checks it itself, before this
        EngineConfig.create(model, **kwargs)
        raise AssertionError("the flags passed the checks and an engine would start")

    monkeypatch.setattr(llm, "LLM", check_only)
    assert main(["generate", "--demo", "-p", "hi", *argv]) == 2
    assert match in capsys.readouterr().err


def test_a_checkpoint_directory_that_is_not_one_is_named(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path), "-p", "hi"]) == 2
    assert "has no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "vocab_size": 10}')
    assert main(["generate", "--model", str(tmp_path), "-p", "hi"]) == 2
    assert "lacks hidden_size, intermediate_size" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("[1, 2]")
    assert main(["generate", "--model", str(tmp_path), "-p", "hi"]) == 2
    assert "JSON object" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["generate", "--model", str(tmp_path / "file"), "-p", "hi"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "minivllm", "generate", "--help"],
                          capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0 and "--demo" in done.stdout and "--max-tokens" in done.stdout


def test_bench_runs_nano_vllms_workload_and_records_each_step(tmp_path):
    """`minivllm bench` on a small cut of the workload: every sequence gets its drawn max_tokens
    (ignore_eos), the JSON carries the fields the issue names, and --step-times writes one record
    per engine step whose times add up to no more than the run."""
    from hf_tiny import make_hf_model, save_checkpoint
    from minivllm.runtime.workload import throughput_workload

    # The workload's prompt ids go up to 10,000.
    model = save_checkpoint(make_hf_model(vocab_size=10_001), tmp_path / "model")
    result_path, steps_path = tmp_path / "r.json", tmp_path / "steps.json"
    assert main(["bench", "--model", model, "--num-seqs", "4", "--max-input-len", "120",
                 "--max-output-len", "110", "--max-model-len", "512", "--dtype", "float32",
                 "--block-size", "32", "--json", str(result_path), "--step-times",
                 str(steps_path)]) == 0
    result = json.loads(result_path.read_text())
    prompts, max_tokens = throughput_workload(4, 120, 110)
    assert result["workload"] == "throughput" and result["tensor_parallel_size"] == 1
    assert result["block_size"] == 32  # the KV page the run took, recorded
    assert result["output_tokens"] == sum(max_tokens)
    assert result["prompt_tokens"] == sum(map(len, prompts))
    for key in ("output_tok_per_s", "seconds", "device", "shape", "backend", "date"):
        assert key in result
    steps = json.loads(steps_path.read_text())
    # Asynchronous scheduling: the last call launches nothing, it reads the last step's tokens.
    assert len(steps) == result["steps"] + 1 and result["steps"] >= max(max_tokens)
    assert sum(s["s"] for s in steps) <= result["seconds"]
    assert {"running", "waiting", "prompt_tokens", "gc_s", "triton_compiles",
            "frames", "wait_s", "launch_s"} <= set(steps[0])
    assert all(0 <= s["wait_s"] <= s["s"] and 0 <= s["launch_s"] <= s["s"] - s["wait_s"]
               for s in steps)
    assert all(s["launch_s"] > 0 for s in steps[:-1])  # the last call launches nothing
    # every prompt token is computed once (no prefix hits: random prompts), in some step
    assert sum(s["prompt_tokens"] for s in steps) == result["prompt_tokens"]
    assert steps[-1]["running"] == 0 and steps[-1]["waiting"] == 0


def test_bench_latency_runs_one_stream_with_one_decode_bucket(tmp_path):
    """`minivllm bench --latency`: single-stream tok/s and time to first token; the engine is
    started for 2 sequences (one decode bucket), unless --max-num-seqs says otherwise."""
    from hf_tiny import make_hf_model, save_checkpoint

    model = save_checkpoint(make_hf_model(max_position_embeddings=1024), tmp_path / "model")  # 512 + 256 tokens
    result_path = tmp_path / "r.json"
    assert main(["bench", "--model", model, "--latency", "--dtype", "float32", "--max-model-len", "1024",
                 "--json", str(result_path)]) == 0
    result = json.loads(result_path.read_text())
    assert result["workload"] == "latency" and result["max_num_seqs"] == 2
    assert result["output_tokens"] == 256 and result["prompt_tokens"] == 512
    assert result["output_tok_per_s"] > 0 and result["ttft_s"] > 0
    assert result["seconds"] == pytest.approx(256 / result["output_tok_per_s"])
    assert result["host_us_per_step"] > 0 and result["wait_us_per_step"] >= 0
    for key in ("host_us_p10_50_90", "wait_us_p10_50_90", "launch_us_p10_50_90"):
        assert len(result[key]) == 3 and result[key] == sorted(result[key]) and result[key][0] >= 0
    # launch is a part of each step's host time (on the CPU the forward runs inside it), so
    # each of its percentiles is at most the host's
    launch, host = result["launch_us_p10_50_90"], result["host_us_p10_50_90"]
    assert 0 < launch[1] and all(x <= h for x, h in zip(launch, host))


def test_bench_latency_trace_records_a_speculative_stream(tmp_path):
    """`bench --latency --trace` with speculation writes its trace: 8 steps of the last stream,
    which takes fewer steps than it has tokens (the window used to be counted in tokens, so a
    speculative run ended before it and wrote nothing)."""
    from hf_tiny import make_hf_model, save_checkpoint

    model = save_checkpoint(make_hf_model(max_position_embeddings=1024), tmp_path / "model")
    trace, result_path = tmp_path / "trace.json", tmp_path / "r.json"
    assert main(["bench", "--model", model, "--latency", "--dtype", "float32",
                 "--max-model-len", "1024", "--json", str(result_path), "--trace", str(trace),
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']) == 0
    result = json.loads(result_path.read_text())
    assert result["spec_accepted_per_draft"] > 0  # steps of several tokens
    assert "draft_us_p10_50_90" not in result  # n-gram: no draft model's rounds
    events = json.loads(trace.read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 8


def test_bench_latency_splits_out_a_draft_models_rounds(tmp_path, capsys):
    """`bench --latency` with a draft model (here the model itself: every greedy draft agrees)
    reports the host's time a step in the draft's rounds (propose, its read-back included)."""
    from hf_tiny import make_hf_model, save_checkpoint

    model = save_checkpoint(make_hf_model(max_position_embeddings=1024), tmp_path / "model")
    result_path = tmp_path / "r.json"
    assert main(["bench", "--model", model, "--latency", "--dtype", "float32",
                 "--max-model-len", "1024", "--max-output-len", "64", "--json", str(result_path),
                 "--speculative-config",
                 json.dumps({"model": model, "num_speculative_tokens": 3})]) == 0
    result = json.loads(result_path.read_text())
    assert result["spec_acceptance"] == 1.0
    draft = result["draft_us_p10_50_90"]
    assert len(draft) == 3 and draft == sorted(draft) and draft[1] > 0
    assert f", drafting {draft[1]:.0f} us of it)" in capsys.readouterr().out


def test_host_and_wait_splits_each_step_into_host_work_and_the_wait():
    """bench's host_and_wait: each engine.step call's seconds, the part of them spent in the
    launched steps' result() (the wait for the device) and the part in runner.launch;
    unwrapping restores both methods."""
    import time

    from minivllm.runtime.bench import host_and_wait

    class Pending:
        def result(self):
            time.sleep(0.02)
            return "tokens"

    class Runner:
        def launch(self, step_input):
            time.sleep(0.005)
            return Pending()

    class Engine:
        def __init__(self):
            self.runner = Runner()

        def step(self):
            pending = self.runner.launch(None)  # launch, then host work, then read
            time.sleep(0.01)
            assert pending.result() == "tokens"
            return "outputs"

    engine = Engine()
    log = []
    unwrap = host_and_wait(engine, log)
    assert engine.step() == "outputs" and engine.step() == "outputs"
    unwrap()
    engine.step()
    assert len(log) == 2
    for seconds, waited, launching, drafting in log:
        assert 0.02 <= waited < seconds and seconds - waited >= 0.015
        assert 0.005 <= launching < 0.02  # not the host work after it (0.01), nor the wait
        assert drafting == 0  # no draft model's propose


@pytest.mark.parametrize("flag,value", [("--num-seqs", "0"), ("--max-input-len", "64"),
                                        ("--max-output-len", "99")])
def test_bench_rejects_a_workload_it_cannot_draw_before_starting_an_engine(flag, value, capsys,
                                                                          monkeypatch):
    """nano-vllm's workload draws lengths from randint(100, max): a smaller bound (or no
    sequences) is a clear error naming the argument, before any engine starts."""
    import minivllm.runtime.llm as llm

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine started")

    monkeypatch.setattr(llm, "LLM", no_engine)
    assert main(["bench", "--model", "unused", flag, value]) == 2
    err = capsys.readouterr().err
    assert flag.lstrip("-").replace("-", "_") in err and value in err


def test_bench_names_a_vocabulary_too_small_for_the_workloads_ids(tmp_path, capsys):
    """The workload's prompt ids go up to 10,000: a smaller model is told so, before the run."""
    from hf_tiny import make_hf_model, save_checkpoint

    model = save_checkpoint(make_hf_model(vocab_size=600), tmp_path / "model")
    assert main(["bench", "--model", model, "--num-seqs", "2", "--max-input-len", "100",
                 "--max-output-len", "100", "--max-model-len", "512", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "10000" in err and "600" in err


@pytest.mark.parametrize("argv, match", [
    (["--shape", "qwen3-0.6b", "--max-model-len", "1500"], "do not fit max_model_len=1500"),
    (["--shape", "qwen3-0.6b", "--latency", "--max-model-len", "600"], "do not fit max_model_len=600"),
    (["--shape", "qwen3-0.6b", "--latency", "--num-seqs", "4"], "--num-seqs is for the throughput run"),
    (["--shape", "qwen3-0.6b", "--latency", "--max-output-len", "1"], "--max-output-len must be at least 2"),
    (["--shape", "qwen3-0.6b", "--latency", "--max-output-len", "50", "--trace", "t.json"],
     "at least 110 for the latency run with --trace"),
    (["--shape", "qwen3-0.6b", "--json", "/nonexistent-dir/r.json"], "cannot write into /nonexistent-dir"),
    (["--shape", "qwen3-0.6b", "--step-times", "/nonexistent-dir/s.json"],
     "--step-times /nonexistent-dir/s.json: cannot write into /nonexistent-dir"),
    (["--shape", "qwen3-0.6b", "--trace", "/nonexistent-dir/t.json"],
     "--trace /nonexistent-dir/t.json: cannot write into /nonexistent-dir"),
    (["--shape", "qwen3-0.6b", "--latency", "--step-times", "s.json"],
     "--step-times records the throughput run's steps"),
    (["--shape", "qwen3-0.6b", "--trace", "t.json", "--trace-from", "-5"],
     "--trace-from must be in [0, 1014] for this workload"),
    # The workload's longest output: 134 tokens, so the run is sure of only 134 steps.
    (["--shape", "qwen3-0.6b", "--num-seqs", "4", "--max-output-len", "150", "--trace", "t.json"],
     "--trace-from must be in [0, 124]"),
])
def test_bench_refuses_a_run_it_would_misreport_before_starting_an_engine(argv, match, capsys,
                                                                          monkeypatch):
    """A workload cut short by max_model_len (its floor would count tokens never generated), flags
    the latency run would ignore, an output path that cannot be written (the result would be
    lost after the run) and a trace window the run may never reach (none would be written) are
    errors before any engine starts."""
    import minivllm.runtime.llm as llm

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine started")

    monkeypatch.setattr(llm, "LLM", no_engine)
    assert main(["bench", *argv]) == 2
    assert match in capsys.readouterr().err


def test_bench_latency_takes_the_prompt_and_output_lengths(tmp_path, demo_path):
    out = tmp_path / "r.json"
    assert main(["bench", "--model", demo_path, "--latency", "--max-input-len", "20",
                 "--max-output-len", "6", "--dtype", "float32", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["prompt_tokens"], result["output_tokens"]) == (20, 6)


def test_bench_on_a_model_shorter_than_4096_tokens_defaults_to_its_length(tmp_path, capsys):
    """max_model_len defaults to nano-vllm's 4096 only where the model reaches it (it was an
    error naming a value the user never gave)."""
    from hf_tiny import make_hf_model, save_checkpoint

    model = save_checkpoint(make_hf_model(max_position_embeddings=512), tmp_path / "model")
    assert main(["bench", "--model", model, "--latency", "--max-input-len", "20",
                 "--max-output-len", "4", "--dtype", "float32"]) == 0
    assert main(["bench", "--model", model, "--latency", "--max-input-len", "500",
                 "--max-output-len", "20", "--dtype", "float32"]) == 2
    assert "do not fit max_model_len=512" in capsys.readouterr().err


@pytest.mark.parametrize("rank, level", [("0", "INFO"), ("1", "WARNING")])
def test_under_torchrun_only_rank_zero_logs_the_start_up_report(tmp_path, monkeypatch, rank, level):
    import logging

    monkeypatch.delenv("MINIVLLM_LOG_LEVEL", raising=False)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    logger = logging.getLogger("minivllm")
    monkeypatch.setattr(logger, "level", logger.level)  # restored after the test
    assert main(["generate", "--model", str(tmp_path / "missing")]) == 2  # fails before start-up
    assert logging.getLevelName(logger.level) == level


def test_generate_with_ngram_speculation_gives_the_same_text(capsys, device, monkeypatch):
    """--speculative-config reaches the engine (its drafts counted) and changes no output."""
    from engine_helpers import small_cli_engines
    small_cli_engines(device, monkeypatch)
    argv = ["generate", "--demo", "-p", "a b a b a b a b", "--max-tokens", "12",
            "--temperature", "0", "--json"]
    assert main(argv) == 0
    plain = capsys.readouterr()
    assert main([*argv, "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}']) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out
    steps = [int(re.search(r"(\d+) steps", c.err).group(1)) for c in (plain, spec)]
    assert steps[1] < steps[0], steps  # drafts were accepted: fewer steps


_GENERATING_COMMANDS = (["generate", "-p", "hi"], ["chat"],
                        ["bench", "--num-seqs", "2", "--max-input-len", "100",
                         "--max-output-len", "100", "--max-model-len", "512"])
_POOLING_KINDS = (
    ("sentence-transformers", "sentence-transformers (embedding) checkpoint"),
    ("Qwen3Model", "names Qwen3Model, the backbone alone"),
    ("Qwen3ForSequenceClassification", "names Qwen3ForSequenceClassification, a classifier"),
    ("hf_overrides", "names Qwen3ForSequenceClassification, a classifier"),
)


@pytest.mark.parametrize("command, kind, reason", [
    pytest.param(command, kind, reason, id=f"{command[0]}-{kind}")
    for command in _GENERATING_COMMANDS for kind, reason in _POOLING_KINDS
    if not (command[0] == "bench" and kind == "hf_overrides")])  # bench takes no --hf-overrides
def test_generating_commands_refuse_a_pooling_checkpoint_before_an_engine_starts(
        command, kind, reason, demo_path, tmp_path, capsys, monkeypatch):
    """generate, chat and bench only generate: a checkpoint runner "auto" pools (an embedding
    or a classifier) is an error naming why, before its engine loads the weights (which would
    then refuse the first request)."""
    import shutil

    import minivllm.runtime.llm as llm

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine started")

    monkeypatch.setattr(llm, "LLM", no_engine)
    model = tmp_path / "model"
    model.mkdir()
    with open(os.path.join(demo_path, "config.json")) as f:
        config = json.load(f)
    if kind in ("Qwen3Model", "Qwen3ForSequenceClassification"):
        config["architectures"] = [kind]
    (model / "config.json").write_text(json.dumps(config))
    for name in os.listdir(demo_path):  # the tokenizer's files, for chat's
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(demo_path, name), model)
    if kind == "sentence-transformers":
        (model / "modules.json").write_text(json.dumps(
            [{"idx": 1, "name": "1", "path": "1_Pooling",
              "type": "sentence_transformers.models.Pooling"}]))
        (model / "1_Pooling").mkdir()
        (model / "1_Pooling" / "config.json").write_text('{"pooling_mode_lasttoken": true}')
    argv = [*command, "--model", str(model)]
    if kind == "hf_overrides":
        argv += ["--hf-overrides", '{"architectures": ["Qwen3ForSequenceClassification"]}']
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert reason in err and f"`minivllm {command[0]}` cannot run" in err
    assert "minivllm serve --runner pooling" in err

