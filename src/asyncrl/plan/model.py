"""A model of one RL step from measured parts, and the best split of N GPUs between inference and trainer.

Every part is a mean rate or a fixed latency, but G and T may vary from step to step (their coefficients
of variation, `generate_cv` and `train_cv`). Per step, with B samples of p prompt and c completion tokens,
R inference replicas of g generated tokens/s each, K trainer ranks of t trained tokens/s each at efficiency
e(K) = f ** log2(K):

    G = B c / (R g)                    generation of one batch
    T = B (p + c) / (K t e(K))         forward, backward and optimizer of one batch
    P                                  the trainer held by publishing the weights
    H = W + D + S                      handoffs: W from the trainer's publish to the new weights live on
                                       the servers, D from a batch's cut (or the trainer's previous step,
                                       if later) to the trainer starting on it, S from new weights live
                                       (or the previous batch's cut, if later) to the first group of the
                                       batch they allow sent out (the orchestrator learning of them, the
                                       engine's queue)

On GPUs of their own, at max_async_level L, batch n + L + 1 can only be generated once version n is
live, so a step is bounded by each side (with its own handoff: a batch starts S after the one before it
is cut, the trainer takes a batch D after it is free) and by the round trip generate -> train -> publish
spread over L + 1 steps:

    step = max(G + S, T + P + D, (G + T + P + H) / (L + 1))

L = 0 (sync) gives G + T + P + H; at L >= 1 with small handoffs it is about max(G, T + P). That max is of
means: where the sides take about as long and vary, a slow batch on one side stalls the other, and the
mean step is longer. With a variation given, the step is the mean of the same recurrence run over
`SIMULATED_STEPS` steps whose G and T are drawn from log-normal distributions of those means and
coefficients of variation (seeded, so a prediction is reproducible; the draws are scaled to the exact
means, so at L = 0 the sum is the formula's). Colocated
(inference and trainer share every GPU) with rates measured alone, they take turns: step = G + T + P + H,
with no overlap gain. With rates measured while colocated (`rates_while_colocated`, as calibrating on a
colocated run gives), the slowdown of each by the other is inside g and t, and the formula of GPUs of
their own applies with R = K = N.
"""

from __future__ import annotations

import json
import math
import random
import tomllib
from dataclasses import dataclass
from pathlib import Path

from asyncrl.errors import AsyncRLError

MODES = ("filesystem", "broadcast", "colocated")
SIMULATED_STEPS = 2000  # steps of the recurrence with variation; the first quarter is left out (filling)


@dataclass(frozen=True)
class Publish:
    trainer_s: float  # the trainer held per publish
    load_s: float  # from the trainer's publish to the new weights live on the servers (W)


@dataclass(frozen=True)
class Parts:
    batch_size: int
    prompt_tokens: float
    completion_tokens: float
    max_async_level: int
    engine_tokens_per_s: float  # generated tokens/s of one replica at the workload's batch
    trainer_tokens_per_s: float  # trained tokens/s of one rank
    efficiency_per_doubling: float  # trainer tokens/s per rank at 2K ranks / at K ranks
    publish: dict[str, Publish]
    batch_handoff_s: float = 0.0  # D
    dispatch_latency_s: float = 0.0  # S
    gpus_per_node: int = 8
    rates_while_colocated: bool = False  # g and t measured with server and trainer sharing their GPUs
    generate_cv: float = 0.0  # step-to-step standard deviation of G over its mean
    train_cv: float = 0.0  # the same of T

    def efficiency(self, ranks: int) -> float:
        return self.efficiency_per_doubling ** math.log2(ranks)


@dataclass(frozen=True)
class Prediction:
    inference_gpus: int
    trainer_gpus: int
    mode: str
    step_s: float
    trained_tokens_per_s: float
    trainer_idle: float
    inference_idle: float
    bound: str  # "generation", "training" or "round trip"


def predict(parts: Parts, replicas: int, ranks: int, mode: str) -> Prediction:
    """The step of `replicas` one-GPU servers and `ranks` trainer ranks; colocated: on the same GPUs."""
    if mode not in parts.publish:
        raise AsyncRLError(f"the parts have no publish time for mode '{mode}' (add publish.{mode})")
    publish = parts.publish[mode]
    generate = parts.batch_size * parts.completion_tokens / (replicas * parts.engine_tokens_per_s)
    trained = parts.batch_size * (parts.prompt_tokens + parts.completion_tokens)
    training = trained / (ranks * parts.trainer_tokens_per_s * parts.efficiency(ranks))  # T
    train = training + publish.trainer_s
    round_trip = generate + train + publish.load_s + parts.batch_handoff_s + parts.dispatch_latency_s
    if mode == "colocated" and not parts.rates_while_colocated:
        step, bound = round_trip, "round trip"
    else:
        terms = {
            "generation": generate + parts.dispatch_latency_s,  # a batch starts S after the one before is cut
            "training": train + parts.batch_handoff_s,  # and the trainer takes it D after it is free
            "round trip": round_trip / (parts.max_async_level + 1),
        }
        bound = max(terms, key=terms.__getitem__)  # the side that bounds it on average
        step = terms[bound]
        if parts.generate_cv > 0 or parts.train_cv > 0:
            step = simulated_step(parts, generate, training, publish)
    return Prediction(replicas, ranks, mode, step, trained / step, 1 - train / step, 1 - generate / step, bound)


