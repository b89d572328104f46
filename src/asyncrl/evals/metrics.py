"""avg@n and pass@k: what an eval reports per environment (formulas in docs/evals.md, checked by tests).

Each of m examples gets n samples. avg@n is the mean reward over all m * n samples. pass@k is the chance
that at least one of k samples drawn without replacement from an example's n passes, averaged over the
examples; with c passing samples out of n, the unbiased estimator (Chen et al. 2021, "Evaluating Large
Language Models Trained on Code") is

    pass@k = 1 - C(n - c, k) / C(n, k)

which is 1 whenever fewer than k samples fail. Looking at only k of the n samples instead would waste the
others; looking at all n would report pass@n whatever k is asked for.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one example with `c` of its `n` samples passing."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def passes(reward: float, error: str | None, threshold: float) -> bool:
    """A sample passes when its reward reaches the environment's threshold. An errored rollout scores 0 and
    fails: leaving it out would score a model higher for breaking the reward function."""
    return error is None and reward >= threshold


@dataclass
class EvalSample:
    """One rollout of an eval: a line of results.jsonl."""

    env: str
    example: int  # position in the environment's eval_examples stream
    sample: int  # 0 .. n - 1
    prompt: str  # the last prompt message
    answer: str
    completion: str  # the last assistant message, what the rubric scored
    reward: float
    passed: bool
    metrics: dict[str, float]
    error: str | None
    finish_reason: str
    turns: int
    is_truncated: bool
    completion_tokens: int | None  # None over the chat route, which returns no per-sample token counts
    policy_version: int | None  # oldest policy version among the sampled tokens (token route only)
    messages: list[dict]  # the whole conversation: the prompt, every answer and every environment message


def summarize(samples: Sequence[EvalSample], n: int, ks: Sequence[int]) -> dict[str, float]:
    """avg@n, pass@k for each k, and the means of the rubric's metrics, over one environment's samples."""
    by_example: dict[int, list[EvalSample]] = defaultdict(list)
    for sample in samples:
        by_example[sample.example].append(sample)
    if any(len(group) != n for group in by_example.values()):
        raise ValueError(f"every example needs exactly n = {n} samples")
    summary = {
        "examples": len(by_example),
        "rollouts": len(samples),
        "errored": sum(s.error is not None for s in samples),
        "truncated": sum(s.is_truncated for s in samples),
        f"avg@{n}": statistics.fmean(s.reward for s in samples),
    }
    for k in ks:
        summary[f"pass@{k}"] = statistics.fmean(
            pass_at_k(n, sum(s.passed for s in group), k) for group in by_example.values()
        )
    for name in sorted({name for s in samples for name in s.metrics}):
        summary[f"mean/{name}"] = statistics.fmean(s.metrics.get(name, 0.0) for s in samples)
    return summary
