"""The `minivllm` command on the built-in demo model (built into a temporary directory)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from minivllm import LLM, SamplingParams
from minivllm.cli import DEFAULT_PROMPTS, main
from minivllm.runtime.demo import ensure_demo_model


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory):
    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))


@pytest.fixture(autouse=True)
def demo_env(demo_path, device, monkeypatch):
    monkeypatch.setenv("MINIVLLM_DEMO_DIR", demo_path)
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
    llm = LLM(demo_path, device=device, num_kv_blocks=32,
              attention_backend=os.environ.get("MINIVLLM_ATTENTION_BACKEND"))
    want = llm.generate(DEFAULT_PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [r["token_ids"] for r in rows] == [o.outputs[0].token_ids for o in want]
    assert [r["text"] for r in rows] == [o.outputs[0].text for o in want]


def test_generate_stream_and_sampling_flags(capsys):
    argv = ["generate", "--demo", "-p", "a", "-p", "b", "--max-tokens", "4", "--temperature", "0.8",
            "--top-p", "0.9", "--seed", "3", "--n", "2", "--stream"]
    assert main(argv) == 0
    out, _ = capsys.readouterr()
    labels = {line.split("]")[0] + "]" for line in out.splitlines() if line.startswith("[")}
    assert labels <= {"[0.0]", "[0.1]", "[1.0]", "[1.1]"} and len(labels) >= 2


def test_chat_reads_turns_and_streams_replies(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n\n/reset\nhow are you\n/exit\nignored\n"))
    assert main(["chat", "--demo", "--max-tokens", "6", "--temperature", "0", "--system", "be brief"]) == 0
    out, _ = capsys.readouterr()
    assert len(out.splitlines()) == 2  # one reply per turn, then /exit


def test_errors_are_reported_not_raised(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--demo", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--demo", "--model", str(tmp_path)])


def test_python_dash_m_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "minivllm", "generate", "--help"],
                          capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0 and "--demo" in done.stdout and "--max-tokens" in done.stdout
