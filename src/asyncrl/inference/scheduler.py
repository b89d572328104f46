"""Decides what runs at each step: which waiting samples take a KV-cache slot, and which slot each holds.

Continuous batching: samples join the running batch whenever a slot is free and leave it the step they
finish, so a short request admitted while a long one runs ends first. Admission is first come, first served;
a sample that finds no free slot waits (it is never refused for lack of memory).

Slots are kept dense: running sample i holds slot i, so a decoding step covers slots [0, running) with no
gather. When samples leave, the samples past the new end of the batch move into the freed slots; `release`
returns those moves for the KV cache to copy. Not thread-safe; the engine holds its lock around every call.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from asyncrl.inference.sequence import PendingRequest, Sequence


@dataclass(frozen=True)
class SlotMove:
    """`sequence` moved from slot `source` to slot `target`: its KV cache must be copied along."""

    source: int
    target: int
    sequence: Sequence


class Scheduler:
    def __init__(self, num_slots: int, max_prefill_tokens: int):
        self.num_slots = num_slots
        self.max_prefill_tokens = max_prefill_tokens  # bounds one prefill: distinct prompts x longest prompt
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i] holds KV-cache slot i
        self.version = 0  # changes whenever `running` does, so per-batch tensors can be cached

    def add(self, sequences: list[Sequence]) -> None:
        self.waiting.extend(sequences)

    def admit(self) -> list[Sequence]:
        """Move waiting samples into free slots, in arrival order; they take slots [old running, new running).
        Samples of one request admitted together share one prefill of their prompt."""
        admitted: list[Sequence] = []
        prompts: set[PendingRequest] = set()
        longest = 0
        while self.waiting and len(self.running) + len(admitted) < self.num_slots:
            sequence = self.waiting[0]
            if sequence.abandoned:
                self.waiting.popleft()
                continue
            rows = len(prompts) + (sequence.request not in prompts)
            width = max(longest, len(sequence.params.prompt_ids))
            if admitted and rows * width > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            admitted.append(sequence)
            prompts.add(sequence.request)
            longest = width
        if admitted:
            self.running.extend(admitted)
            self.version += 1
        return admitted

    def release(self, finished: list[Sequence]) -> list[SlotMove]:
        """Free the slots of `finished` (done or abandoned) and keep the others dense: each sample left past
        the new end of the batch moves into a freed slot below it (one copy per moved sample)."""
        gone = set(finished)
        end = sum(sequence not in gone for sequence in self.running)
        holes = [slot for slot in range(end) if self.running[slot] in gone]
        movers = [slot for slot in range(end, len(self.running)) if self.running[slot] not in gone]
        moves = []
        for target, source in zip(holes, movers):
            self.running[target] = self.running[source]
            moves.append(SlotMove(source, target, self.running[target]))
        if end < len(self.running):
            del self.running[end:]
            self.version += 1
        return moves

    def drop_abandoned(self) -> None:
        """Forget the waiting samples whose request was cancelled (or failed)."""
        self.waiting = deque(sequence for sequence in self.waiting if not sequence.abandoned)

    def clear(self) -> list[Sequence]:
        """Empty the batch (after a failed step); returns the samples that were running."""
        running, self.running = self.running, []
        self.version += 1
        return running

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
