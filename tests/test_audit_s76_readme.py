"""README.md stays true of the code (session 76's README audit): what it shows runs, and what it
names exists.

- Its ```python blocks run, in order and in one namespace, as a reader pasting them would run
  them, on the CPU. Changed in them, and only there: each "path/to/NAME" becomes a tiny random
  checkpoint (write_model: the demo model's tokenizer, Qwen3's token ids of the README's examples
  within its vocabulary, hidden size 256 for `dimensions=256`), or for a NAME ending in "-lora" a
  random PEFT adapter of it; `device="cuda"` becomes "cpu"; the names the README leaves to the
  reader (`prompts`, `my_encoder`, `policy`, ...) are given (placeholders). A block whose line
  before is `<!-- readme-test: skip (WHY) -->` is not run.
- Its `minivllm ...` command lines (in ```bash blocks) parse with minivllm.cli.build_parser; the
  ones on the demo model (`--demo`) run; each `minivllm serve` followed by curl lines serves (on
  a free port) and answers each curl 200.
- Every `--flag` it mentions is an option of the subcommand it is given to (a code span or
  command line naming one), else of some subcommand, else of the benchmark script it follows;
  other tools' flags are listed in FOREIGN_FLAGS.
- The repository paths, test ids, MINIVLLM_* variables, gpu_checks.sh modes, `minivllm.*` /
  `llm.*` API names and `vllm:*` metric names it mentions exist.

Only the snippets, the demo commands and the servers start engines (skipped on a GPU machine,
where engines at the README's sizes compile and capture graphs); ~15 s on two CPU cores.
"""

from __future__ import annotations

import importlib
import io
import itertools
import json
import os
import pathlib
import re
import shlex
import signal
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch

from minivllm.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SKIP = re.compile(r"<!-- readme-test: skip \((.+)\) -->")
ON_GPU = torch.cuda.is_available()
needs_cpu = pytest.mark.skipif(ON_GPU, reason="engines at the README's sizes compile and capture "
                                              "CUDA graphs on a GPU: the README is checked on CPU")

# Flags of other tools the README shows beside minivllm's.
FOREIGN_FLAGS = {
    "--index-url": "pip",
    "--convert": "vLLM's (`--convert classify`, named as not done)",
    **{f: "torchrun" for f in ("--nproc-per-node", "--nnodes", "--rdzv-backend",
                                "--rdzv-endpoint", "--rdzv-id")},
}


def line_of(pos: int) -> int:
    return README.count("\n", 0, pos) + 1


def fences(lang: str) -> list[tuple[int, str, str | None]]:
    """(line of the opening fence, body, skip reason or None) of each ```lang block."""
    found = []
    for m in re.finditer(rf"^```{lang}\n(.*?)^```", README, re.S | re.M):
        before = README[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.fullmatch(before.strip())
        found.append((line_of(m.start()), m.group(1), skip.group(1) if skip else None))
    return found


def subparsers() -> dict:
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices


SUBPARSERS = subparsers()
OPTIONS = {name: set(p._option_string_actions) for name, p in SUBPARSERS.items()}


# -- command lines ---------------------------------------------------------------------------------


def block_lines(start: int, body: str) -> list[tuple[int, str]]:
    """(README line, text) of each line of the block at `start`, continuations joined."""
    out, lines, k = [], body.split("\n"), 0
    while k < len(lines):
        first, text = k, lines[k]
        while text.endswith("\\") and k + 1 < len(lines):
            k += 1
            text = text[:-1] + " " + lines[k].strip()
        out.append((start + 1 + first, text))
        k += 1
    return out


def bash_lines() -> list[tuple[int, str]]:
    return [line for start, body, _ in fences("bash") for line in block_lines(start, body)]


def minivllm_command(text: str) -> tuple[dict, list[str]] | None:
    """(environment assignments, argv after `minivllm`) of a shell line that runs minivllm
    (`minivllm`, `.venv/bin/minivllm`, `python -m minivllm`, `torchrun ... -m minivllm`)."""
    words = shlex.split(text, comments=True)
    for k, w in enumerate(words):
        if (w == "minivllm" or w.endswith("/minivllm")) and (k == 0 or words[k - 1] == "-m" or
                                                             "=" in words[k - 1]):
            env = dict(e.split("=", 1) for e in words[:k] if re.fullmatch(r"[A-Z_]+=\S*", e))
            return env, words[k + 1:]
    return None


COMMANDS = [(line, *cmd) for line, text in bash_lines()
            if (cmd := minivllm_command(text)) is not None]


def test_the_readme_is_read():
    assert len(fences("python")) >= 15 and len(COMMANDS) >= 15
    # Every skip marker stands right above a python block (one elsewhere would skip nothing).
    assert len(SKIP.findall(README)) == sum(s is not None for _, _, s in fences("python")) > 0
    assert {argv[0] for _, _, argv in COMMANDS} == {"generate", "chat", "serve", "bench",
                                                      "run-batch"}


@pytest.mark.parametrize("line,env,argv", COMMANDS, ids=[f"line{c[0]}" for c in COMMANDS])
def test_command_lines_parse(line, env, argv, capsys):
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"README.md:{line}: `minivllm {shlex.join(argv)}` does not parse: "
                    f"{capsys.readouterr().err}")


