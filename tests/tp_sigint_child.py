"""Child process of test_tp_lifecycle's Ctrl-C test: a TP=2 engine that prints its worker's pid,
survives a Ctrl-C during generation (the step in flight finishes on both ranks, the request is
dropped, the engine goes on), and exits on the next one. Imports no transformers."""

import signal
import sys

from minivllm import LLM, SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPT = [{"prompt_token_ids": [1, 2, 3]}]


def main(path: str) -> None:
    # As a terminal's foreground process: SIGINT handled and unblocked. A test process started in
    # the background of a non-interactive shell (`.ci/run &`) ignores SIGINT, and its children
    # inherit that through exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    llm = LLM(path, tensor_parallel_size=2, num_kv_blocks=64, attention_backend="reference",
              device="cpu")
    print("worker", llm.engine.runner.workers.procs[0].pid, flush=True)
    try:
        print("generating", flush=True)
        llm.generate(PROMPT, LONG, use_tqdm=False)
        print("finished uninterrupted", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    out = llm.generate(PROMPT, SHORT, use_tqdm=False)
    print("after", *out[0].outputs[0].token_ids, flush=True)
    print("generating", flush=True)
    llm.generate(PROMPT, LONG, use_tqdm=False)  # the second Ctrl-C ends the process in here
    print("finished uninterrupted", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
