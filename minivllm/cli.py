"""The `minivllm` command: `generate` completes prompts, `chat` is an interactive conversation,
`bench` measures throughput or single-stream latency, `serve` answers OpenAI API requests,
`run-batch` answers a file of them.

    minivllm generate --model DIR --prompt "Hello, my name is" --max-tokens 32
    minivllm chat --model DIR
    minivllm generate --demo          # a built-in tiny model with random weights: no download
    minivllm bench --shape qwen3-0.6b # nano-vllm's throughput workload (--latency: one stream)
    minivllm serve DIR --port 8000    # an OpenAI-compatible server (/v1/completions, /v1/chat/...)
    minivllm run-batch -i in.jsonl -o out.jsonl --model DIR  # OpenAI batch lines, as serve answers

With neither --model nor --demo, `generate` and `chat` run the demo model, and say so (`bench`
runs random weights of --shape).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time

DEFAULT_PROMPTS = ["Hello, my name is", "The capital of France is", "The future of AI is"]


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    except RecursionError:
        raise argparse.ArgumentTypeError("JSON nested too deep") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def _port(text: str) -> int:
    """serve's --port: a TCP port, 0 for any free one, by the server's own rule (socket's bind
    refused the others with an OverflowError, after the model had loaded)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    from .runtime.server import check_port  # serve imports the server anyway

    try:
        return check_port(port)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _check_address(host: str, port: int) -> None:
    """serve's address bound and let go before the model loads, as the server binds it (IPv4,
    SO_REUSEADDR): a port taken or a host not this machine's is named now, not as a traceback
    after the weights loaded."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise SystemExit(f"minivllm: cannot serve at {host}:{port}: {e}") from None


def _hf_overrides(args) -> dict | None:
    overrides = dict(args.hf_overrides or {})
    if args.rope_scaling is not None:
        overrides["rope_scaling"] = args.rope_scaling
    return overrides or None


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", help="a local Hugging Face Qwen3 checkpoint directory")
    g.add_argument("--demo", action="store_true",
                   help="use the built-in tiny demo model (random weights: meaningless text)")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--attention-backend", default=None)
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model's dtype) or fp8 (float8 e4m3: twice the cached tokens)")
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--persistent-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="decode steps of 1-2 sequences: every layer in one persistent kernel "
                        "(default: on for one CUDA GPU with the triton attention backend)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="ranks to split the model over (default: torchrun's WORLD_SIZE, else 1)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV cache of prompts that begin the same way "
                                      "(vLLM's flag; default: on)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help=argparse.SUPPRESS)  # minivllm's older spelling of the --no- form
    g.add_argument("--engine-seed", type=int, default=0, help="seeds requests that set no --seed")
    g.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON",
                   help="config.json values set over the checkpoint's (vLLM's), e.g. "
                        "'{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                        "\"original_max_position_embeddings\": 32768}}'")
    g.add_argument("--rope-scaling", type=_json_object, default=None, metavar="JSON",
                   help="the same as --hf-overrides '{\"rope_scaling\": JSON}' (vLLM's older flag)")
    g.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help="speculative decoding (vLLM's): n-gram, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}', or a draft "
                        "model, e.g. '{\"model\": \"DRAFT_DIR\", \"num_speculative_tokens\": 3}'")
    g.add_argument("--logprobs-mode", default="raw_logprobs",
                   choices=("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"),
                   help="what returned logprobs are taken from (vLLM's): the model's raw "
                        "logprobs or logits, or the processed ones the token was sampled from "
                        "(after penalties, temperature, top-k / top-p / min-p)")
    g.add_argument("--generation-config", default="auto",
                   help="where unset sampling flags come from: auto (the model's "
                        "generation_config.json, as vLLM), vllm (minivllm's defaults) or a "
                        "directory holding a generation_config.json")


# What an unset sampling flag takes when the model's generation_config.json does not set it.
COMMAND_DEFAULTS = {
    "generate": dict(max_tokens=32, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                     repetition_penalty=1.0),
    "chat": dict(max_tokens=256, temperature=0.8, top_p=1.0, top_k=0, min_p=0.0,
                 repetition_penalty=1.0),
}


def _add_sampling_args(p: argparse.ArgumentParser, command: str) -> None:
    g = p.add_argument_group("sampling", description=(
        "Unset --max-tokens, --temperature, --top-p, --top-k, --min-p and --repetition-penalty "
        "take the model's generation_config.json values (see --generation-config), else the "
        "defaults shown."))
    default = COMMAND_DEFAULTS[command]
    g.add_argument("--max-tokens", type=int, default=None, help=f"(default: {default['max_tokens']})")
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=None,
                   help=f"0 is greedy (default: {default['temperature']:g})")
    g.add_argument("--top-p", type=float, default=None, help=f"(default: {default['top_p']:g})")
    g.add_argument("--top-k", type=int, default=None, help=f"(default: {default['top_k']}, off)")
    g.add_argument("--min-p", type=float, default=None, help=f"(default: {default['min_p']:g})")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"(default: {default['repetition_penalty']:g})")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    summary = " ".join(__doc__.split("\n\n")[0].split())  # the first paragraph, one line
    parser = argparse.ArgumentParser(prog="minivllm", description=summary,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts and print the completions")
    _add_model_args(gen)
    _add_sampling_args(gen, "generate")
    gen.add_argument("--prompt", "-p", action="append", default=None,
                     help="a prompt (repeatable; default: three example prompts)")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--logprobs", type=int, default=None)
    gen.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                     help="score each prompt token (its logprob and the top N; in --json's "
                          "prompt_logprobs, else their sum)")
    gen.add_argument("--chat-template", nargs="?", const="", default=None, metavar="TEMPLATE",
                     help="format each prompt as a user message with the tokenizer's chat "
                          "template, or with TEMPLATE: a Jinja file or the template itself")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    gen.add_argument("--json", action="store_true", help="one JSON object per completion")
    chat = sub.add_parser("chat", help="an interactive chat on stdin/stdout")
    _add_model_args(chat)
    _add_sampling_args(chat, "chat")
    chat.add_argument("--system", "--system-prompt", default=None,
                      help="a system message (--system-prompt: vLLM's `vllm chat` name)")
    chat.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                      help="a Jinja file or the template itself (default: the tokenizer's)")
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (as `vllm serve`)")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the checkpoint directory (as --model)")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="answer /v1 requests only with 'Authorization: Bearer KEY'")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="record no metrics (GET /metrics then shows the cache config only)")
    serve.add_argument("--enable-sleep-mode", action="store_true",
                       help="the engine may free the weights' and the KV cache's memory and take "
                            "it back (vLLM's flag): with env VLLM_SERVER_DEV_MODE=1, POST "
                            "/sleep?level=1|2, POST /wake_up[?tags=weights|kv_cache], GET "
                            "/is_sleeping")
    serve.add_argument("--max-request-body-bytes", type=int, default=None, metavar="N",
                       help="answer a request whose body is larger 413, unread (default 64 MiB, "
                            "or with --enable-prompt-embeds enough for one max_model_len prompt "
                            "of fp32 embeddings if that is more)")
    _add_serving_args(serve)
    batch = sub.add_parser("run-batch", help="answer a file of OpenAI batch requests, one JSON "
                                             "object a line (as `vllm run-batch`)")
    batch.add_argument("-i", "--input-file", required=True, metavar="PATH",
                       help="the requests: one {\"custom_id\", \"method\", \"url\", \"body\"} "
                            "a line; - reads stdin (vLLM's http(s) URLs are refused)")
    batch.add_argument("-o", "--output-file", required=True, metavar="PATH",
                       help="the responses, one {\"id\", \"custom_id\", \"response\", "
                            "\"error\"} a line in the input's order; - writes stdout")
    _add_model_args(batch)
    _add_serving_args(batch)
    from .runtime.bench import add_bench_args

    bench = sub.add_parser("bench", help="throughput (nano-vllm's workload) or single-stream latency")
    add_bench_args(bench)
    return parser


def _add_serving_args(p: argparse.ArgumentParser) -> None:
    """How requests are answered, for serve and run-batch (which answers each line as serve
    answers the same body)."""
    # vLLM's --seed is the engine's (serve samples no request of its own): the same here
    p.add_argument("--seed", dest="engine_seed", type=int, default=argparse.SUPPRESS,
                   help="as --engine-seed (vLLM's name for it)")
    p.add_argument("--served-model-name", default=None,
                   help="the name requests give as \"model\" (default: the model's path)")
    p.add_argument("--override-generation-config", type=_json_object, default=None,
                   metavar="JSON",
                   help="sampling defaults set over --generation-config's (vLLM's flag), e.g. "
                        "'{\"temperature\": 0.5}': repetition_penalty, temperature, top_k, "
                        "top_p, min_p, max_new_tokens (null unsets one); max_new_tokens also "
                        "caps a request's own max_tokens, as vLLM's server")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage gives prompt_tokens_details {\"cached_tokens\"}: the prompt "
                        "tokens found in the prefix cache (vLLM's flag)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="priority: requests' 'priority' field orders them, lower first")
    p.add_argument("--runner", choices=["auto", "generate", "pooling"], default="auto",
                   help="pooling: serve embeddings (/v1/embeddings), or a classifier's "
                        "/classify, /score and /rerank, instead of completions; auto: pooling "
                        "for a sentence-transformers checkpoint (Qwen3-Embedding) or a "
                        "Qwen3ForSequenceClassification (also one hf_overrides make)")
    p.add_argument("--reasoning-parser", choices=["qwen3"], default=None,
                   help="split a thinking model's <think> text from its answer (the "
                        "message's 'reasoning'); structured outputs then hold the answer")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice 'auto' (the default with tools) reads tool calls from "
                        "the answer (with --tool-call-parser)")
    # runtime.tool_calls.PARSERS (not imported here: the runtime brings torch).
    p.add_argument("--tool-call-parser", choices=["hermes", "qwen3_coder"], default=None,
                   help="the form of the model's tool calls: hermes (<tool_call> JSON "
                        "blocks, Qwen3's) or qwen3_coder (<tool_call><function=...> XML "
                        "blocks, Qwen3-Coder's)")
    p.add_argument("--enable-prompt-embeds", action="store_true",
                   help="/v1/completions takes 'prompt_embeds': base64 strings of "
                        "torch.save'd float tensors [tokens, hidden_size] (vLLM's flag; "
                        "their rows reach the model as given: serve trusted clients)")
    lora = p.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters: a request whose \"model\" names one of "
                           "--lora-modules runs with it (serve, with env "
                           "MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING=1: also one loaded by POST "
                           "/v1/load_lora_adapter)")
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                      type=_lora_module,
                      help="PEFT LoRA adapter directories, each served under its name (also "
                           "vLLM's JSON form '{\"name\": ..., \"path\": ...}')")
    lora.add_argument("--max-loras", type=int, default=1,
                      help="adapters in one batch at most (the engine's slots)")
    lora.add_argument("--max-lora-rank", type=int, default=16,
                      help="the largest adapter rank served")


def _check_serving_args(args) -> None:
    """_add_serving_args' flags that go together, checked before the model loads."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("minivllm: --enable-auto-tool-choice needs --tool-call-parser")
    if args.lora_modules and not args.enable_lora:
        raise SystemExit("minivllm: --lora-modules needs --enable-lora")
    names = [name for name, _ in args.lora_modules or ()]
    twice = next((name for k, name in enumerate(names) if name in names[:k]), None)
    if twice is not None:  # as vLLM, whose second load of the name fails at start-up
        raise SystemExit(f"minivllm: --lora-modules: the name {twice!r} is given twice")


