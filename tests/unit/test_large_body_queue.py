"""Large bodies are read a few at a time, so the event loop's turns stay short; small requests never wait."""

import asyncio

from asyncrl.inference.api.limits import LARGE_BODY_BYTES, LargeBodyQueue


def scope(headers: dict[bytes, bytes]) -> dict:
    return {"type": "http", "headers": list(headers.items())}


def large() -> dict:
    return scope({b"content-length": str(LARGE_BODY_BYTES + 1).encode()})


class Body:
    """An ASGI receive that hands out two chunks, the second when `send_rest` is set."""

    def __init__(self):
        self.send_rest = asyncio.Event()
        self.chunks = 0

    async def __call__(self) -> dict:
        self.chunks += 1
        if self.chunks == 1:
            return {"type": "http.request", "body": b"a", "more_body": True}
        await self.send_rest.wait()
        return {"type": "http.request", "body": b"b", "more_body": False}


async def read_all(scope: dict, receive, send) -> None:
    while (await receive()).get("more_body"):
        pass


def test_a_large_body_waits_for_the_one_being_read_and_a_small_one_does_not():
    async def main():
        queue = LargeBodyQueue(read_all, at_once=1)
        first, second, small = Body(), Body(), Body()
        reading_first = asyncio.ensure_future(queue(large(), first, None))
        await asyncio.sleep(0.01)
        reading_second = asyncio.ensure_future(queue(large(), second, None))
        small.send_rest.set()
        await asyncio.wait_for(queue(scope({b"content-length": b"10"}), small, None), 1)
        await asyncio.sleep(0.01)
        assert first.chunks == 2 and second.chunks == 0  # the second waits its turn, unread
        first.send_rest.set()
        await asyncio.wait_for(reading_first, 1)
        await asyncio.sleep(0.01)
        assert second.chunks == 2  # its turn came when the first body was read whole
        second.send_rest.set()
        await asyncio.wait_for(reading_second, 1)
        assert queue.turns._value == 1  # every turn handed back

    asyncio.run(main())


def test_a_turn_is_handed_back_when_the_app_fails_mid_body():
    async def failing(scope: dict, receive, send) -> None:
        await receive()
        raise RuntimeError("the route failed")

    async def main():
        queue = LargeBodyQueue(failing, at_once=1)
        chunked = scope({b"transfer-encoding": b"chunked"})
        for _ in range(2):
            try:
                await asyncio.wait_for(queue(chunked, Body(), None), 1)
            except RuntimeError:
                pass
        assert queue.turns._value == 1

    asyncio.run(main())
