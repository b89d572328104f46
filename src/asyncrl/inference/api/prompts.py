"""A request's prompt token ids — its chat template rendered, its text tokenized — made off the event loop,
smallest request first, and stopped when its client leaves.

A long prompt takes seconds of CPU (tokenizing 1 MB of text in one call: 2-5 s; rendering 6,000 short messages:
0.3 s), which a client that left must not keep taking, nor make the clients after it wait for. So:
- the work runs on PROMPT_THREADS threads of its own, as jobs: the rendering, then chunks of about CHUNK_CHARS
  characters of tokenizing. Jobs wait in a queue ordered by their request's body size plus the characters it
  has had tokenized, so a short prompt passes the chunks of long ones;
- when its client leaves (the route's coroutine is cancelled, see disconnect.py), a request queues no next job,
  its waiting job is dropped, and its running rendering is stopped by an exception raised in its thread (the
  template is Python code); a running chunk ends by itself within milliseconds (the tokenizer is Rust);
- tokenizing stops as soon as the prompt has more tokens than seq_len leaves it, with the request's 400;
- a body of at most INLINE_BYTES is turned into tokens on the event loop: that takes less than a thread hop.

Chunks join to the tokens of the whole text: a text is cut only after a letter followed by something else, and
only where the tokenizer gives the same tokens for the SPLIT_CONTEXT characters on either side apart as
together (no pre-tokenizer of a byte-level BPE joins a letter to the non-letter after it, and no normalizer we
know of looks further than that).
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.inference.api.prometheus import prometheus_text
from asyncrl.inference.engine.sequence import RequestError

PROMPT_THREADS = 2
CHUNK_CHARS = 16384  # a few ms of a Rust tokenizer
INLINE_BYTES = 4096
SPLIT_CONTEXT = 64
CUT_TRIES = 8  # candidate cuts checked per chunk before looking a chunk further
LETTER_THEN_OTHER = re.compile(r"[^\W\d_](?=[\W\d_])")


class PromptWorkStopped(BaseException):
    """Raised in a worker thread to stop the rendering of a prompt whose client left; a BaseException, so that
    no `except Exception` of the template's code swallows it."""


@dataclass(eq=False)
class _Job:
    work: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future
    stoppable: bool
    state: str = "waiting"  # -> running -> finished; or -> dropped
    thread: int | None = field(default=None)


class PromptWorkers:
    """The threads that render and tokenize prompts, and the queue of their jobs (module docstring)."""

    def __init__(self, threads: int = PROMPT_THREADS):
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()  # first come, first served among equal priorities
        self._lock = threading.Lock()  # guards job states: a stop is raised only in a thread running that job
        self.stopped_prompts = 0
        for index in range(threads):
            threading.Thread(target=self._serve, name=f"asyncrl-prompt-{index}", daemon=True).start()

    async def run(self, priority: int, work: Callable[[], Any], stoppable: bool = False) -> Any:
        """`work()` on a worker thread. If this call is cancelled, the job is dropped, or stopped if running
        and `stoppable`."""
        loop = asyncio.get_running_loop()
        job = _Job(work, loop, loop.create_future(), stoppable)
        self._jobs.put((priority, next(self._order), job))
        try:
            return await job.done
        except asyncio.CancelledError:
            self._stop(job)
            raise

    def _stop(self, job: _Job) -> None:
        self.stopped_prompts += 1
        with self._lock:
            if job.state == "waiting":
                job.state = "dropped"
            elif job.state == "running" and job.stoppable:
                exception = ctypes.py_object(PromptWorkStopped)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(job.thread), exception)

    def _serve(self) -> None:
        while True:
            try:
                self._serve_one()
            except PromptWorkStopped:  # a stop that arrived as its job ended: the job's client has left anyway
                pass

    def _serve_one(self) -> None:
        _, _, job = self._jobs.get()
        with self._lock:
            if job.state != "waiting":
                return
            job.state, job.thread = "running", threading.get_ident()
        try:
            try:
                result, error = job.work(), None
            finally:
                with self._lock:
                    job.state = "finished"  # from here on, no stop is raised in this thread
        except PromptWorkStopped:
            return
        except Exception as failure:  # noqa: BLE001 - handed to the request, which raises it
            result, error = None, failure
        job.loop.call_soon_threadsafe(_settle, job.done, result, error)

    def metrics(self) -> str:
        return prometheus_text(
            [
                (
                    "prompts_stopped_total",
                    "counter",
                    "Prompts whose rendering or tokenizing stopped because their client left.",
                    self.stopped_prompts,
                )
            ]
        )