def _served_name(args) -> str:
    """The name requests give as "model" (serve's and run-batch's)."""
    return args.served_model_name or args.model or "minivllm-demo"


def _torchrun_rank() -> int | None:
    from .runtime.distributed import torchrun_env

    launch = torchrun_env()
    return None if launch is None else launch.rank


def _resolve_model(args) -> str:
    from .runtime.demo import NOTICE, ensure_demo_model

    if args.model and args.demo:
        raise SystemExit("minivllm: give --model or --demo, not both")
    if args.model:
        return args.model
    if not _torchrun_rank():  # under torchrun, rank 0 alone speaks
        if not args.demo:
            print("minivllm: no --model given, so running the built-in demo model.", file=sys.stderr)
        print(NOTICE, file=sys.stderr)
    return ensure_demo_model()


def _lora_module(text: str) -> tuple[str, str]:
    """--lora-modules' NAME=PATH (or vLLM's JSON {"name": ..., "path": ...}) -> (name, path)."""
    if text.lstrip().startswith("{"):
        d = _json_object(text)
        if not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
            raise argparse.ArgumentTypeError(f"a JSON LoRA module needs \"name\" and \"path\" "
                                             f"strings, got {text!r}")
        return d["name"], d["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"a LoRA module is NAME=PATH, got {text!r}")
    return name, path


def _make_llm(args, model: str):
    from .runtime.llm import LLM

    demo = not args.model
    kwargs = dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                  block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                  kv_cache_dtype=args.kv_cache_dtype, persistent_decode=args.persistent_decode,
                  tensor_parallel_size=(_default_tp() if args.tensor_parallel_size is None
                                        else args.tensor_parallel_size),
                  seed=args.engine_seed,
                  enable_prefix_caching=args.enable_prefix_caching,
                  generation_config=args.generation_config,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  hf_overrides=_hf_overrides(args))
    if args.speculative_config is not None:
        kwargs["speculative_config"] = args.speculative_config
    if getattr(args, "override_generation_config", None) is not None:  # serve's, run-batch's
        kwargs["override_generation_config"] = args.override_generation_config
    if args.logprobs_mode != "raw_logprobs":
        kwargs["logprobs_mode"] = args.logprobs_mode
    if getattr(args, "reasoning_parser", None) is not None:  # serve's
        kwargs["reasoning_parser"] = args.reasoning_parser
    if getattr(args, "runner", "auto") != "auto":  # serve's
        kwargs["runner"] = args.runner
    if getattr(args, "scheduling_policy", "fcfs") != "fcfs":  # serve's
        kwargs["scheduling_policy"] = args.scheduling_policy
    if getattr(args, "enable_prompt_embeds", False):  # serve's
        kwargs["enable_prompt_embeds"] = True
    if getattr(args, "enable_sleep_mode", False):  # serve's
        kwargs["enable_sleep_mode"] = True
    if getattr(args, "enable_lora", False):  # serve's
        kwargs.update(enable_lora=True, max_loras=args.max_loras,
                      max_lora_rank=args.max_lora_rank)
    # An interactive CLI serves few sequences: keep the default KV cache small.
    kwargs["max_num_seqs"] = (args.max_num_seqs if args.max_num_seqs is not None
                              else 16 if demo or args.command == "chat" else 256)
    if demo and args.max_model_len is None:
        kwargs["max_model_len"] = 2048
    return LLM(model, **kwargs)


