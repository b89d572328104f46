"""What OpenAI clients see of sampled tokens: each token's own bytes, even when it holds part of a character."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from asyncrl.inference.api.text import SampleText, TokenText
from asyncrl.models.offline import init_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "tiny"
    init_model(path, "tiny", seed=0)
    return AutoTokenizer.from_pretrained(path)


def test_a_token_holding_half_a_character_has_its_own_bytes_not_the_replacement_character(tokenizer):
    tokens = TokenText(tokenizer)
    first, second = tokenizer.encode("é")
    assert tokens.text(first) == "\ufffd"
    assert tokens.bytes(first) == b"\xc3" and tokens.bytes(second) == b"\xa9"


def test_the_bytes_of_a_text_s_tokens_are_its_utf8(tokenizer):
    tokens = TokenText(tokenizer)
    text = "naïve → 日本語 🙂 done"
    assert b"".join(tokens.bytes(token) for token in tokenizer.encode(text)) == text.encode()
    # The byte-level vocabulary: 256 tokens, one per byte.
    assert sorted(tokens.bytes(token) for token in range(256)) == [bytes([b]) for b in range(256)]


def test_a_special_token_s_bytes_are_its_text(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert TokenText(tokenizer).bytes(im_end) == b"<|im_end|>"


def stream(tokenizer, token_ids: list[int], stop: tuple[str, ...], finish_reason: str) -> list[str]:
    sample = SampleText(tokenizer, stop)
    last = len(token_ids) - 1
    return [sample.add(t, 0.0, [], finish_reason if i == last else None) for i, t in enumerate(token_ids)]


def test_streamed_deltas_add_up_to_the_text_and_never_split_a_character(tokenizer):
    text = "naïve → 日本語 🙂 done, and more text after it"
    token_ids = tokenizer.encode(text)
    deltas = stream(tokenizer, token_ids, (), "length")
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)


def test_streamed_deltas_hold_back_what_may_become_a_stop_string(tokenizer):
    sample = SampleText(tokenizer, ("END",))
    shown = "".join(sample.add(token, 0.0, [], None) for token in tokenizer.encode("abc EN"))
    assert shown == "abc "  # "EN" may still become "END"
    [x] = tokenizer.encode("x")
    assert sample.add(x, 0.0, [], None) == "ENx"  # it did not
    assert "".join(stream(tokenizer, tokenizer.encode("abc END"), ("END",), "stop")) == "abc "
