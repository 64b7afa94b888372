"""benchmarks/spec_host_cost.py measures what it says: a greedy stream through the runner's own
verification graphs (stubbed replays) with every n-gram draft accepted, and the plain stream one
step a token through the decode graphs."""

from hf_tiny import make_hf_model, save_checkpoint

from benchmarks import spec_host_cost as shc


def test_the_stub_streams_take_the_graph_paths_and_accept_every_draft(tmp_path):
    d = save_checkpoint(make_hf_model(std=0.3, vocab_size=shc.VOCAB,
                                      max_position_embeddings=2048), tmp_path / "model")
    plain = shc.make(d, 0)
    # a step a token after the prompt's, whose step launched the first; the last step reads the
    # last token (asynchronous scheduling)
    assert len(shc.run(plain, 24)) == 24
    spec = shc.make(d, 4)
    runner, replays = spec.engine.runner, []
    for graph in runner.verify_graphs:
        inner = graph.replay
        graph.replay = lambda n, inner=inner: replays.append(n) or inner(n)
    times = shc.run(spec, 41)
    s = spec.engine.stats
    assert s.spec_draft_tokens > 0 and s.spec_accepted_tokens == s.spec_draft_tokens
    # the 40 tokens after the prompt step's: 8 verifications of k + 1 = 5 rows, each from a
    # verification graph
    assert replays == [5] * len(times) == [5] * 8