def _settle(done: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if done.done():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


class PromptTokenizer:
    """Renders and tokenizes prompts through PromptWorkers (module docstring)."""

    def __init__(self, tokenizer: Any, workers: PromptWorkers, seq_len: int):
        self.tokenizer = tokenizer
        self.workers = workers
        self.seq_len = seq_len
        self.prefix, self.suffix = _special_tokens_around(tokenizer)

    async def prepare(self, body_bytes: int, work: Callable[[], Any]) -> Any:
        """`work()`, the rendering or checking of a prompt before it is tokenized, as one job."""
        if body_bytes <= INLINE_BYTES:
            return work()
        return await self.workers.run(body_bytes, work, stoppable=True)

    async def tokenize(self, text: str, body_bytes: int, max_tokens: int | None, special_tokens: bool) -> list[int]:
        """The token ids of `text` (with the tokenizer's special tokens around it, if `special_tokens`), as one
        `encode` would give them; a 400 as soon as they cannot leave room for `max_tokens` (None: one token)."""
        most = self.seq_len - (max_tokens or 1)
        if body_bytes <= INLINE_BYTES:
            return self.tokenizer.encode(text, add_special_tokens=special_tokens)
        if special_tokens and self.prefix is None:  # specials we cannot place around chunks: in one piece
            return await self.workers.run(body_bytes, lambda: self.tokenizer.encode(text, add_special_tokens=True))
        ids = list(self.prefix or []) if special_tokens else []
        start = 0
        while start < len(text):
            piece, start = await self.workers.run(body_bytes + start, lambda at=start: self._chunk(text, at))
            ids += piece
            if len(ids) > most:
                raise RequestError(
                    f"prompt (at least {len(ids)} tokens) + max_tokens ({max_tokens or 1}) is longer than the "
                    f"server's seq_len ({self.seq_len}) (shorten the prompt, lower max_tokens or raise "
                    "inference.seq_len)"
                )
        return ids + list(self.suffix or []) if special_tokens else ids

    def _chunk(self, text: str, start: int) -> tuple[list[int], int]:
        end = self._cut(text, start)
        return self.tokenizer.encode(text[start:end], add_special_tokens=False), end

    def _cut(self, text: str, start: int) -> int:
        """Where the chunk from `start` ends: about CHUNK_CHARS on, at the first place that cuts cleanly."""
        target = start + CHUNK_CHARS
        while target < len(text):
            candidates = LETTER_THEN_OTHER.finditer(text, target, target + CHUNK_CHARS)
            for match in itertools.islice(candidates, CUT_TRIES):
                if self._cuts_cleanly(text, match.end()):
                    return match.end()
            target += CHUNK_CHARS
        return len(text)

    def _cuts_cleanly(self, text: str, cut: int) -> bool:
        left, right = text[max(0, cut - SPLIT_CONTEXT) : cut], text[cut : cut + SPLIT_CONTEXT]
        encode = self.tokenizer.encode
        apart = encode(left, add_special_tokens=False) + encode(right, add_special_tokens=False)
        return apart == encode(left + right, add_special_tokens=False)


def _special_tokens_around(tokenizer: Any) -> tuple[list[int] | None, list[int] | None]:
    """The special tokens `encode` puts before and after a text (a BOS, say), or (None, None) if they are not
    simply around it."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return None, None
