"""A model runner that "samples" a script chosen by the test: the real LLMEngine (checks,
scheduling, stop rules, detokenization, statistics, outputs) runs over it, so that every
expectation is known token by token from the rules the engine documents (test_detok_audit.py,
test_engine_mutants.py)."""

from __future__ import annotations

from minivllm.runtime.runner import StepResult, TokenLogprobs


def lp_of(step: int) -> float:
    """The logprob the script reports for a sequence's step-th generated token."""
    return -(step + 1) / 8.0


class Scripted:
    """Samples scripts[row.seed][k] as a sequence's k-th generated token (k from 0); records each
    step (steps_seen), each sampled row (rows), the output ids its penalties see (output_ids:
    the row's, and a pending one from the last step's tokens, StepInput.pending_ids, as the real
    runner completes them on the device) and its banned ids (banned[(seed, k)]), and fails if
    the script samples an id the row bans (the sampler never would)."""

    def __init__(self, config, scripts: dict[int, list[int]]):
        self.model_config = config.model_config
        self.num_blocks = config.num_kv_blocks
        self.scripts = scripts
        self.steps_seen = []
        self.rows = []
        self.output_ids = []
        self.last_tokens = None
        self.banned: dict[tuple[int, int], tuple[int, ...]] = {}

    def execute(self, step):
        self.steps_seen.append(step)
        tokens, lps = [], []
        pending = {row: (column, r) for row, column, r in step.pending_ids}
        for k, row in enumerate(step.rows):
            seen = tuple(int(i) for i in row.output_ids)
            if k in pending:
                column, r = pending[k]
                assert column == len(seen), "a pending id goes right after the row's known ids"
                seen += (self.last_tokens[r],)
            self.output_ids.append(seen)
            n = step.steps[k] if step.steps is not None else row.step
            t = self.scripts[row.seed][n]
            self.banned[(row.seed, n)] = tuple(row.banned_ids)
            self.rows.append(row)
            assert t not in row.banned_ids, f"the script samples banned id {t} at step {n}"
            tokens.append(t)
            lps.append(TokenLogprobs(lp_of(n), 1, [t], [lp_of(n)]))
        want = any(r.logprobs is not None for r in step.rows)
        self.last_tokens = tokens
        return StepResult(tokens, lps if want else None)


class _Done:
    def __init__(self, result):
        self._result = result

    def result(self):
        return self._result


class ScriptedAsync(Scripted):
    """The same, launched: the engine schedules step N+1 before it reads step N's tokens."""

    def launch(self, step):
        return _Done(self.execute(step))