# -- flags -----------------------------------------------------------------------------------------

FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def code_spans() -> list[tuple[int, str]]:
    """(line, text) of the prose's inline code spans (code blocks left out)."""
    prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group().count("\n"), README,
                   flags=re.S | re.M)
    return [(line_of(m.start()), m.group(1)) for m in re.finditer(r"`([^`\n]+)`", prose)]


def scoped_flags() -> list[tuple[int, str, str]]:
    """(line, subcommand, flag) for each flag a code span or command line gives to a subcommand
    (`minivllm bench --trace F`, `serve --enable-sleep-mode`, `minivllm generate --help`), and
    each flag of the paragraph that `minivllm generate --help` lists."""
    found = []
    for line, span in code_spans():
        m = re.match(r"(?:minivllm )?(generate|chat|serve|bench|run-batch)(?![\w-])(.*)", span)
        if m and FLAG.search(m.group(2)):
            found += [(line, m.group(1), f) for f in FLAG.findall(m.group(2))]
    for line, env, argv in COMMANDS:
        found += [(line, argv[0], f) for f in FLAG.findall(" ".join(argv[1:]))]
    start = README.index("`minivllm generate --help` lists")
    listed = README[start:README.index(". As in vLLM", start)]
    found += [(line_of(start), "generate", f) for f in FLAG.findall(listed)]
    return found


def test_flags_given_to_a_subcommand_are_its_own():
    wrong = [f"README.md:{line}: {flag} is no option of `minivllm {sub}`"
             for line, sub, flag in scoped_flags() if flag not in OPTIONS[sub]]
    assert not wrong, "\n".join(wrong)


def test_every_flag_exists():
    """A flag is minivllm's (some subcommand's), else the benchmark script's its line (or the
    comment lines under it) runs, else another tool's (FOREIGN_FLAGS)."""
    every = set().union(*OPTIONS.values())
    script_of_line = {}
    for start, body, _ in fences("bash"):
        script = None
        for line, text in block_lines(start, body):
            m = re.match(r"\s*(?:python3? )?(benchmarks/\w+\.py)", text)
            if m:
                script = m.group(1)
            elif not text.lstrip().startswith("#"):
                script = None
            script_of_line[line] = script
    wrong = []
    for m in FLAG.finditer(README):
        flag, line = m.group(1), line_of(m.start())
        script = script_of_line.get(line)
        if flag in every or flag in FOREIGN_FLAGS:
            continue
        if script is not None and re.search(rf"['\"]{flag}['\"]", (ROOT / script).read_text()):
            continue
        wrong.append(f"README.md:{line}: {flag}" + (f" (not in {script})" if script else ""))
    assert not wrong, "flags that exist nowhere:\n" + "\n".join(wrong)


# -- names -----------------------------------------------------------------------------------------


