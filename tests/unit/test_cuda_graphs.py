"""Decoding steps replayed from CUDA graphs, and the eager fallback for a step that cannot be captured."""

from __future__ import annotations

import pytest
import torch

from asyncrl.inference.engine.cuda_graphs import DecodeGraphs

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


@needs_gpu
def test_a_step_is_captured_once_and_replayed_with_new_inputs():
    inputs = torch.zeros(4, device="cuda")
    calls = []

    def step(batch: int, context: int) -> torch.Tensor:
        calls.append((batch, context))
        return inputs[:batch] * 2 + context

    graphs = DecodeGraphs(step)
    assert graphs.run(2, 1).tolist() == [1.0, 1.0]
    inputs.copy_(torch.arange(4.0, device="cuda"))
    assert graphs.run(2, 1).tolist() == [1.0, 3.0]  # the replay reads the static inputs
    assert calls == [(2, 1), (2, 1)]  # the eager warm-up and the capture; replays call nothing


@needs_gpu
def test_a_step_that_cannot_be_captured_runs_eagerly_and_later_captures_still_work():
    inputs = torch.arange(4.0, device="cuda")

    def step(batch: int, context: int) -> torch.Tensor:
        if batch == 4:
            inputs.sum().item()  # a host sync: not allowed while a stream is captured
        return inputs[:batch] + context

    graphs = DecodeGraphs(step)
    assert graphs.run(4, 0).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert graphs.run(4, 1).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert graphs.eager == {(4, 0), (4, 1)}
    assert graphs.run(2, 0).tolist() == [0.0, 1.0]  # a capturable key after failed ones
    assert (2, 0) in graphs.graphs
