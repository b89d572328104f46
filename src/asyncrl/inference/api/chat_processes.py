"""Large chat bodies prepared in processes of their own: decoded, validated and rendered through the chat
template away from the server's GIL.

In the server's process a body of 60,000 short messages (2 MB) takes ~0.3 s to validate, ~0.25 s to turn into
the template's dicts and ~0.5 s to render, all pure Python holding the GIL, and then millions of objects to
free: 100 such bodies at once kept the decoding thread and /health waiting for seconds, however the threads
took turns (prompts.py). So a chat body of more than PROCESS_BYTES goes, as its raw bytes, to one of
`inference.chat_processes` worker processes, which answer with the validated body (its messages left out: the
route needs only the rest) and the rendered prompt text. Tokenizing stays in the server (prompts.py), where it
stops early for a prompt too long for `seq_len`.

- Workers start on the first such body (a server that never gets one never pays for them) and run at a lower
  CPU priority (nice NICENESS), so that serving comes first on a busy machine.
- Waiting bodies go smallest first. A body whose client left is dropped while it waits; once sent, its worker is
  told to stop it: the template's rendering is interrupted (it is Python code) if that body is still the one
  the worker works on, and a body not yet begun is skipped.
- A worker that dies (killed, out of memory) fails its body with a 500 and is started again for the next.
- Workers exit with the server: `close`, their end of the socket closing, or the parent-death signal.
"""

from __future__ import annotations

import _thread
import asyncio
import ctypes
import heapq
import itertools
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from fastapi.exceptions import RequestValidationError

from asyncrl.inference.api.api_errors import APIError
from asyncrl.inference.api.bodies import validate
from asyncrl.inference.api.chat_template import render_chat
from asyncrl.inference.api.prometheus import prometheus_text
from asyncrl.inference.api.prompts import PromptWorkStopped
from asyncrl.inference.api.protocol import ChatBody, check_supported

PROCESS_BYTES = 65536  # smaller bodies are prepared in the server's process (bodies.py, prompts.py)
NICENESS = 10


@dataclass(eq=False)
class _Job:
    id: int
    content: bytes
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future
    state: str = "waiting"  # -> running -> finished; or -> dropped
    worker: _Worker | None = None


class _Worker:
    """One worker process, and the socket the server talks to it over."""

    def __init__(self, model_name: str):
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, model_name, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.connection = Connection(ours.detach())
        self.sending = threading.Lock()  # a job and a stop may be sent from two threads

    def send(self, message: tuple) -> None:
        with self.sending:
            self.connection.send(message)

    def close(self) -> None:
        self.connection.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class ChatProcesses:
    """The worker processes and the queue of the bodies they prepare (module docstring)."""

    def __init__(self, model_name: str, processes: int):
        self.model_name = model_name
        self.processes = processes
        self._waiting: list[tuple[int, int, _Job]] = []  # (size, id, job): smallest first
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._workers: list[_Worker] = []
        self._closed = False
        self._started = False  # the feeding threads, one per worker, are running
        self.prepared = 0  # bodies a worker answered
        self.stopped = 0  # bodies dropped or stopped because their client left
        self.stopped_in_workers = 0  # of those, the ones a worker had been sent

    def takes(self, body_bytes: int) -> bool:
        return self.processes > 0 and body_bytes > PROCESS_BYTES

    async def prepare(self, content: bytes) -> tuple[Any, str]:
        """The validated chat body, without its messages, and its rendered prompt text; raises the request's
        error (RequestValidationError, APIError) as preparing it in this process would."""
        loop = asyncio.get_running_loop()
        job = _Job(next(self._ids), content, loop, loop.create_future())
        with self._lock:
            if not self._started:
                self._started = True
                self._start()
            heapq.heappush(self._waiting, (len(content), job.id, job))
            self._lock.notify()
        try:
            kind, *answer = await job.done
        except asyncio.CancelledError:
            self._stop(job)
            raise
        if kind == "ok":
            return answer[0], answer[1]
        if kind == "invalid":
            raise RequestValidationError(answer[0])
        if kind == "stopped":  # only for a client that left, which this call no longer has
            raise APIError(499, "the client left")
        raise APIError(*answer)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.close()

    def _start(self) -> None:
        for index in range(self.processes):
            threading.Thread(target=self._feed, name=f"asyncrl-chat-process-{index}", daemon=True).start()

    def _stop(self, job: _Job) -> None:
        with self._lock:
            if job.state == "waiting":
                job.state = "dropped"
            elif job.state == "running":
                job.worker.send(("stop", job.id))
            else:
                return  # answered already
            self.stopped += 1

    def _next(self) -> _Job | None:
        with self._lock:
            while True:
                if self._closed:
                    return None
                while self._waiting:
                    _, _, job = heapq.heappop(self._waiting)
                    if job.state == "waiting":
                        job.state = "running"
                        return job
                self._lock.wait()

    def _feed(self) -> None:
        """One worker's thread: start it, hand it the next body, pass its answer on; start it again if it dies."""
        worker = None
        while (job := self._next()) is not None:
            if worker is None or worker.process.poll() is not None:
                worker = _Worker(self.model_name)
                with self._lock:
                    self._workers.append(worker)
            job.worker = worker
            try:
                worker.send(("job", job.id, job.content))
                answer = worker.connection.recv()
            except (EOFError, OSError):
                code = worker.process.wait()
                answer = ("error", 500, f"the chat-body worker process exited with code {code} (see the server log)")
                with self._lock:
                    if worker in self._workers:
                        self._workers.remove(worker)
                worker = None
            with self._lock:
                job.state = "finished"
                self.prepared += answer[0] != "stopped"
                self.stopped_in_workers += answer[0] == "stopped"
            job.loop.call_soon_threadsafe(_settle, job.done, answer)

    def metrics(self) -> str:
        return prometheus_text(
            [
                ("chat_process_bodies_total", "counter", "Chat bodies a worker process prepared.", self.prepared),
                (
                    "chat_process_bodies_stopped_total",
                    "counter",
                    "Chat bodies for worker processes dropped or stopped because their client left.",
                    self.stopped,
                ),
            ]
        )


