"""Which slot holds the prompt that the samples of one request share in the KV cache.

The `n` samples of a request admitted in one prefill have the same prompt, so its keys and values are
written once, into the slot of the first of them (the prompt's holder); the others' slots hold only what
they generate, from the prompt's length on, and the decoding attention reads their first `prompt length`
positions from the holder's slot (`kernels/decode_attention.py`: `prefix_slots`, `prefix_lens`). A request's
samples admitted in a later prefill (no slot was free for them before) form a group of their own.

When the holder leaves the batch while others of its group still run, its prompt is copied into the slot
of the first one staying, which holds it from then on. Slots move when samples leave (`scheduler.py`): a
sample that does not hold its prompt moves only its own positions.

The engine keeps one of these on its decoding thread; not thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.inference.engine.sequence import Sequence


@dataclass(frozen=True)
class PromptCopy:
    """Copy positions [0, length) of slot `source` into slot `target`, in every layer."""

    source: int
    target: int
    length: int


class SharedPrompts:
    def __init__(self) -> None:
        self._holder: dict[Sequence, Sequence] = {}  # a sample whose prompt another slot holds -> that sample
        self._readers: dict[Sequence, list[Sequence]] = {}  # a holder -> the samples reading its prompt

    def admit(self, admitted: list[Sequence]) -> list[Sequence]:
        """Group the samples admitted in one prefill by request; the first of each group holds the prompt.
        Returns the holders, in admission order (the samples whose slots the prefill writes)."""
        holders: dict[object, Sequence] = {}
        for sequence in admitted:
            holder = holders.setdefault(sequence.request, sequence)
            if holder is not sequence:
                self._holder[sequence] = holder
                self._readers.setdefault(holder, []).append(sequence)
        return list(holders.values())

    def shared_length(self, sequence: Sequence) -> int:
        """Positions of `sequence` that another slot holds: its prompt, or none."""
        return len(sequence.params.prompt_ids) if sequence in self._holder else 0

    def rows(self, running: list[Sequence]) -> tuple[list[int], list[int]]:
        """Per running sample (row i holds slot i): the slot that holds its prompt, and how many positions to
        read from there (0: all from its own slot)."""
        slot = {sequence: index for index, sequence in enumerate(running)}
        slots = [slot[self._holder.get(sequence, sequence)] for sequence in running]
        return slots, [self.shared_length(sequence) for sequence in running]

    def leave(self, leaving: set[Sequence], running: list[Sequence]) -> list[PromptCopy]:
        """`leaving` leave the batch `running` (slot i is row i, before any slot moves). Returns the copies
        that hand each leaving holder's prompt to the first of its readers that stays; run them before the
        slots move."""
        slot = {sequence: index for index, sequence in enumerate(running)}
        copies = []
        for sequence in [s for s in running if s in leaving]:
            holder = self._holder.pop(sequence, None)
            if holder is not None:  # a reader leaves (its holder, if leaving too, has not been handled yet)
                readers = self._readers[holder]
                readers.remove(sequence)
                if not readers:
                    del self._readers[holder]
                continue
            readers = self._readers.pop(sequence, [])
            for reader in readers:
                del self._holder[reader]
            staying = [reader for reader in readers if reader not in leaving]
            if not staying:
                continue
            new_holder, others = staying[0], staying[1:]
            copies.append(PromptCopy(slot[sequence], slot[new_holder], len(sequence.params.prompt_ids)))
            for reader in others:
                self._holder[reader] = new_holder
            if others:
                self._readers[new_holder] = others
        return copies

    def clear(self) -> None:
        self._holder.clear()
        self._readers.clear()
