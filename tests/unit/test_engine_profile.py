"""`inference.profile`: the engine traces whole policy versions with torch.profiler, its steps being the
weight updates it applies, and a trace still recording when the engine stops is written with what it holds."""

from __future__ import annotations

import json

import pytest

from asyncrl.config.schema import InferenceConfig
from asyncrl.inference.engine.engine import Engine, GenerationRequest
from asyncrl.models.offline import init_model

TIMEOUT = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "tiny"
    init_model(path, "tiny", seed=0)
    return path


def engine_with_profile(model_dir, folder, active: int) -> Engine:
    return Engine(
        InferenceConfig(
            model={"name": str(model_dir), "dtype": "float32"},
            device="cpu",
            seq_len=64,
            max_batch_size=4,
            num_threads=1,
            port=8123,
            profile={"dir": folder, "wait": 1, "warmup": 1, "active": active},
        )
    )


def generate_then_update(engine: Engine, version: int) -> None:
    engine.generate(GenerationRequest([5, 6, 7], n=2, max_tokens=6, seed=version)).result(TIMEOUT)
    same = {name: tensor.clone() for name, tensor in engine.model.state_dict().items() if name != "lm_head.weight"}
    assert engine.update_weights(same, version).result(TIMEOUT) == version


def trace_names(path) -> set[str]:
    return {event.get("name", "") for event in json.loads(path.read_text())["traceEvents"]}


def test_the_versions_after_the_untraced_ones_are_traced(model_dir, tmp_path):
    engine = engine_with_profile(model_dir, tmp_path, active=1)
    try:
        for version in (1, 2, 3):  # version 0 waits, 1 warms the profiler up, 2 is kept
            generate_then_update(engine, version)
        trace = tmp_path / "inference_8123.json"
        assert trace.exists()  # written once the active version ended, before the engine stops
    finally:
        engine.stop()
    names = trace_names(trace)
    assert "ProfilerStep#2" in names and not {"ProfilerStep#0", "ProfilerStep#1"} & names
    assert "aten::embedding" in names  # the decoding thread's ops: prefill and decoding steps


def test_a_trace_still_recording_is_written_when_the_engine_stops(model_dir, tmp_path):
    engine = engine_with_profile(model_dir, tmp_path, active=5)
    try:
        for version in (1, 2, 3):
            generate_then_update(engine, version)
        assert not (tmp_path / "inference_8123.json").exists()
    finally:
        engine.stop()
    assert "ProfilerStep#2" in trace_names(tmp_path / "inference_8123.json")