def _default_tp() -> int:
    """torchrun's WORLD_SIZE (every rank it started is one tensor-parallel rank), else 1."""
    from .runtime.distributed import torchrun_env

    launch = torchrun_env()
    return launch.world_size if launch is not None else 1


def _model_and_sampling_params(args, **extra):
    """The model directory and the flags' SamplingParams, checked before any engine starts: a
    flag left unset takes the model's generation_config.json value (LLM's generation_defaults,
    which reads the file only), else the command's default. A model runner "auto" would pool
    is refused here too: generate and chat only generate, so they take no --runner (its one
    other value, pooling, they could not use)."""
    from .runtime.llm import generation_defaults
    from .runtime.pooling import check_generates
    from .runtime.sampling_params import SamplingParams

    model = _resolve_model(args)
    check_generates(model, _hf_overrides(args), args.command)
    model_defaults, _ = generation_defaults(args.generation_config, None, model)
    layered = {name: (getattr(args, name) if getattr(args, name) is not None
                      else model_defaults.get(name, default))
               for name, default in COMMAND_DEFAULTS[args.command].items()}
    return model, SamplingParams(
        min_tokens=args.min_tokens, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop,
        ignore_eos=args.ignore_eos, **layered, **extra)


def _chat_template(value: str | None) -> str | None:
    """--chat-template's value as vLLM reads it: a file's contents, or the template itself
    when it is one; None (or "") for the tokenizer's own. Parsed here, so that a broken one is
    named before the engine starts."""
    if not value:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            template = f.read()
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template ({e})") from None
    return template


