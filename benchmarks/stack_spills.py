"""What the persistent decode stack (kernels/decode_layer.py) costs in registers at each shape,
compiled for sm_90 on this machine, no GPU needed: ptxas's registers, stack frame and spill bytes
a thread, at 1 and 2 rows.

    python benchmarks/stack_spills.py [--shapes qwen3-0.6b,qwen3-1.7b] [--json PATH]

Why: the stack ran the single stream 2.3-2.5x slower than the compiled layers at Qwen3-1.7B's and
8B's widths (BENCHMARKS.md session 56), untraced. Compiled, its Qwen3-1.7B form spilled ~1.8 KB a
thread (Qwen3-0.6B's none): each program holds its GEMV loads in registers (o_proj's, gate's and
up's together from the merge phase on), and load_columns sizes them (session 74).

Each shape's stack is launched once (one layer) under Triton's interpreter as on an H100
(tests/kernel_launches.py's as_on_a_gpu: the launch is recorded, not run), then compiled in a
child process without the interpreter; ptxas -v reads the PTX."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b")
PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def record(shapes: list[str]) -> list[dict]:
    """The stack's launch at each shape and 1-2 rows (recorded by the interpreter, not run)."""
    import torch
    from _pytest.monkeypatch import MonkeyPatch

    import kernel_launches
    from minivllm import random_params
    from minivllm.functional.model import forward
    from minivllm.kernels.backends import select_backend
    from minivllm.kernels.decode_layer import with_persistent_layers
    from minivllm.state.batch import SeqChunk, make_batch
    from minivllm.state.cache import init_cache
    from minivllm.state.config import SHAPES as CONFIGS, ModelConfig

    kernel_launches.install()
    launches = []
    for shape in shapes:
        config = ModelConfig(**{**CONFIGS[shape], "num_layers": 1})
        params = random_params(config, dtype=torch.bfloat16)
        cache = init_cache(params, num_blocks=8, block_size=16)
        patch = MonkeyPatch()
        kernel_launches.as_on_a_gpu(patch)
        backend = select_backend("cpu", "triton")
        for rows in (1, 2):
            before = set(kernel_launches.LAUNCHES)
            tables = [[3 * s, 3 * s + 1, 3 * s + 2] for s in range(rows)]  # 41 tokens each
            batch = make_batch([SeqChunk([1], 40, t) for t in tables], block_size=16)
            with_persistent_layers(forward, params, cache)(params, cache, batch, backend)
            launches += [dict(kernel_launches.LAUNCHES[key], shape=shape, rows=rows)
                         for key in set(kernel_launches.LAUNCHES) - before
                         if kernel_launches.LAUNCHES[key]["name"] == "_decode_stack_kernel"]
        patch.undo()
    return launches


def compile_and_count(launches: list[dict]) -> list[dict]:
    """Each launch compiled for sm_90: its loads' columns, registers and spill bytes a thread."""
    import triton

    from kernel_launches import compile_for_sm90, constexprs

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    rows = []
    for launch in launches:
        consts = constexprs(launch)
        kernel = compile_for_sm90(launch)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
        os.unlink(f.name)
        stack, stores, loads = map(int, PTXAS.search(out).groups())
        regs = int(re.search(r"Used (\d+) registers", out).group(1))
        rows.append(dict(shape=launch["shape"], rows=launch["rows"],
                         loads={k: consts[k] for k in ("BK_H", "BK_ATT", "BK_I")},
                         row_blocks={k: consts[k] for k in ("BN_QKV", "BN_H", "BN_I")},
                         registers=regs, stack_bytes=stack, spill_store_bytes=stores,
                         spill_load_bytes=loads))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--compile", help=argparse.SUPPRESS)  # the child: launches' JSON path
    args = parser.parse_args()
    if args.compile:
        print(json.dumps(compile_and_count(json.load(open(args.compile)))))
        return
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    launches = record(args.shapes.split(","))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(launches, f)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, "--compile", f.name], env=env,
                          capture_output=True, text=True)
    os.unlink(f.name)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    print("shape       rows  loads (BK_H, BK_ATT, BK_I)  row blocks (qkv, hidden, inter)  "
          "registers  stack  spill stores / loads (bytes a thread)")
    for r in rows:
        print(f"{r['shape']:<11} {r['rows']:>4}  {str(tuple(r['loads'].values())):<26}  "
              f"{str(tuple(r['row_blocks'].values())):<31}  {r['registers']:>9}  "
              f"{r['stack_bytes']:>5}  {r['spill_store_bytes']} / {r['spill_load_bytes']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
