"""What building a step's sampling batch costs the host for rows that send id lists, on this CPU.

    PYTHONPATH=. python benchmarks/sampling_batch_cost.py [--rows 256] [--json PATH]

A penalised row (presence, frequency or repetition penalty) sends its output ids, and with a
repetition penalty its prompt's, every step it samples: the engine rebuilds its row each step.
This times make_sampling_batch (the median of 5) for `--rows` penalised rows of 100-1,024 output
and 100-1,024 prompt ids drawn from a 151,000-id vocabulary, seed 0; guide_mask_cost.py times
structured outputs' rows. Session 62 (BENCHMARKS.md) measured it before and after the lists were
padded from one chained array.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from minivllm.functional.sampling import SamplingRow, make_sampling_batch

VOCAB = 151_000


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rng = random.Random(0)

    def ids():
        return tuple(rng.randrange(VOCAB) for _ in range(rng.randint(100, 1024)))

    rows = [SamplingRow(temperature=0.7, seed=i, presence_penalty=0.5, repetition_penalty=1.1,
                        output_ids=ids(), prompt_ids=ids()) for i in range(args.rows)]
    times = []
    for _ in range(5):
        start = time.perf_counter()
        make_sampling_batch(rows, vocab_size=VOCAB)
        times.append(time.perf_counter() - start)
    ms = 1e3 * statistics.median(times)
    print(f"{args.rows} penalised rows of 100-1024 output and prompt ids: {ms:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": args.rows, "ms": ms}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
