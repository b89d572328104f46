"""Decides what runs at each step: which waiting samples join the batch, and where their KV cache lives.

Continuous batching: samples join the running batch whenever there is room and leave it the step they
finish, so a short request admitted while a long one runs ends first. Admission is first come, first served;
a sample that finds no room waits (it is never refused for lack of memory).

Two layouts of the KV cache (`inference.kv_cache_layout`):

- Slots (`kv_cache.py`): one seq_len slot per sample, kept dense: running sample i holds slot i, so a
  decoding step covers slots [0, running) with no gather. When samples leave, the samples past the new end
  of the batch move into the freed slots; `release` returns those moves for the KV cache to copy.
- Paged (`blocks`, `block_tables.py`): a sample holds blocks for the positions it fills. It is admitted when
  the free blocks hold its prefill, plus one block of headroom per sample already in the batch or admitted
  with it (the block its next token may need), so a new sample rarely pushes another out at once. The samples
  of a request admitted together share their prompt's blocks. Before each decoding step `reserve` makes
  every sample's next position writable; when blocks run out, the newest samples are preempted: their blocks
  are freed and they wait at the front of the queue, to be recomputed (prefilled with their prompt and the
  tokens they had) when blocks free up. Running samples keep their admission order, oldest first.
- Paged with the prefix cache (`prefix_cache`): a sample's prefill starts with the registered blocks that
  hold the longest whole-block prefix of its tokens (`prefill_start`), the last token always computed; a
  request's samples admitted together start where their first one does. The engine registers a prefill's
  full blocks after it ran (`register_prefilled`), and a sample's full blocks are registered when it ends
  or is preempted, unless new weights came since its admission (`forget_prefixes`: every key dropped, the
  cache epoch moves on). Admission counts a cached block that no table holds as one free block taken.
  Samples that record their routed experts never start from cached blocks (the cached tokens would have
  no experts recorded), though their blocks are registered for others.

Not thread-safe; the engine holds its lock around every call.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from asyncrl.inference.engine.block_tables import BlockCopy, BlockTables
from asyncrl.inference.engine.sequence import Sequence


@dataclass(frozen=True)
class SlotMove:
    """`sequence` moved from slot `source` to slot `target`: its KV cache must be copied along."""

    source: int
    target: int
    sequence: Sequence


class Scheduler:
    def __init__(
        self, num_slots: int, max_prefill_tokens: int, blocks: BlockTables | None = None, prefix_cache: bool = False
    ):
        self.num_slots = num_slots  # samples decoded together, at most (slots, or row buffers when paged)
        self.max_prefill_tokens = max_prefill_tokens  # bounds one prefill: prefill rows x longest row
        self.blocks = blocks  # the paged layout's block tables; None: slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i] holds KV-cache slot i (slots) / decodes in row i
        self.version = 0  # changes whenever `running` does, so per-batch tensors can be cached
        self.preemptions = 0  # since start
        self.prefix_cache = prefix_cache and blocks is not None
        self.prefix_hit_tokens = 0  # since start: prefill positions read from the prefix cache
        self.cache_epoch = 0  # moves on with every weight update: keys and values before it are stale

    def add(self, sequences: list[Sequence]) -> None:
        self.waiting.extend(sequences)

    def admit(self) -> list[Sequence]:
        """Move waiting samples into the batch, in arrival order; they take rows [old running, new running).
        Samples of one request admitted together share one prefill of their prompt; a preempted sample
        (one with tokens already) has a prefill row of its own, to recompute its cache."""
        admitted: list[Sequence] = []
        groups: dict[object, Sequence] = {}  # request -> its first sample admitted now (a shared prompt)
        rows = longest = 0
        headroom = len(self.running)  # blocks kept free for the next token of each sample in the batch
        while self.waiting and len(self.running) + len(admitted) < self.num_slots:
            sequence = self.waiting[0]
            if sequence.abandoned:
                self.waiting.popleft()
                continue
            recomputed = bool(sequence.token_ids)
            joins = None if recomputed else groups.get(sequence.request)
            width = max(longest, prefill_length(sequence))
            if admitted and (rows + (joins is None)) * width > self.max_prefill_tokens:
                break
            if self.blocks is not None:
                cached = self._cached_prefix(sequence) if joins is None else []
                taken = 0 if joins is not None else self.blocks.cost(prefill_length(sequence), cached)
                # Alone in the batch, a sample may take every block: one sequence always fits in the pool.
                spare = headroom + 1 if admitted or self.running else 0
                if self.blocks.pool.num_free < taken + spare:
                    break
                if joins is not None:
                    self.blocks.share(joins, sequence)
                    sequence.prefill_start = joins.prefill_start
                else:
                    self.blocks.allocate(sequence, prefill_length(sequence), cached)
                    sequence.prefill_start = len(cached) * self.blocks.block_size
                    self.prefix_hit_tokens += sequence.prefill_start
                if not recomputed:
                    sequence.cached_tokens = sequence.prefill_start
                sequence.cache_epoch = self.cache_epoch
                headroom += 1
            self.waiting.popleft()
            admitted.append(sequence)
            if joins is None:
                rows += 1
                if not recomputed:
                    groups[sequence.request] = sequence
            longest = width
        if admitted:
            self.running.extend(admitted)
            self.version += 1
        return admitted

    def can_admit(self) -> bool:
        """Whether `admit` would take a waiting sample now: a row is free and, paged, the free blocks hold the
        first waiting sample's prefill and the batch's headroom."""
        if len(self.running) >= self.num_slots:
            return False
        first = next((sequence for sequence in self.waiting if not sequence.abandoned), None)
        if first is None or self.blocks is None:
            return first is not None
        taken = self.blocks.cost(prefill_length(first), self._cached_prefix(first))
        spare = len(self.running) + 1 if self.running else 0
        return self.blocks.pool.num_free >= taken + spare

    def _cached_prefix(self, sequence: Sequence) -> list[int]:
        """The registered blocks its prefill may start with (none for a sample that records its experts: the
        cached tokens would have none)."""
        if not self.prefix_cache or sequence.params.return_routed_experts:
            return []
        return self.blocks.cached_prefix(prefill_tokens(sequence))

    def register_prefilled(self, sequences: list[Sequence]) -> None:
        """Prefix cache: the full blocks the prefill of `sequences` just wrote hold final keys and values."""
        if self.prefix_cache:
            for sequence in sequences:
                self.blocks.register(sequence, prefill_tokens(sequence))

    def _register_written(self, sequence: Sequence) -> None:
        """Prefix cache: a sample leaving the batch (ended, or preempted) registers its full blocks, unless new
        weights came since it was admitted (its keys and values then mix two policies). Its positions [0,
        tokens - 1) are written: the newest token was never fed."""
        if self.prefix_cache and sequence.token_ids and sequence.cache_epoch == self.cache_epoch:
            self.blocks.register(sequence, prefill_tokens(sequence))

    def forget_prefixes(self) -> None:
        """New weights: nothing cached before is reused, nor registered later by a sample admitted before."""
        if self.blocks is not None:
            self.blocks.pool.forget_keys()
        self.cache_epoch += 1

    def reserve(self) -> tuple[list[BlockCopy], list[Sequence]]:
        """Paged: before a decoding step, make every running sample's next position (its newest token's)
        writable, oldest sample first. Where no block is free, preempt the newest samples until one is (the
        sample itself, if it is the newest). Returns the block copies to run before the step (copy-on-write)
        and the preempted samples, now first in the queue in their old order."""
        assert self.blocks is not None
        copies: list[BlockCopy] = []
        preempted: list[Sequence] = []
        index = 0
        while index < len(self.running):
            sequence = self.running[index]
            position = sequence.num_tokens - 1
            # A preempted sample may have shared the block `sequence` writes: ask again after each.
            while self.blocks.blocks_to_write(sequence, position) > self.blocks.pool.num_free:
                victim = self.running.pop()
                self._register_written(victim)  # its recompute may find them again
                self.blocks.free(victim)
                preempted.append(victim)
                if victim is sequence:
                    break
            else:
                copy = self.blocks.prepare_write(sequence, position)
                if copy is not None:
                    copies.append(copy)
                index += 1
        if preempted:
            self.waiting.extendleft(preempted)  # newest first in, so the oldest is first out
            self.preemptions += len(preempted)
            self.version += 1
        return copies, preempted

    def reserve_ahead(self) -> list[BlockCopy] | None:
        """Paged, decoding one step ahead: make every running sample's position after its newest token's
        writable (the token that the step in flight samples is fed there), when the free blocks hold it for
        every sample at once. Returns the block copies to run before the step, or None, having changed nothing,
        when blocks are short: nobody is preempted ahead of a step that may free blocks (`reserve` decides
        that, once the step in flight is read)."""
        assert self.blocks is not None
        needed = sum(self.blocks.blocks_to_write(sequence, sequence.num_tokens) for sequence in self.running)
        if needed > self.blocks.pool.num_free:
            return None
        copies = [self.blocks.prepare_write(sequence, sequence.num_tokens) for sequence in self.running]
        return [copy for copy in copies if copy is not None]

    def release(self, finished: list[Sequence]) -> list[SlotMove]:
        """Free the KV cache of `finished` (done or abandoned). Slots: keep the others dense, each sample left
        past the new end of the batch moving into a freed slot below it (one copy per moved sample). Paged:
        free their blocks; the others keep their rows' order and nothing moves."""
        gone = set(finished)
        if self.blocks is not None:
            for sequence in finished:
                self._register_written(sequence)
                self.blocks.free(sequence)
            self.running = [sequence for sequence in self.running if sequence not in gone]
            self.version += 1
            return []
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
        if self.blocks is not None:
            for sequence in running:
                self.blocks.free(sequence)
        self.version += 1
        return running

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


def prefill_length(sequence: Sequence) -> int:
    """Positions a sample's prefill writes: its prompt, or for a preempted sample all but its newest token
    (which the next decoding step feeds, as it would have)."""
    return sequence.num_tokens - 1 if sequence.token_ids else len(sequence.params.prompt_ids)


def prefill_tokens(sequence: Sequence) -> list[int]:
    """The tokens of the positions `prefill_length` counts."""
    return (sequence.params.prompt_ids + sequence.token_ids)[: prefill_length(sequence)]
