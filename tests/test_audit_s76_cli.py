"""Audit (session 76) of `minivllm generate` / `chat` and the engine flags they share with
serve: vLLM's flag spellings, and how the commands end when their output's reader goes away
or Ctrl-C comes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from minivllm.cli import build_parser, main
from test_cli import demo_env, demo_path  # noqa: F401  (fixtures: the demo model, small engines)


class _Captured(Exception):
    pass


def _engine_kwargs(monkeypatch, argv) -> dict:
    """The keyword arguments the command gives LLM (no engine starts)."""
    import minivllm.runtime.llm as llm_mod

    seen = {}

    def capture(model, **kwargs):
        seen.update(kwargs)
        raise _Captured

    monkeypatch.setattr(llm_mod, "LLM", capture)
    with pytest.raises(_Captured):
        main(argv)
    return seen


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flags, on", [
    ([], True),
    (["--enable-prefix-caching"], True),
    (["--no-enable-prefix-caching"], False),  # vLLM's spelling (BooleanOptionalAction)
    (["--no-prefix-caching"], False),  # minivllm's older one still works
])
def test_vllms_prefix_caching_flags_reach_the_engine(command, flags, on, monkeypatch):
    assert _engine_kwargs(monkeypatch, [command, "--demo", *flags])["enable_prefix_caching"] is on
    serve = build_parser().parse_args(["serve", "DIR", *flags])
    assert serve.enable_prefix_caching is on


def test_chat_takes_vllms_system_prompt_flag(capsys, monkeypatch):
    import io

    from minivllm.runtime.llm import LLM

    real = LLM.chat_prompts
    seen = []

    def recording(self, conversations, **kwargs):
        seen.append(list(conversations))  # chat appends the reply to it afterwards
        return real(self, conversations, **kwargs)

    monkeypatch.setattr(LLM, "chat_prompts", recording)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--demo", "--system-prompt", "be brief", "--max-tokens", "2"]) == 0
    assert capsys.readouterr().out.strip()
    assert seen[-1] == [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": "hello"}]


@pytest.mark.parametrize("argv, stdin", [
    (["generate", "-p", "hi", "--max-tokens", "2"], None),
    (["chat", "--max-tokens", "2"], "hi\n"),
])
def test_a_reader_that_went_away_ends_the_command_quietly(argv, stdin, demo_path, device):
    """`minivllm generate | head -1`: once the reader has gone, a write to stdout fails
    (EPIPE); the command ends with 141 (128 + SIGPIPE, as Unix tools) and no traceback."""
    env = dict(os.environ, MINIVLLM_DEMO_DIR=demo_path)
    if device.type == "cpu":
        env["MINIVLLM_ATTENTION_BACKEND"] = "reference"
    read, write = os.pipe()
    os.close(read)  # nobody reads: the command's first write to stdout fails
    try:
        done = subprocess.run([sys.executable, "-m", "minivllm", *argv, "--enforce-eager",
                               "--max-num-seqs", "4"], input=stdin, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=300, env=env)
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 141


def test_ctrl_c_while_generating_ends_without_a_traceback(capsys, monkeypatch):
    from minivllm.runtime.llm import LLM

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(LLM, "generate", interrupted)
    try:
        rc = main(["generate", "--demo", "-p", "hi", "--max-tokens", "2"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the command as a traceback")
    assert rc == 130
    assert capsys.readouterr().err.rstrip().endswith("minivllm: interrupted")


def test_serve_takes_vllms_seed_as_the_engine_seed():
    """`vllm serve --seed N` seeds the engine; serve here refused --seed (generate's --seed is
    a request's). It is --engine-seed's other name on serve, and the default stays 0."""
    from minivllm.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "m", "--seed", "7"]).engine_seed == 7
    assert parser.parse_args(["serve", "m", "--engine-seed", "5"]).engine_seed == 5
    assert parser.parse_args(["serve", "m"]).engine_seed == 0
