"""How late the orchestrator's event loop wakes up: its lag, a metric of every batch.

One asyncio loop runs every group's episodes, the dispatcher, the weight follower and the batch loop. Work
that blocks it (packing a batch, a file write, a tokenizer call, a wait on a thread) holds up every one of
them: a finished request is not read, the next group is not sent, new weights are not pushed. A probe task
sleeps `interval` seconds again and again and records how much later than asked each sleep ended: on a
loop that never blocks that is a fraction of a millisecond, and a loop blocked for 200 ms shows one wake-up
200 ms late.
"""

from __future__ import annotations

import asyncio
import time

INTERVAL = 0.01  # seconds between two wake-ups of the probe


def quantile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank `q` quantile of a non-empty sorted list."""
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * len(sorted_values)) - 1))]


class EventLoopLag:
    def __init__(self, interval: float = INTERVAL):
        self.interval = interval
        self._lags_ms: list[float] = []

    async def run(self) -> None:
        """Forever: sleep `interval`, record how late the wake-up came."""
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval)
            self._lags_ms.append(max(time.perf_counter() - start - self.interval, 0.0) * 1000)

    def take_stats(self) -> dict[str, float]:
        """The lag's p50, p99 and max over the wake-ups since the last call (one batch), in milliseconds."""
        lags, self._lags_ms = sorted(self._lags_ms), []
        if not lags:
            return {"event_loop_lag_ms/p50": 0.0, "event_loop_lag_ms/p99": 0.0, "event_loop_lag_ms/max": 0.0}
        return {
            "event_loop_lag_ms/p50": quantile(lags, 0.5),
            "event_loop_lag_ms/p99": quantile(lags, 0.99),
            "event_loop_lag_ms/max": lags[-1],
        }
