"""Bounded waiting on another process: every wait has a timeout and a message that names what is missing."""

from __future__ import annotations

import time
from collections.abc import Callable

from asyncrl.errors import AsyncRLError


class PeerTimeout(AsyncRLError):
    """Another process did not deliver in time."""


def wait_for(
    ready: Callable[[], bool],
    timeout: float,
    what: str,
    hint: str = "",
    poll: float = 0.05,
    alive: Callable[[], bool] | None = None,
) -> float:
    """Poll `ready` until it is true; returns the seconds waited. Raises PeerTimeout after `timeout`."""
    start = time.monotonic()
    while not ready():
        waited = time.monotonic() - start
        if waited > timeout:
            raise PeerTimeout(f"timed out after {timeout:.0f}s waiting for {what}" + (f" ({hint})" if hint else ""))
        if alive is not None and not alive():
            raise PeerTimeout(f"gave up waiting for {what}: the peer process is gone")
        time.sleep(poll)
    return time.monotonic() - start