def _chat_prompts(llm, conversations, template):
    """llm.chat_prompts, with an error the template raises while rendering (it may call
    raise_exception) as a ValueError naming it."""
    import jinja2

    try:
        return llm.chat_prompts(conversations, chat_template=template)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from None


def cmd_generate(args) -> int:
    template = _chat_template(args.chat_template)
    model, params = _model_and_sampling_params(args, n=args.n, logprobs=args.logprobs,
                                               prompt_logprobs=args.prompt_logprobs)
    llm = _make_llm(args, model)
    texts = args.prompt or DEFAULT_PROMPTS
    prompts = (_chat_prompts(llm, [[{"role": "user", "content": t}] for t in texts], template)
               if args.chat_template is not None else texts)
    start = time.perf_counter()
    if args.stream:
        # Prompts are interleaved as they run: label every piece with its prompt number.
        ids: dict[str, int] = {}
        finals: dict = {}
        for delta in llm.stream(prompts, params):
            k = ids.setdefault(delta.request_id, len(ids))
            if delta.prompt_logprobs is not None and not args.json:
                print(f"[{k}] prompt logprob: {_prompt_logprob(delta):.4f}", flush=True)
            for c in delta.outputs:
                if c.text and not args.json:
                    print(f"[{k}.{c.index}] {c.text!r}", flush=True)
            finals[delta.request_id] = _merged(finals.get(delta.request_id), delta)
        # In input order (request ids count up); without --json the pieces were the text.
        outputs = [finals[i] for i in sorted(ids, key=int)] if args.json else []
    else:
        outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    elapsed = time.perf_counter() - start
    for text, out in zip(texts, outputs):
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": text, "index": c.index, "text": c.text,
                                  "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                                  "stop_reason": c.stop_reason,
                                  "cumulative_logprob": c.cumulative_logprob,
                                  "logprobs": _logprobs_json(c.logprobs),
                                  "prompt_logprobs": _logprobs_json(out.prompt_logprobs)}))
            else:
                label = f" [{c.index}]" if len(out.outputs) > 1 else ""
                if out.prompt_logprobs is not None and c.index == 0:
                    print(f"Prompt logprob: {_prompt_logprob(out):.4f} "
                          f"({len(out.prompt_token_ids)} tokens)")
                print(f"Prompt: {text!r}\nGenerated{label}: {c.text!r}  [{len(c.token_ids)} "
                      f"tokens, {c.finish_reason}]\n")
    s = llm.stats
    print(f"minivllm: {s.prompt_tokens_computed + s.prompt_tokens_cached} prompt tokens "
          f"({s.prompt_tokens_cached} from the prefix cache), {s.generation_tokens} generated "
          f"in {elapsed:.2f} s ({s.generation_tokens / max(elapsed, 1e-9):.1f} tok/s), "
          f"{s.steps} steps, {s.preemptions} preemptions", file=sys.stderr)
    return 0


