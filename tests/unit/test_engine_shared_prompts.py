"""The engine with one copy of each request's prompt shared by its samples gives exactly the samples it gives
with a copy per sample: same tokens, same logprobs, while samples join late, end early and move slots.

Needs the Triton decoding attention: runs on a GPU, or on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1`, set before pytest starts); skipped without triton or without either.
"""

from __future__ import annotations

import pytest
from triton_device import device_or_skip

from asyncrl.config.schema import InferenceConfig
from asyncrl.inference.engine.engine import Engine, GenerationRequest
from asyncrl.models.offline import init_model

DEVICE = device_or_skip()
TIMEOUT = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("shared") / "tiny"
    init_model(path, "tiny", seed=0)
    return path


def requests() -> list[GenerationRequest]:
    """More samples than slots (some wait, then join in a later prefill as a group of their own); a
    one-sample request first, so that slots move when it ends; stop tokens end samples at scattered steps,
    so holders of a shared prompt leave before samples that read it."""
    stops = tuple(range(3, 259, 9))
    return [
        GenerationRequest([5, 6, 7], n=1, max_tokens=3, seed=0),
        GenerationRequest(list(range(40, 53)), n=5, max_tokens=16, seed=10, stop_token_ids=stops),
        GenerationRequest(list(range(90, 97)), n=3, max_tokens=12, seed=20, stop_token_ids=stops),
    ]


def generate(model_dir, share_prompts: bool, decode_ahead: bool) -> tuple[list, list]:
    dtype = "float32" if DEVICE == "cpu" else "bfloat16"
    cfg = InferenceConfig(
        model={"name": str(model_dir), "dtype": dtype},
        device=DEVICE,
        seq_len=64,
        max_batch_size=6,
        num_threads=1,
        decode_attention="triton",
        share_prompts=share_prompts,
        cuda_graphs=False,
    )
    engine = Engine(cfg)
    engine.decode_ahead = decode_ahead
    copies = []  # the prompt hand-overs the engine ran
    if share_prompts:
        leave = engine.shared_prompts.leave

        def recorded_leave(*args):
            result = leave(*args)
            copies.extend(result)
            return result

        engine.shared_prompts.leave = recorded_leave
    try:
        futures = [engine.generate(request) for request in requests()]
        completions = [future.result(TIMEOUT) for future in futures]
    finally:
        engine.stop()
    return completions, copies


@pytest.mark.parametrize("decode_ahead", [False, True], ids=["step-by-step", "one-step-ahead"])
def test_shared_prompts_give_exactly_the_samples_of_per_sample_copies(model_dir, decode_ahead):
    shared, copies = generate(model_dir, share_prompts=True, decode_ahead=decode_ahead)
    copied, _ = generate(model_dir, share_prompts=False, decode_ahead=decode_ahead)
    assert copies, "no holder of a shared prompt left before its readers: the test lost its point"
    for shared_request, copied_request in zip(shared, copied):
        for a, b in zip(shared_request, copied_request):
            assert a.token_ids == b.token_ids
            assert a.logprobs == b.logprobs
    lengths = [len(c.token_ids) for request in shared for c in request]
    assert len(set(lengths)) > 2  # samples did end at scattered steps
