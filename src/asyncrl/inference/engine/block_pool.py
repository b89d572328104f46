"""The pool of KV-cache blocks of the paged layout: which blocks are free, and how many tables hold each.

A block holds `block_size` consecutive positions of a sequence (`paged_cache.py` holds the tensors,
`block_tables.py` which blocks each sequence reads). One block may sit in several tables at once (the
prompt that a request's samples share): its reference count says in how many, and it returns to the free
list when the last table lets it go. Not thread-safe; the engine holds its lock around the scheduler, which
alone calls it.

The prefix cache: a full block whose keys and values are final may be registered under a key of its
contents (`block_key`: the key of the block before it and its tokens, so a key names a whole prefix). A
registered block that no table holds any more is not free but cached: a later request whose prompt starts
with the same tokens takes it back (`hold`). Cached blocks count as free; when the free list is empty,
`take` reuses the least recently released cached block, which forgets its key. `forget_keys` drops every
key (new weights make every cached key and value stale).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable


def block_key(previous: Hashable | None, tokens: tuple[int, ...]) -> Hashable:
    """The key of a full block holding `tokens` after the block keyed `previous` (None: the first block). The
    tokens themselves are part of it, so two keys are equal only for the same tokens after blocks with the
    same key hash (a collision of 64-bit hashes of the earlier blocks is the one way to a false match)."""
    return (hash(previous), tokens)


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, Hashable] = {}  # a registered block -> its key
        self._block_of: dict[Hashable, int] = {}  # a key -> its registered block
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered blocks no table holds, oldest first

    @property
    def num_free(self) -> int:
        """Blocks `take` can give: free ones and cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def take(self, count: int) -> list[int]:
        """`count` free blocks, each now held once. The caller checks `num_free` first: running out here is a bug."""
        if count > self.num_free:
            raise RuntimeError(f"{count} KV-cache blocks asked for, {self.num_free} free")
        blocks = []
        for _ in range(count):
            if self._free:
                blocks.append(self._free.popleft())
            else:  # the least recently released cached block: its key goes
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
                blocks.append(block)
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def share(self, block: int) -> None:
        """One more table holds `block`."""
        if self._refs[block] < 1:
            raise RuntimeError(f"KV-cache block {block} is free: it cannot be shared")
        self._refs[block] += 1

    def release(self, block: int) -> None:
        """One table fewer holds `block`; the last one frees it."""
        if self._refs[block] < 1:
            raise RuntimeError(f"KV-cache block {block} is released twice")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def register(self, block: int, key: Hashable) -> None:
        """`block` (held, full, its keys and values final) holds the prefix `key`; a key already registered,
        or a block already registered, stays as it is."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def lookup(self, key: Hashable) -> int | None:
        """The registered block of `key`, or None."""
        return self._block_of.get(key)

    def is_cached(self, block: int) -> bool:
        """`block` is registered and no table holds it: holding it takes one block from `num_free`."""
        return block in self._cached

    def hold(self, block: int) -> None:
        """One more table holds the registered `block`, cached or not."""
        self._cached.pop(block, None)
        self._refs[block] += 1

    def forget_keys(self) -> None:
        """Drop every key; the cached blocks are free."""
        self._free.extend(self._cached)
        self._cached.clear()
        self._key_of.clear()
        self._block_of.clear()