def _settle(done: asyncio.Future, answer: tuple) -> None:
    if not done.done():
        done.set_result(answer)


# ---- the worker process ----


def prepare_chat(tokenizer: Any, content: bytes) -> tuple[Any, str]:
    """What a worker does with one body: the same checks, in the same order, as the server's own path."""
    body = validate(ChatBody, content, check_supported)
    text = render_chat(tokenizer, body)
    return body.model_copy(update={"messages": []}), text


def _serve(model_name: str, fd: int) -> None:
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone with the server
    except OSError:
        pass
    os.nice(NICENESS)
    connection = Connection(fd)

    from asyncrl.loading import load_tokenizer

    tokenizer = load_tokenizer(model_name)
    jobs: queue.Queue = queue.Queue()
    lock = threading.Lock()
    current: list[int | None] = [None]  # the job being prepared
    stopped_early: set[int] = set()  # jobs stopped before this worker began them

    def stopped(*_: Any) -> None:
        if current[0] is not None:
            raise PromptWorkStopped

    signal.signal(signal.SIGUSR1, stopped)

    def read() -> None:
        """Jobs go to the main thread; a stop interrupts it, if it still works on that job."""
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                jobs.put(None)
                return
            if message[0] == "job":
                jobs.put(message[1:])
                continue
            with lock:
                if current[0] == message[1]:
                    _thread.interrupt_main(signal.SIGUSR1)
                else:
                    stopped_early.add(message[1])

    threading.Thread(target=read, daemon=True).start()
    while (item := jobs.get()) is not None:
        job_id, content = item
        try:
            with lock:
                if job_id in stopped_early:
                    stopped_early.discard(job_id)
                    raise PromptWorkStopped
                current[0] = job_id
            try:
                body, text = prepare_chat(tokenizer, content)
                answer: tuple = ("ok", body, text)
            finally:
                with lock:
                    current[0] = None
        except PromptWorkStopped:
            answer = ("stopped",)
        except RequestValidationError as error:
            answer = ("invalid", [{key: item[key] for key in ("type", "loc", "msg")} for item in error.errors()])
        except APIError as error:
            answer = ("error", error.status_code, str(error.detail), error.param)
        except Exception as error:  # noqa: BLE001 - the server answers it as a 500
            answer = ("error", 500, f"preparing the chat body failed: {type(error).__name__}: {error}")
        connection.send(answer)


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
