"""Decoding steps captured as CUDA graphs: one graph per (batch, context) key, replayed every step.

A decoding step of a small model is hundreds of tiny kernels; launched one by one from Python, the GPU
mostly waits for the CPU. A graph launches them all at once. A graph has fixed shapes, so the batch is
rounded up to a few bucket sizes (`bucket`), which bounds both the number of graphs and the padding (at
most a quarter); the model runner chooses the context a graph is captured for (`_graph_context`: the whole
cache length for the Triton kernel, a bucket of the attended context otherwise). Graphs are captured the
first time their key is used, or ahead of time by running it, and share one memory pool: they never run
at the same time."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def bucket(size: int, limit: int) -> int:
    """`size` rounded up to 1, 2, 4, 8, then four steps per doubling (10, 12, 14, 16, 20, 24, ...), at most
    `limit`."""
    if size <= 8:
        rounded = 1 << max(size - 1, 0).bit_length()
    else:
        step = 1 << ((size - 1).bit_length() - 3)
        rounded = -(-size // step) * step
    return min(rounded, limit)


class DecodeGraphs:
    def __init__(self, step: Callable[[int, int], torch.Tensor]):
        """`step(batch, context)` runs one decoding step on static input buffers and returns the logits."""
        self.step = step
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.eager: set[tuple[int, int]] = set()  # keys whose capture failed
        self.pool = torch.cuda.graph_pool_handle()

    def run(self, batch: int, context: int) -> torch.Tensor:
        key = (batch, context)
        if key in self.eager:
            return self.step(batch, context)
        if key not in self.graphs:
            # The eager run first: it initializes kernels (cuBLAS handles, autotuning) outside the capture.
            # Running the step twice is harmless: both runs write the same keys and values.
            logits = self.step(batch, context)
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: other threads (the HTTP server) may touch CUDA while this one captures.
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    captured = self.step(batch, context)
            except RuntimeError as error:
                # A step that cannot be captured runs eagerly from now on (its logits are already computed).
                # The failed capture may leave the shared pool unusable, so later captures take a new one.
                if not self.eager:  # once: every bucket of such a model fails alike
                    log.warning(
                        "decoding step (batch %d, context %d) runs without a CUDA graph, and so will any other "
                        "that cannot be captured: %s",
                        *key,
                        error,
                    )
                self.eager.add(key)
                self.pool = torch.cuda.graph_pool_handle()
                return logits
            self.graphs[key] = (graph, captured)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits
