"""SFT data: the loss mask covers the assistant's answer and nothing else; packing keeps samples apart; the
held-out eval split is seeded and never trained on."""

from __future__ import annotations

from itertools import islice

import pytest
import torch

from asyncrl.environments.reverse_text import ReverseText
from asyncrl.errors import AsyncRLError
from asyncrl.models import build_tokenizer
from asyncrl.trainer.sft import SFTSample, pack_samples, padding_row, split_held_out, tokenize_sft

MESSAGES = [
    {"role": "system", "content": "Reverse the text."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "olleh"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_mask_covers_exactly_the_answer_and_its_end_of_turn(tokenizer):
    sample = tokenize_sft(tokenizer, MESSAGES)
    answer = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert tokenizer.decode(answer) == "olleh<|im_end|>"
    rest = [t for t, m in zip(sample.input_ids, sample.loss_mask) if not m]
    prompt = tokenizer.apply_chat_template(MESSAGES[:2], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert rest[: len(prompt)] == prompt
    assert tokenizer.decode(rest[len(prompt) :]) == "\n"  # the template's newline after <|im_end|>


def test_mask_is_one_contiguous_span_after_the_prompt(tokenizer):
    mask = tokenize_sft(tokenizer, MESSAGES).loss_mask
    start = mask.index(True)
    assert all(mask[start : start + len("olleh") + 1]) and not any(mask[start + len("olleh") + 1 :])


def test_template_that_rewrites_the_prompt_is_refused(tokenizer):
    odd = build_tokenizer()
    odd.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    with pytest.raises(AsyncRLError, match="chat template"):
        tokenize_sft(odd, MESSAGES)


def sample(n: int, first: int) -> SFTSample:
    return SFTSample(list(range(first, first + n)), [i > 0 for i in range(n)])


def test_pack_fills_rows_in_order_and_restarts_positions():
    rows = pack_samples([sample(5, 0), sample(4, 10), sample(6, 20), sample(3, 30)], seq_len=10)
    assert [r.input_ids.tolist() for r in rows] == [
        [0, 1, 2, 3, 4, 10, 11, 12, 13],
        [20, 21, 22, 23, 24, 25, 30, 31, 32],
    ]
    assert rows[0].position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert rows[1].loss_mask.tolist() == [False, True, True, True, True, True, False, True, True]


def test_pack_cuts_a_sample_longer_than_a_row():
    rows = pack_samples([sample(3, 0), sample(15, 100)], seq_len=8)
    assert [len(r.input_ids) for r in rows] == [3, 8]
    assert rows[1].input_ids.tolist() == list(range(100, 108))


def test_padding_row_has_no_loss_token():
    row = padding_row(0)
    assert row.input_ids.tolist() == [0] and not bool(row.loss_mask.any())
    assert row.position_ids.dtype == torch.int64


def test_held_out_split_is_the_seeded_streams_start_and_never_trained_on():
    one_letter = ReverseText(min_length=1, max_length=1)  # 26 distinct examples: the stream repeats them
    held_out, training = split_held_out(one_letter.examples(0), 6)
    assert held_out == list(islice(one_letter.examples(0), 6))
    trained = list(islice(training, 300))
    assert len(trained) == 300
    assert {e.answer for e in trained}.isdisjoint(e.answer for e in held_out)
    assert len({e.answer for e in trained}) == 26 - len({e.answer for e in held_out})


def test_without_a_held_out_split_training_gets_the_whole_stream():
    held_out, training = split_held_out(ReverseText().examples(0), 0)
    assert held_out == [] and list(islice(training, 5)) == list(islice(ReverseText().examples(0), 5))