def _merged(so_far, delta):
    """A stream's deltas of one request, accumulated into its whole output (RequestOutput.add,
    vLLM's, on a copy: the deltas are left as they came)."""
    if so_far is None:
        so_far = dataclasses.replace(delta, outputs=[], prompt_logprobs=None)
    whole = dataclasses.replace(so_far, outputs=[dataclasses.replace(c) for c in so_far.outputs])
    whole.add(delta, aggregate=True)
    whole.outputs.sort(key=lambda c: c.index)
    if whole.prompt_logprobs is None:  # the prompt's scores come with one delta only
        whole.prompt_logprobs = delta.prompt_logprobs
    return whole


def _prompt_logprob(out) -> float:
    """The prompt's logprob under the model: its scored tokens' (all but the first) summed."""
    return sum(e[t].logprob for t, e in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]))


def _logprobs_json(logprobs):
    """Per generated (or prompt) token, {token id: logprob} of the top ids and the sampled (or
    prompt) one, None for a prompt's first token; None if not asked for."""
    if logprobs is None:
        return None
    return [None if entry is None else {str(i): lp.logprob for i, lp in entry.items()}
            for entry in logprobs]


def cmd_serve(args) -> int:
    from .runtime.server import OpenAIServer

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit("minivllm: give the model once, as MODEL or --model")
        args.model = args.model_tag
    _check_serving_args(args)
    if args.max_request_body_bytes is not None and args.max_request_body_bytes < 1:
        raise SystemExit("minivllm: --max-request-body-bytes must be a positive number of bytes")
    _check_address(args.host, args.port)
    model = _resolve_model(args)
    cap = _override_max_tokens(args, model)
    llm = _make_llm(args, model)
    name = _served_name(args)
    server = OpenAIServer(llm, host=args.host, port=args.port, model_name=name,
                          api_key=args.api_key, disable_log_stats=args.disable_log_stats,
                          enable_auto_tool_choice=args.enable_auto_tool_choice,
                          tool_call_parser=args.tool_call_parser,
                          lora_modules=dict(args.lora_modules or ()),
                          max_request_body_bytes=args.max_request_body_bytes,
                          override_max_tokens=cap,
                          enable_prompt_tokens_details=args.enable_prompt_tokens_details)
    host, port = server.address
    # SIGTERM (kill, docker stop, a supervisor) stops the server as Ctrl-C does: the socket
    # closed, the engine (and any workers) shut down, exit 0; by default it ended the process
    # at once.
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"minivllm: serving {name!r} at http://{host}:{port}/v1 (Ctrl-C stops)", file=sys.stderr,
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.http.server_close()
        llm.shutdown()
    return 0


