"""What building a step's sampling batch costs the host for rows that send id lists, on this CPU.

    PYTHONPATH=. python benchmarks/sampling_batch_cost.py [--rows 256] [--json PATH]

A penalised row (presence, frequency or repetition penalty) sends its output ids, and with a
repetition penalty its prompt's, every step it samples: the engine rebuilds its row each step.
This times make_sampling_batch (the median of 5) for `--rows` penalised rows of 100-1,024 output
and 100-1,024 prompt ids drawn from a 151,000-id vocabulary, seed 0, with the ids as int64 arrays
(the engine's rows since session 63: Sequence.output_array, prompt_array) and as tuples;
guide_mask_cost.py times structured outputs' rows. Sessions 62-63 (BENCHMARKS.md) measured it
before and after the lists were padded from one chained array, then a row at a time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import numpy as np

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

    lists = [(ids(), ids()) for _ in range(args.rows)]
    result = {"rows": args.rows}
    for form, kind in (("arrays", lambda x: np.array(x, dtype=np.int64)), ("tuples", tuple)):
        rows = [SamplingRow(temperature=0.7, seed=i, presence_penalty=0.5, repetition_penalty=1.1,
                            output_ids=kind(out), prompt_ids=kind(prompt))
                for i, (out, prompt) in enumerate(lists)]
        times = []
        for _ in range(5):
            start = time.perf_counter()
            make_sampling_batch(rows, vocab_size=VOCAB)
            times.append(time.perf_counter() - start)
        result[f"ms_{form}"] = ms = 1e3 * statistics.median(times)
        print(f"{args.rows} penalised rows of 100-1024 output and prompt ids as {form}: "
              f"{ms:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