def test_paths_and_test_ids_exist():
    missing = []
    for m in re.finditer(r"(?<![\w/.])((?:minivllm/)?(?:state|functional|kernels|runtime)/\w+\.py"
                         r"|(?:tests|benchmarks|scripts)/[\w/]+\.(?:py|sh))", README):
        path = m.group(1)
        if path.split("/")[0] in ("state", "functional", "kernels", "runtime"):
            path = "minivllm/" + path
        if not (ROOT / path).is_file():
            missing.append(f"README.md:{line_of(m.start())}: {m.group(1)}")
    for m in re.finditer(r"(tests/\w+\.py)::(\w+)", README):
        if not re.search(rf"^def {m.group(2)}\(", (ROOT / m.group(1)).read_text(), re.M):
            missing.append(f"README.md:{line_of(m.start())}: {m.group()}")
    assert not missing, "\n".join(missing)


def sources(*dirs: str) -> str:
    return "\n".join(p.read_text() for d in dirs for p in sorted((ROOT / d).rglob("*.py")))


def test_environment_variables_are_read():
    code = sources("minivllm", "benchmarks")
    unread = sorted({v for v in re.findall(r"\b((?:MINIVLLM|VLLM)_[A-Z0-9_]*[A-Z0-9])\b", README)
                     if not re.search(rf"\b{v}\b", code)})
    assert not unread, unread


def test_gpu_checks_modes_exist():
    script = (ROOT / "benchmarks" / "gpu_checks.sh").read_text()
    modes = set(re.findall(r"^([a-z0-9_]+)\)", script, re.M))
    named = {(line_of(m.start()), mode) for m in
             re.finditer(r"gpu_checks\.sh ((?:[a-z0-9_]+ ?)+)", README)
             for mode in m.group(1).split()}
    assert named and not [n for n in named if n[1] not in modes], sorted(named)


def resolve(dotted: str):
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
            break
        except ImportError:
            continue
    for part in parts[k:]:
        obj = getattr(obj, part)
    return obj


def fields(cls) -> set[str]:
    """A class's attributes and its attrs / dataclass fields."""
    import dataclasses

    import attrs

    names = set(dir(cls))
    if attrs.has(cls):
        names |= {f.name for f in attrs.fields(cls)}
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    return names


def test_api_names_exist():
    """`minivllm.X.Y`, `state.load.assign_hf_weights`-like names of the package's modules,
    `module.NAME` of a module of minivllm (`openai_api.decode_prompt_embeds`) or of an instance
    of one of its classes (`params.lora`), `Class.field` of the package's exported classes
    (`Batch.input_embeds`), and `llm.method`."""
    import minivllm

    modules = {p.stem: ".".join(p.relative_to(ROOT).with_suffix("").parts)
               for p in (ROOT / "minivllm").rglob("*.py") if p.stem != "__init__"}
    missing = []

    def check(line, dotted, name=None):
        try:
            resolve(dotted)
        except AttributeError:
            missing.append(f"README.md:{line}: {name or dotted}")

    for m in re.finditer(r"\bminivllm(?:\.\w+)+", README):
        check(line_of(m.start()), m.group())
    for line, span in code_spans():
        m = re.fullmatch(r"(state|runtime|functional|kernels)((?:\.\w+)+)", span)
        if m:
            check(line, "minivllm." + span, span)
        m = re.fullmatch(r"(\w+)\.(\w+)", span)
        if m and m.group(1) in modules:  # the module's name, or an instance of its class
            module = importlib.import_module(modules[m.group(1)])
            if not hasattr(module, m.group(2)) and not any(
                    m.group(2) in fields(c) for c in vars(module).values() if isinstance(c, type)):
                missing.append(f"README.md:{line}: {span}")
        elif m and m.group(1) in minivllm.__all__:
            check(line, f"minivllm.{span}", span)
    for m in re.finditer(r"\bllm\.(\w+)", README):
        if not hasattr(minivllm.LLM, m.group(1)):
            missing.append(f"README.md:{line_of(m.start())}: llm.{m.group(1)}")
    assert not missing, "\n".join(missing)


