"""benchmarks/guide_mask_cost.py: its synthetic vocabulary is what a byte-level tokenizer shows
TokenIndex (every token's bytes come back as they were made), and a small run writes each
measurement it names."""

import json

from benchmarks.guide_mask_cost import SyntheticByteLevelTokenizer, main, synthetic_vocabulary
from minivllm.runtime.guide import TokenIndex


def test_the_synthetic_vocabulary_reads_back_as_its_bytes():
    tokens = synthetic_vocabulary(2_000)
    assert len(tokens) == len(set(tokens)) == 2_000
    index = TokenIndex(SyntheticByteLevelTokenizer(tokens), len(tokens))
    assert index.bytes == dict(enumerate(tokens))
    # multi-byte characters (CJK) are whole text tokens; lone high bytes are partial ones
    assert any(ord(c) > 0x4000 for t in index.text.values() for c in t)
    assert {i for i, _ in index.partial} == set(range(0x80, 0x100))


def test_a_small_run_writes_every_measurement(tmp_path):
    out = tmp_path / "r.json"
    assert main(["--vocab", "3000", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["first_visit_ms"]) == 4 and len(result["walk_ms"]) == 3
    assert all(v > 0 for v in result["first_visit_ms"].values())
    assert result["walk_ms"]["schema"]["states"] == 56 and result["sampling_batch_ms"] > 0
    assert result["sampling_batch_bits_ms"] > 0


def test_sampling_batch_cost_runs_small(tmp_path):
    from benchmarks.sampling_batch_cost import main as batch_main

    out = tmp_path / "b.json"
    assert batch_main(["--rows", "3", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"] == 3