def simulated_step(parts: Parts, generate: float, train: float, publish: Publish) -> float:
    """The mean step of the recurrence the formula bounds, with G and T varying from step to step:
    batch n starts S after batch n - 1 is cut and version n - L - 1 is live, the trainer takes it D after
    it is cut and the trainer is free, and version n is live W after the trainer publishes it."""
    steps, level, first = SIMULATED_STEPS, parts.max_async_level, SIMULATED_STEPS // 4
    g = _draws(generate, parts.generate_cv, steps, first + 1, seed=1)
    t = _draws(train, parts.train_cv, steps, first + 1, seed=2)
    cut, trained, live = [0.0] * steps, [0.0] * steps, [0.0] * steps
    for n in range(steps):
        allowed = live[n - level - 1] if n > level else 0.0
        cut[n] = max(cut[n - 1] if n else 0.0, allowed) + parts.dispatch_latency_s + g[n]
        start = max(cut[n], trained[n - 1] if n else 0.0) + parts.batch_handoff_s
        trained[n] = start + t[n] + publish.trainer_s
        live[n] = trained[n] + publish.load_s
    return (trained[-1] - trained[first]) / (steps - 1 - first)


def _draws(mean: float, cv: float, count: int, measured_from: int, seed: int) -> list[float]:
    """`count` log-normal values of coefficient of variation `cv`, scaled so that those from `measured_from`
    on (the steps the mean step is taken over) have exactly `mean`."""
    if cv <= 0:
        return [mean] * count
    sigma = math.sqrt(math.log(1 + cv * cv))
    rng = random.Random(seed)
    values = [rng.lognormvariate(0.0, sigma) for _ in range(count)]
    scale = mean * (count - measured_from) / sum(values[measured_from:])
    return [v * scale for v in values]


def splits(gpus: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """Every (inference, trainer) split of `gpus`; past one node, in whole nodes (each side on nodes of its own)."""
    unit = gpus_per_node if gpus > gpus_per_node and gpus % gpus_per_node == 0 else 1
    return [(i, gpus - i) for i in range(unit, gpus, unit)]


def best_splits(parts: Parts, gpus: int, mode: str) -> list[Prediction]:
    """Every split of `gpus` (and, if the parts have its publish time, all of them colocated), best first."""
    if gpus < 1:
        raise AsyncRLError(f"--gpus must be at least 1, not {gpus}")
    found = [predict(parts, i, t, mode) for i, t in splits(gpus, parts.gpus_per_node)]
    if "colocated" in parts.publish:
        found.append(predict(parts, gpus, gpus, "colocated"))
    if not found:
        raise AsyncRLError(f"{gpus} GPU cannot be split between inference and trainer; add colocated to the parts")
    return sorted(found, key=lambda p: -p.trained_tokens_per_s)


def table(predictions: list[Prediction], top: int) -> str:
    lines = [
        "   inference  trainer  mode        s/step  trained tok/s  trainer idle  inference idle  bound",
    ]
    for n, p in enumerate(predictions[:top]):
        lines.append(
            f"{'*' if n == 0 else ' '}  {p.inference_gpus:>9}  {p.trainer_gpus:>7}  {p.mode:<10}  {p.step_s:>6.3g}  "
            f"{p.trained_tokens_per_s:>13,.0f}  {p.trainer_idle:>12.0%}  {p.inference_idle:>14.0%}  {p.bound}"
        )
    if len(predictions) > top:
        lines.append(f"   ... {len(predictions) - top} more splits (--top {len(predictions)} shows them)")
    return "\n".join(lines)


def parts_file(parts: Parts) -> dict:
    """The parts in the layout of a parts file (what `load_parts` reads back)."""
    return {
        "workload": {"batch_size": parts.batch_size, "prompt_tokens": parts.prompt_tokens,
                     "completion_tokens": parts.completion_tokens, "max_async_level": parts.max_async_level},
        "engine": {"tokens_per_s": parts.engine_tokens_per_s, "step_cv": parts.generate_cv},
        "trainer": {"tokens_per_s": parts.trainer_tokens_per_s, "step_cv": parts.train_cv,
                    "efficiency_per_doubling": parts.efficiency_per_doubling},
        "publish": {mode: {"trainer_s": p.trainer_s, "load_s": p.load_s} for mode, p in parts.publish.items()},
        "batch_handoff_s": parts.batch_handoff_s,
        "dispatch_latency_s": parts.dispatch_latency_s,
        "gpus_per_node": parts.gpus_per_node,
        "rates_while_colocated": parts.rates_while_colocated,
    }  # fmt: skip


def load_parts(path: Path) -> Parts:
    """Parts from a JSON or TOML file (examples/plan/h200_qwen3_0.6b.json shows every key)."""
    try:
        text = path.read_text()
    except OSError as error:
        raise AsyncRLError(f"parts file '{path}' cannot be read ({error.strerror})") from None
    raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    try:
        workload, trainer = raw["workload"], raw["trainer"]
        return Parts(
            batch_size=workload["batch_size"],
            prompt_tokens=workload["prompt_tokens"],
            completion_tokens=workload["completion_tokens"],
            max_async_level=workload["max_async_level"],
            engine_tokens_per_s=raw["engine"]["tokens_per_s"],
            trainer_tokens_per_s=trainer["tokens_per_s"],
            efficiency_per_doubling=trainer.get("efficiency_per_doubling", 1.0),
            generate_cv=raw["engine"].get("step_cv", 0.0),
            train_cv=trainer.get("step_cv", 0.0),
            publish={mode: Publish(p["trainer_s"], p["load_s"]) for mode, p in raw["publish"].items()},
            batch_handoff_s=raw.get("batch_handoff_s", 0.0),
            dispatch_latency_s=raw.get("dispatch_latency_s", 0.0),
            gpus_per_node=raw.get("gpus_per_node", 8),
            rates_while_colocated=raw.get("rates_while_colocated", False),
        )
    except KeyError as error:
        raise AsyncRLError(f"parts file '{path}' has no {error} (examples/plan/ shows every key)") from None
