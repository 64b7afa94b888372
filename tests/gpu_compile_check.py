"""Compile this session's GPU-only kernel variants for sm_90 (H100/H200) without a GPU, and
report each one's registers and spills (ptxas -v). Run as a script, without TRITON_INTERPRET:
the interpreter runs what the compiler refuses (a loop-carried variable whose type changes, say).
tests/test_gpu_compile.py runs it."""

from __future__ import annotations

import json
import sys
import tempfile

from benchmarks.compile_decode_kernel import compile_for
from minivllm.kernels.decode_head import _decode_head_kernel
from minivllm.kernels.decode_stem import _decode_stem_kernel
from minivllm.kernels.sample_kernel import _final_argmax_kernel, _partial_argmax_kernel


# (name, kernel, argument types, constexprs, num_warps, num_stages), as the engine launches them
# at the Qwen3-0.6B shape in bf16.
CASES = [
    *[(f"decode_head M={m}{' tile loop' if loop else ''}", _decode_head_kernel,
       dict(x_ptr="*bf16", res_ptr="*bf16", nw_ptr="*bf16", w_ptr="*bf16", logits_ptr="*fp32",
            max_ptr="*fp32", arg_ptr="*i32", N="i32", tiles="i32", eps="fp32"),
       dict(M=m, K=1024, M_PAD=16, BLOCK_N=64, BLOCK_K=128, BLOCK_H=1024, PRECISION="tf32",
            TILE_LOOP=loop), 4, 4)
      for m in (1, 2) for loop in (False, True)],
    ("decode_stem", _decode_stem_kernel,
     dict(ids_ptr="*i64", pos_ptr="*i64", embed_ptr="*bf16", inv_freq_ptr="*fp32", x_ptr="*bf16",
          res_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", hidden="i32", scale="fp32"),
     dict(HALF=64, BLOCK_H=1024), 4, 3),
    ("greedy partial arg-max", _partial_argmax_kernel,
     dict(logits_ptr="*fp32", temp_ptr="*fp32", seeds_ptr="*fp32", steps_ptr="*fp32",
          val_ptr="*fp32", idx_ptr="*i32", V="i32", stride_row="i32", num_chunks="i32"),
     dict(CHUNK=1024, BLOCK=1024, FAST_LOG=False, GREEDY=True), 4, 3),
    *[(f"arg-max of {n} tiles, second output {out2}", _final_argmax_kernel,
       dict(val_ptr="*fp32", idx_ptr="*i32", out_ptr="*i64", num_chunks="i32",
            out2_ptr="*i64" if out2 else "constexpr"),
       dict(BLOCK_S=n, HAS_OUT2=out2) | ({} if out2 else dict(out2_ptr=None)), w, 3)
      for n, out2, w in ((256, False, 1), (4096, True, 4))],
]


def main() -> int:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, kernel, types, consts, warps, stages in CASES:
            sig = {a: "constexpr" if a in consts else types[a] for a in kernel.arg_names}
            _, _, registers, spill_bytes = compile_for(
                kernel, sig, consts, dict(num_warps=warps, num_stages=stages), 90, tmp)
            results.append(dict(name=name, registers=registers, spill_bytes=spill_bytes))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