def test_metric_names_exist():
    code = (ROOT / "minivllm" / "runtime" / "metrics.py").read_text()
    names = set()
    for m in re.findall(r"`(vllm:[\w{},]+)", README):
        # A trailing {...} is the labels (`_total{finished_reason}`), unless after a "_"
        # (`request_params_{n,max_tokens}`): there, as within a name, alternatives.
        m = re.sub(r"(?<!_)\{[^}]*\}?$", "", m)
        parts = re.split(r"\{([^}]*)\}", m)
        names |= {"".join(p) for p in itertools.product(
            *[[p] if k % 2 == 0 else p.split(",") for k, p in enumerate(parts)])}
    assert len(names) > 20
    missing = sorted(n for n in names if f'"{n}"' not in code and f'"{n}_total"' not in code
                     and f'"{n.removesuffix("_total")}"' not in code)
    assert not missing, missing


# -- running what it shows ---------------------------------------------------------------------


def write_model(path: str) -> str:
    """The demo model's tokenizer (with "no" and "yes", the reranker example's classifier
    tokens) on a random Qwen3 of 16,384 ids (the README's Qwen3 ids are below 10,000; the ids
    past the tokenizer's are never sampled) and hidden size 256."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from minivllm.runtime import demo

    tok = demo.build_tokenizer()
    tok.add_tokens(["no", "yes"])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    shape = dict(demo.MODEL_SHAPE, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 head_dim=64)
    config = Qwen3Config(vocab_size=16384, bos_token_id=None, eos_token_id=eos,
                         pad_token_id=tok.pad_token_id, **shape)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).float().eval()
    demo.demo_weights_(model, tok, eos)
    with torch.no_grad():
        model.lm_head.weight[len(tok):] = 0.0
        model.lm_head.weight[len(tok):, 0] = -10.0
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_adapter(path: str, model_dir: str, seed: int) -> str:
    """A rank-8 PEFT LoRA adapter of q_proj, o_proj and down_proj, random."""
    from safetensors.torch import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    h, i, q = cfg["hidden_size"], cfg["intermediate_size"], \
        cfg["num_attention_heads"] * cfg["head_dim"]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for n in range(cfg["num_hidden_layers"]):
        for module, (n_in, n_out) in {"self_attn.q_proj": (h, q), "self_attn.o_proj": (q, h),
                                      "mlp.down_proj": (i, h)}.items():
            key = f"base_model.model.model.layers.{n}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(8, n_in, generator=g) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, 8, generator=g) * 0.1
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(dict(peft_type="LORA", r=8, lora_alpha=16, bias="none",
                       target_modules=["q_proj", "o_proj", "down_proj"]), f)
    return path


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    model = write_model(str(root / "model"))
    return {"model": model, "sql-lora": write_adapter(str(root / "sql-lora"), model, 1),
            "chatty-lora": write_adapter(str(root / "chatty-lora"), model, 2)}


@pytest.fixture
def cpu_env(monkeypatch, tmp_path):
    # The engines' KV caches at 0.25 GiB (else up to 4 GiB each, for max_num_seqs x
    # max_model_len tokens); attention by the reference backend (not under Triton's
    # interpreter, which the test setup turns on).
    monkeypatch.setenv("MINIVLLM_CPU_KV_CACHE_SPACE", "0.25")
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "reference")
    monkeypatch.setenv("MINIVLLM_DEMO_DIR", str(tmp_path / "demo"))


def substitute(text: str, paths: dict) -> str:
    """Each "path/to/NAME" as a real path: an adapter's for NAME ending in -lora, else the
    model's."""
    return re.sub(r"path/to/([\w.-]+)",
                  lambda m: paths[m.group(1)] if m.group(1).endswith("-lora") else paths["model"],
                  text)


