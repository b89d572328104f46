"""One wake-up call for the orchestrator's tasks: whoever changes shared state notifies, waiters re-check.

The dispatcher, the batch loop and the weight follower all wait for "something changed" (a group finished,
a server went down, new weights went live). A waiter re-checks its own condition after every wake-up, so a
notification is never lost and never needs to say what changed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class Notifier:
    def __init__(self) -> None:
        self._waiters: list[asyncio.Future] = []

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, timeout: float | None = None) -> None:
        """Until the next notification, or `timeout` seconds."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            # Not asyncio.wait_for: on Python 3.11 it can swallow the caller's cancellation when the waiter is
            # resolved at the same moment, and a cancelled loop would then run on.
            await asyncio.wait([waiter], timeout=timeout)
        finally:
            if not waiter.done():
                waiter.cancel()
                self._waiters.remove(waiter)

    async def wait_for(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Until `ready()` holds (True) or `timeout` seconds have passed (False)."""
        deadline = time.monotonic() + timeout
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await self.wait(min(left, 1.0))
        return True
