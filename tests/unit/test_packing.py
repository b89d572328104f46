import random

import torch

from asyncrl.orchestrator.packing import Sample, first_fit_decreasing, pack
from asyncrl.transport.rollouts import read_batch, write_batch


def make_samples(lengths, seed=0):
    rng = random.Random(seed)
    samples = []
    for i, length in enumerate(lengths):
        prompt = length // 2
        samples.append(
            Sample(
                input_ids=[rng.randrange(250) for _ in range(length)],
                loss_mask=[False] * prompt + [True] * (length - prompt),
                advantage=float(i) - 3.0,
                inference_logprobs=[0.0] * prompt + [-rng.random() for _ in range(length - prompt)],
                temperature=0.7,
            )
        )
    return samples


def test_first_fit_decreasing_respects_capacity_and_keeps_every_item():
    lengths = [5, 9, 3, 7, 2, 8, 1]
    bins = first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)


def test_pack_loses_no_token_and_respects_seq_len():
    samples = make_samples([30, 12, 45, 8, 20, 33, 17, 5, 40])
    per_rank = pack(samples, seq_len=64, num_ranks=2)
    micro_batches = [mb for rank in per_rank for mb in rank]
    assert all(mb.num_tokens <= 64 for mb in micro_batches)
    loss_tokens = sum(int(mb.loss_mask.sum()) for mb in micro_batches)
    assert loss_tokens == sum(sum(s.loss_mask) for s in samples)
    packed = sorted(tuple(mb.input_ids.tolist()) for mb in micro_batches)
    rebuilt = []
    for mb in micro_batches:
        offset = 0
        for length in mb.sample_lengths.tolist():
            rebuilt.append(tuple(mb.input_ids[offset : offset + length].tolist()))
            offset += length
    real = [r for r in rebuilt if len(r) > 1]
    assert sorted(real) == sorted(tuple(s.input_ids) for s in samples)
    assert packed


def test_positions_restart_for_every_sample():
    per_rank = pack(make_samples([10, 6, 4]), seq_len=32, num_ranks=1)
    (mb,) = per_rank[0]
    assert mb.position_ids.tolist() == list(range(10)) + list(range(6)) + list(range(4))


def test_advantages_and_logprobs_follow_their_tokens():
    samples = make_samples([10, 6])
    (mb,) = pack(samples, seq_len=32, num_ranks=1)[0]
    first = samples[0]
    assert mb.advantages[:10].tolist() == [first.advantage if m else 0.0 for m in first.loss_mask]
    assert torch.allclose(mb.inference_logprobs[:10], torch.tensor(first.inference_logprobs))
    assert torch.all(mb.temperature == 0.7)


def test_ranks_get_equal_micro_batch_counts_padded_without_loss_tokens():
    per_rank = pack(make_samples([60, 60, 60]), seq_len=64, num_ranks=2)
    assert [len(r) for r in per_rank] == [2, 2]
    padding = [mb for r in per_rank for mb in r if mb.num_tokens == 1]
    assert len(padding) == 1 and not padding[0].loss_mask.any()


def test_overlong_sample_is_cut_to_seq_len():
    (mb,) = pack(make_samples([100]), seq_len=64, num_ranks=1)[0]
    assert mb.num_tokens == 64


def test_batch_file_round_trip(tmp_path):
    per_rank = pack(make_samples([10, 6, 4, 30]), seq_len=32, num_ranks=1)
    path = tmp_path / "rollouts" / "step_1" / "rank_0.safetensors"
    write_batch(path, per_rank[0])
    loaded = read_batch(path)
    assert len(loaded) == len(per_rank[0])
    for a, b in zip(per_rank[0], loaded):
        assert torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.advantages, b.advantages)
    assert not list(path.parent.glob(".*tmp*"))