class Policy:
    """A trainer's model whose state_dict holds the checkpoint's own tensors."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir

    def state_dict(self) -> dict:
        from safetensors.torch import load_file

        return load_file(os.path.join(self.model_dir, "model.safetensors"))


def placeholders(paths: dict) -> dict:
    """What the README leaves to the reader."""
    hidden = 256
    return dict(prompts=["Hello, my name is", "The capital of France is"], p1="Hello",
                p2="The capital of France is", p3="Once upon a time",
                messages=[{"role": "user", "content": "Tell me a joke."}],
                model_dir=paths["model"], path=paths["model"],
                my_encoder=lambda *_: torch.randn(5, hidden), embeds=torch.randn(4, hidden),
                policy=Policy(paths["model"]), query="What is the capital of France?",
                doc_1="Paris is the capital of France.", doc_2="The fox jumps over the dog.",
                token_ids=[9707, 11, 1879, 785, 6722], block_table=[0])


@needs_cpu
def test_python_snippets_run(paths, cpu_env):
    from minivllm import LLM

    namespace = placeholders(paths)
    ran = []
    try:
        for line, body, skip in fences("python"):
            if skip is not None:
                continue
            code = substitute(body, paths).replace('device="cuda"', 'device="cpu"')
            try:
                exec(compile(code, f"README.md:{line}", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"the README's snippet at line {line} failed: "
                                     f"{type(e).__name__}: {e}") from e
            ran.append(line)
    finally:
        for value in namespace.values():
            if isinstance(value, LLM):
                value.shutdown()
    assert len(ran) >= 12


DEMO_COMMANDS = [(line, argv) for line, env, argv in COMMANDS if "--demo" in argv]


@needs_cpu
@pytest.mark.parametrize("line,argv", DEMO_COMMANDS, ids=[f"line{c[0]}" for c in DEMO_COMMANDS])
def test_demo_commands_run(line, argv, cpu_env, monkeypatch, capsys):
    from minivllm.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n/exit\n"))
    assert main(argv) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert out.strip() and "RANDOM weights" in err


def servers() -> list[tuple[int, dict, list[str], list[tuple[int, list[str]]]]]:
    """(line, env, argv, [(line, curl words)]) of each `minivllm serve` line of a bash block
    that curl lines follow (before the next serve line)."""
    found = []
    for start, body, _ in fences("bash"):
        current = None
        for line, text in block_lines(start, body):
            cmd = minivllm_command(text)
            if cmd is not None and cmd[1][:1] == ["serve"]:
                current = (line, cmd[0], cmd[1], [])
                found.append(current)
            elif text.startswith("curl ") and current is not None:
                current[3].append((line, shlex.split(text, comments=True)))
    return [s for s in found if s[3]]


SERVERS = servers()


def curl(words: list[str], host: str, port: int, paths: dict) -> tuple[int, bytes]:
    """A curl command line (-X, -H, -d and the URL) sent with urllib."""
    method, headers, data, url = None, {}, None, None
    it = iter(words[1:])
    for w in it:
        if w == "-X":
            method = next(it)
        elif w == "-H":
            name, _, value = next(it).partition(":")
            headers[name.strip()] = value.strip()
        elif w == "-d":
            data = substitute(next(it), paths).encode()
        else:
            url = "http://" + w.replace("localhost:8000", f"{host}:{port}", 1)
    request = urllib.request.Request(url, data=data, headers=headers,
                                     method=method or ("POST" if data is not None else "GET"))
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:  # the answer, for the test's message
        return e.code, e.read()


@needs_cpu
@pytest.mark.parametrize("line,env,argv,curls", SERVERS, ids=[f"line{s[0]}" for s in SERVERS])
def test_served_curl_examples_answer(line, env, argv, curls, paths, cpu_env, monkeypatch):
    """The serve command as the README gives it (on port 0), each curl under it answered 200."""
    from minivllm.cli import main
    from minivllm.runtime.server import OpenAIServer

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = [substitute(a, paths) for a in argv]
    if "--port" in argv:
        argv[argv.index("--port") + 1] = "0"
    else:
        argv += ["--port", "0"]
    answers = []

    def serve_forever(server):
        thread = threading.Thread(target=server.http.serve_forever, daemon=True)
        thread.start()
        try:
            host, port = server.address
            for curl_line, words in curls:
                answers.append((curl_line, *curl(words, host, port, paths)))
        finally:
            server.shutdown()
            thread.join(timeout=10)
        raise KeyboardInterrupt  # as Ctrl-C stops `minivllm serve`

    monkeypatch.setattr(OpenAIServer, "serve_forever", serve_forever)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        assert main(argv) == 0
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert [(a[0], a[1]) for a in answers] == [(c[0], 200) for c in curls], answers