def _override_max_tokens(args, model: str) -> int | None:
    """The cap vLLM's server puts on every request's max_tokens for --generation-config and
    --override-generation-config (generation_config.override_max_tokens); both are checked
    here, before the model loads (LLM reads them again, reading a file only)."""
    from .runtime.generation_config import override_max_tokens
    from .runtime.llm import generation_defaults

    defaults, _ = generation_defaults(args.generation_config, args.override_generation_config,
                                      model)
    return override_max_tokens(args.generation_config, args.override_generation_config, defaults)


def cmd_run_batch(args) -> int:
    from .runtime import run_batch

    _check_serving_args(args)
    # The whole input is read and checked, and the output's place, before the model loads: a
    # line that is no batch request ends the run, as vLLM's, with nothing run or written.
    requests = run_batch.read_input(args.input_file)
    run_batch.check_output(args.output_file)
    model = _resolve_model(args)
    cap = _override_max_tokens(args, model)
    llm = _make_llm(args, model)
    try:
        run_batch.run_batch(llm, requests, args.output_file, model_name=_served_name(args),
                            enable_auto_tool_choice=args.enable_auto_tool_choice,
                            tool_call_parser=args.tool_call_parser,
                            lora_modules=dict(args.lora_modules or ()),
                            override_max_tokens=cap,
                            enable_prompt_tokens_details=args.enable_prompt_tokens_details)
    finally:
        llm.shutdown()
    return 0


def _interrupt(signum, frame):
    """A signal handler that stops the main thread as Ctrl-C does."""
    signal.signal(signum, signal.SIG_DFL)  # a second one ends the process at once
    raise KeyboardInterrupt


def cmd_chat(args) -> int:
    template = _chat_template(args.chat_template)
    model, params = _model_and_sampling_params(args)
    llm = _make_llm(args, model)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    # A model without a tokenizer or a chat template can hold no conversation: said once, as
    # an error (exit 2), not after every line as if /reset could mend it.
    _chat_prompts(llm, [*messages, {"role": "user", "content": "Hello"}], template)
    interactive = sys.stdin.isatty()
    if interactive:
        print("minivllm chat: type a message; /reset clears the conversation, /exit or Ctrl-D "
              "quits.", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            prompt = _chat_prompts(llm, messages, template)[0]
            deltas = llm.stream([prompt], params)
        except ValueError as e:  # e.g. the conversation outgrew max_model_len: this turn only
            messages.pop()
            print(f"minivllm: error: {e} (/reset starts the conversation over)", file=sys.stderr)
            continue
        try:
            for delta in deltas:
                for c in delta.outputs:
                    reply.append(c.text)
                    print(c.text, end="", flush=True)
        except KeyboardInterrupt:
            pass  # the stream's cleanup aborts the request
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # minivllm's own start-up report (backend, KV cache size, graph capture) at INFO, as vLLM
    # does; other libraries' loggers stay at WARNING.
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        # Under torchrun every rank runs this; rank 0 alone reports, as it alone prints the
        # completions. The other ranks still log warnings and errors.
        level = "WARNING" if _torchrun_rank() else "INFO"
        logging.getLogger("minivllm").setLevel(os.environ.get("MINIVLLM_LOG_LEVEL", level))
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "run-batch":
            return cmd_run_batch(args)
        if args.command == "bench":
            from .runtime.bench import main as bench_main

            bench_main(args)
            return 0
        return cmd_chat(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"minivllm: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader of the output went away (`minivllm generate | head -1`): stop quietly, as
        # Unix tools do (128 + SIGPIPE), not with a traceback; stdout is pointed at /dev/null so
        # that the interpreter's last flush of it does not fail again at exit.
        _stdout_to_devnull()
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        # Ctrl-C while the model loads or generate runs: the command stops, without a
        # traceback (chat's own Ctrl-C at its prompt already ends the session with 0).
        print("\nminivllm: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


def _stdout_to_devnull() -> None:
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
