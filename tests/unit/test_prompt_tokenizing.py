"""prompts.py: a long prompt tokenized in chunks gives the tokens of one `encode`, stops at the seq_len bound,
and a job of a request that is cancelled (its client left) stops."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from asyncrl.inference.api.prompts import CHUNK_CHARS, PromptTokenizer, PromptWorkers
from asyncrl.inference.engine.sequence import RequestError
from asyncrl.models.offline import build_tokenizer

WORDS = ["the", "cat", "naïve", "日本語", "42", "3.14", "don't", "<|im_start|>", "user", "x_y", "--", "émoji🙂"]
SEPARATORS = [" ", "  ", "\n", "\n\n", " \n", "\t", "", ".", ", ", "'s "]


def text_of(seed: int, length: int) -> str:
    rng = random.Random(seed)
    parts, size = [], 0
    while size < length:
        parts += [rng.choice(WORDS), rng.choice(SEPARATORS)]
        size += len(parts[-2]) + len(parts[-1])
    return "".join(parts)[:length]


def trained_bpe(pre_tokenizer, normalizer=None, post_processor=None, decoder=None) -> PreTrainedTokenizerFast:
    """A BPE with merges learnt from the test's own words, so that chunks must cut between merged tokens."""
    core = Tokenizer(models.BPE(unk_token="<unk>" if normalizer is not None else None))
    core.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        core.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|im_start|>", "<s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if normalizer is None else [],
        show_progress=False,
    )
    core.train_from_iterator([text_of(seed, 2000) for seed in range(20)], trainer)
    if post_processor is not None:
        core.post_processor = post_processor
    core.decoder = decoder or decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core)


TOKENIZERS = {
    "byte level, no merges (asyncrl model init)": build_tokenizer,
    "GPT-2 style byte-level BPE": lambda: trained_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "SentencePiece style, with BOS": lambda: trained_bpe(
        pre_tokenizers.Metaspace(prepend_scheme="first"),
        normalizers.NFC(),
        processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)]),
        decoders.Metaspace(),
    ),
}


def tokenize(tokenizer, text: str, special_tokens: bool, seq_len: int = 10**7, max_tokens: int = 1) -> list[int]:
    async def run() -> list[int]:
        prompts = PromptTokenizer(tokenizer, PromptWorkers(threads=1), seq_len)
        return await prompts.tokenize(text, len(text), max_tokens, special_tokens)

    return asyncio.run(run())


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("special_tokens", [False, True])
def test_a_prompt_tokenized_in_chunks_has_the_tokens_of_one_encode(name, special_tokens):
    tokenizer = TOKENIZERS[name]()
    for seed in range(3):
        text = text_of(seed, 5 * CHUNK_CHARS)
        assert tokenize(tokenizer, text, special_tokens) == tokenizer.encode(text, add_special_tokens=special_tokens)


def test_a_text_without_a_clean_cut_is_tokenized_in_one_piece():
    tokenizer = TOKENIZERS["GPT-2 style byte-level BPE"]()
    text = "ab" * (3 * CHUNK_CHARS)  # one word: no letter is followed by anything else
    assert tokenize(tokenizer, text, False) == tokenizer.encode(text, add_special_tokens=False)


def test_tokenizing_stops_at_the_first_chunk_past_what_seq_len_leaves():
    tokenizer = build_tokenizer()  # one token per byte
    text = "abc " * (10 * CHUNK_CHARS)
    with pytest.raises(RequestError, match=r"prompt \(at least \d+ tokens\) \+ max_tokens \(100\)") as refused:
        tokenize(tokenizer, text, False, seq_len=1000, max_tokens=100)
    assert int(str(refused.value).split("at least ")[1].split()[0]) <= CHUNK_CHARS * 2


def test_a_running_job_of_a_request_cancelled_stops_and_its_waiting_jobs_never_run():
    ran: list[str] = []
    started = threading.Event()

    def busy() -> None:  # Python code, as a chat template is
        started.set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pass
        ran.append("busy finished")

    async def run() -> tuple[PromptWorkers, float]:
        workers = PromptWorkers(threads=1)
        running = asyncio.ensure_future(workers.run(0, busy, stoppable=True))
        waiting = asyncio.ensure_future(workers.run(0, lambda: ran.append("waiting ran")))
        while not started.is_set():
            await asyncio.sleep(0.01)
        cancelled_at = time.monotonic()
        running.cancel()
        waiting.cancel()
        assert await workers.run(0, lambda: "next") == "next"  # the thread is free again
        return workers, time.monotonic() - cancelled_at

    workers, freed_after = asyncio.run(run())
    assert ran == [] and workers.stopped_prompts == 2
    assert freed_after < 5.0
