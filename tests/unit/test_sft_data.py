"""SFT data: the loss mask covers the assistant's turns and nothing else; packing keeps samples apart; the
held-out eval split is seeded and never trained on; files and datasets become conversations, epoch by epoch."""

from __future__ import annotations

import json
from itertools import islice

import datasets
import pytest
import torch

from asyncrl.config.schema import SFTDataConfig
from asyncrl.data import epoch_order, load_rows
from asyncrl.environments.reverse_text import ReverseText
from asyncrl.errors import AsyncRLError
from asyncrl.models.offline import build_tokenizer
from asyncrl.trainer.sft import SFTSample, pack_samples, padding_row, tokenize_sft
from asyncrl.trainer.sft_data import Chat, load_sft_data, split_held_out

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


def reverse_chats(seed: int, length: int = 1):
    env = ReverseText(min_length=length, max_length=length)
    return (Chat(example.sft_messages()) for example in env.examples(seed))


def test_held_out_split_is_the_seeded_streams_start_and_never_trained_on():
    # 26 distinct one-letter examples: the stream repeats them
    held_out, training = split_held_out(reverse_chats(0), 6)
    assert held_out == list(islice(reverse_chats(0), 6))
    trained = list(islice(training, 300))
    assert len(trained) == 300
    assert {c.identity() for c in trained}.isdisjoint(c.identity() for c in held_out)
    assert len({c.identity() for c in trained}) == 26 - len({c.identity() for c in held_out})


def test_without_a_held_out_split_training_gets_the_whole_stream():
    held_out, training = split_held_out(reverse_chats(0, 5), 0)
    assert held_out == [] and list(islice(training, 5)) == list(islice(reverse_chats(0, 5), 5))


# ---- multi-turn conversations and tool calls ----

TOOL_TEMPLATE = (  # Qwen's convention: an assistant's tool calls follow its content as <tool_call> JSON
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
AGENT = [
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "five"},
]


def trained_text(tokenizer, sample: SFTSample) -> list[str]:
    """The decoded runs of loss tokens, in order."""
    runs, run = [], []
    for token, trained in zip(sample.input_ids, sample.loss_mask):
        if trained:
            run.append(token)
        elif run:
            runs, run = runs + [tokenizer.decode(run)], []
    return runs + ([tokenizer.decode(run)] if run else [])


@pytest.fixture()
def tool_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


def test_every_assistant_turn_trains_with_its_tool_calls_and_nothing_else_does(tool_tokenizer):
    sample = tokenize_sft(tool_tokenizer, AGENT)
    call = json.dumps(CALL["function"])
    assert trained_text(tool_tokenizer, sample) == [f"<tool_call>{call}</tool_call><|im_end|>", "five<|im_end|>"]
    assert sample.input_ids == tool_tokenizer.apply_chat_template(AGENT, tokenize=True, return_dict=False)


def test_last_assistant_only_trains_the_final_turn(tool_tokenizer):
    sample = tokenize_sft(tool_tokenizer, AGENT, loss_on="last_assistant")
    assert trained_text(tool_tokenizer, sample) == ["five<|im_end|>"]


# ---- files and datasets ----


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


PAIRS = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(10)]


def test_jsonl_parquet_and_a_saved_dataset_folder_give_the_same_conversations(tmp_path):
    jsonl = write_jsonl(tmp_path / "chat.jsonl", [{"messages": AGENT}, {"messages": AGENT[:2]}])
    rows = load_rows(str(jsonl))
    rows.to_parquet(str(tmp_path / "chat.parquet"))
    datasets.DatasetDict({"train": rows}).save_to_disk(str(tmp_path / "saved"))
    for path in (jsonl, tmp_path / "chat.parquet", tmp_path / "saved"):
        data = load_sft_data(SFTDataConfig(path=str(path), shuffle=False), seed=0, held_out_size=0)
        # Parquet and Arrow give every message every key, missing ones as None: dropped again
        assert [chat.messages for chat in data.training] == [AGENT, AGENT[:2]], path


def test_prompt_and_completion_columns_become_a_user_and_an_assistant_message(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    data = load_sft_data(SFTDataConfig(path=str(path), shuffle=False), seed=0, held_out_size=0)
    assert next(data.training).messages == [
        {"role": "user", "content": "q0"},
        {"role": "assistant", "content": "a0"},
    ]


def test_epochs_are_seeded_permutations_and_the_data_says_how_many_steps_it_lasts(tmp_path):
    assert list(epoch_order(4, seed=1, epochs=2)) == list(epoch_order(4, seed=1, epochs=2))
    order = list(epoch_order(10, seed=1, epochs=3))
    assert [sorted(order[i : i + 10]) for i in (0, 10, 20)] == [list(range(10))] * 3
    assert order[:10] != order[10:20] and order[:10] != list(range(10))
    assert list(epoch_order(3, seed=0, epochs=1, shuffle=False)) == [0, 1, 2]

    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    data = load_sft_data(SFTDataConfig(path=str(path), epochs=3), seed=0, held_out_size=2)
    assert data.size == 8 * 3
    assert data.steps(batch_size=5, max_steps=100) == 5 and data.steps(batch_size=5, max_steps=4) == 4
    trained = list(data.training)
    assert len(trained) == 24 and not {c.identity() for c in trained} & {c.identity() for c in data.held_out}


def test_rows_without_the_columns_or_a_missing_file_are_one_clear_error(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"question": "q", "response": "a"}])
    with pytest.raises(AsyncRLError, match="needs a 'messages' column, or 'prompt' and 'completion'"):
        load_sft_data(SFTDataConfig(path=str(path)), seed=0, held_out_size=0)
    renamed = SFTDataConfig(path=str(path), prompt_column="question", completion_column="response")
    assert next(load_sft_data(renamed, seed=0, held_out_size=0).training).messages[1]["content"] == "a"
    with pytest.raises(AsyncRLError, match="not found"):
        load_rows(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="not both"):
        SFTDataConfig(path=str(path), environment={"name": "reverse_text"})
