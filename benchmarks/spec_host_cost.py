"""Host cost of a single stream's step on CPU, plain and with n-gram speculation, model stubbed.

`bench --latency` with n-gram is host-bound in part: speculation turns asynchronous scheduling
off, so each step's host work (schedule, propose, the step's inputs, sampling batch, fill,
launch, the tokens' read-back and their recording) adds to the device's time instead of hiding
under it. This runs the engine's GPU path on the CPU with the forward stubbed: the decode graphs
and the verification graphs are the runner's own (DecodeGraphs, _make_verify_graphs), their
replays (and the prompt step's forward) replaced by logits whose arg-max is the next token of a
cycle, so a prompt that repeats the cycle has every n-gram draft accepted (the step shape of a
repetitive stream). Sampling runs for real.

usage: python benchmarks/spec_host_cost.py [--k 4] [--tokens 256] [--prof] [--runs 5]
"""
import argparse
import cProfile
import pstats
import statistics
import sys
import time

sys.path.insert(0, "tests")
import torch
from hf_tiny import make_hf_model, save_checkpoint

from minivllm import LLM, SamplingParams
from minivllm.runtime.graphs import DecodeGraphs
from minivllm.state.config import ceil_div

VOCAB, PERIOD, FIRST = 1000, 50, 3
torch.set_num_threads(1)


def next_in_cycle(ids: torch.Tensor) -> torch.Tensor:
    return (ids - FIRST + 1) % PERIOD + FIRST


def one_hot_logits(ids: torch.Tensor) -> torch.Tensor:
    logits = torch.zeros(ids.shape[0], VOCAB)
    logits[torch.arange(ids.shape[0]), next_in_cycle(ids)] = 1.0
    return logits


def stub(llm) -> None:
    """The runner's decode and verification graphs, each replay a one-hot of the next token (and
    the prompt step's forward: the stream stays on the cycle from its first token)."""
    r = llm.engine.runner

    def prefill_forward(params, cache, batch, backend, **kw):  # the prompt's step
        return one_hot_logits(batch.input_ids[batch.logits_indices]), cache
    r.prefill_forward = prefill_forward
    g = DecodeGraphs(r.params, r.cache, r.backend, max_num_seqs=r.config.max_num_seqs,
                     max_blocks_per_seq=ceil_div(r.config.max_model_len, r.block_size),
                     compile_forward=False)

    def decode_replay(b):
        logits = one_hot_logits(g.input_ids[:b])
        if g.picks_greedy(b):  # the graph's own greedy pick, as the captured graph leaves it
            g.greedy_tokens[:b] = g.input_ids[:b] = logits.argmax(dim=-1)
        return logits
    g.replay = decode_replay
    r.graphs = g
    if llm.engine.config.speculative is None:
        return
    graphs, mirrors = r._make_verify_graphs()
    for graph in graphs:
        def replay(n, graph=graph):
            rows = graph.batch.logits_indices[:n]
            return one_hot_logits(graph.batch.input_ids[rows])
        graph.replay = replay
    r.verify_graphs, r.verify_mirrors = graphs, mirrors


def make(model_dir, k: int):
    spec = {"method": "ngram", "num_speculative_tokens": k} if k else None
    llm = LLM(model_dir, max_num_seqs=2, max_model_len=2048, num_kv_blocks=256, block_size=16,
              attention_backend="reference", speculative_config=spec)
    stub(llm)
    return llm


def run(llm, tokens: int):
    """Host ms of each step of one stream of `tokens` greedy tokens after a cyclic 512-token
    prompt (its prompt step excluded)."""
    eng = llm.engine
    prompt = [FIRST + i % PERIOD for i in range(512)]
    eng.add_requests([{"prompt_token_ids": prompt}],
                     [SamplingParams(temperature=0, ignore_eos=True, max_tokens=tokens)])
    eng.step()  # the prompt
    times = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prof", action="store_true", help="cProfile the n-gram runs")
    a = ap.parse_args()
    d = save_checkpoint(make_hf_model(std=0.3, vocab_size=VOCAB, max_position_embeddings=2048),
                        "/tmp/spec_hc_model")
    for k in (0, a.k):
        llm = make(d, k)
        run(llm, 16)  # warm
        prof = cProfile.Profile() if a.prof and k else None
        medians, steps = [], 0
        for _ in range(a.runs):
            if prof:
                prof.enable()
            t = run(llm, a.tokens)
            if prof:
                prof.disable()
            medians.append(statistics.median(t))
            steps = len(t)
        s = llm.engine.stats
        acc = f", {s.spec_accepted_tokens} of {s.spec_draft_tokens} drafts accepted" if k else ""
        print(f"k={k}: {steps} steps for {a.tokens} tokens, host ms a step (median of each run): "
              + " ".join(f"{m:.3f}" for m in medians) + acc)
        if prof:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
