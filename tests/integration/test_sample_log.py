"""samples.jsonl lines from real rollouts of real environments played against `asyncrl inference`: every
token as the trainer sees it, with its text, logprob, loss mask and policy version, cut into turns."""

from __future__ import annotations

import json

import pytest
from scored_rollouts import scored_group
from servers import free_port, inference_command, running_server

from asyncrl.loading import load_tokenizer
from asyncrl.models.offline import init_model
from asyncrl.orchestrator.sample_log import sample_record, token_pieces

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("sample_log") / "tiny"
    init_model(model_dir, "tiny", seed=0)
    port = free_port()
    with running_server(inference_command(model_dir, port), port, model_dir.parent / "inference.log") as url:
        yield url, model_dir


def test_a_single_turn_record_keeps_every_token_of_the_trainers_sample(served):
    url, model_dir = served
    tokenizer = load_tokenizer(str(model_dir))
    (rollout, advantage), *_ = scored_group(url, model_dir, "reverse_text")
    record = json.loads(json.dumps(sample_record(7, "rt", rollout, advantage, tokenizer)))  # as a JSON line

    assert (record["step"], record["env"]) == (7, "rt")
    assert (record["reward"], record["advantage"]) == (rollout.reward, advantage)
    (sample,) = record["samples"]
    trained = rollout.samples[0]
    assert sample["token_ids"] == trained.input_ids
    assert sample["loss_mask"] == trained.loss_mask
    assert "".join(sample["pieces"]) == tokenizer.decode(trained.input_ids)
    sampled = [i for i, m in enumerate(trained.loss_mask) if m]
    assert [sample["logprobs"][i] for i in sampled] == pytest.approx([trained.inference_logprobs[i] for i in sampled])
    assert [sample["policy_versions"][i] for i in sampled] == rollout.policy_versions
    unsampled = [i for i, m in enumerate(trained.loss_mask) if not m]
    assert all(sample["logprobs"][i] is None and sample["policy_versions"][i] is None for i in unsampled)
    assert [s["role"] for s in sample["segments"]] == ["prompt", "assistant"]
    assert sample["segments"][1] == {"role": "assistant", "start": sampled[0], "end": sampled[-1] + 1}


def test_a_multi_turn_record_is_cut_into_the_episodes_turns(served):
    url, model_dir = served
    tokenizer = load_tokenizer(str(model_dir))
    rollout, advantage = scored_group(url, model_dir, "wordle", group_size=2, max_tokens=8, max_turns=3)[0]
    record = sample_record(1, "wordle", rollout, advantage, tokenizer)

    roles = [s["role"] for sample in record["samples"] for s in sample["segments"]]
    assert rollout.turns == 3 and roles.count("assistant") == 3
    assert roles[:4] == ["prompt", "assistant", "environment", "assistant"]
    assert [m["role"] for m in record["conversation"]] == ["assistant", "user", "assistant", "user", "assistant"]
    for sample in record["samples"]:
        for segment in sample["segments"]:
            in_loss = sample["loss_mask"][segment["start"] : segment["end"]]
            assert all(in_loss) if segment["role"] == "assistant" else not any(in_loss)


def test_a_character_split_over_byte_tokens_goes_to_its_last_token(served):
    tokenizer = load_tokenizer(str(served[1]))
    ids = tokenizer.encode("aé€", add_special_tokens=False)  # 1 + 2 + 3 bytes: six byte-level tokens
    assert token_pieces(tokenizer, ids) == ["a", "", "é", "", "", "€"]
