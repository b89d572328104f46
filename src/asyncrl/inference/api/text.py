"""From sampled tokens to what OpenAI clients see: the text of a choice, its stream of deltas, and the logprob
entries of its tokens (their text and their own UTF-8 bytes)."""

from __future__ import annotations

import functools
import itertools
import re
from typing import Any

from asyncrl.inference.engine.sequence import Completion

DECODE_CONTEXT = 4  # tokens decoded before a stream's new ones, for their text to read as within the whole
TOKEN_ID_PREFIX = "token_id:"  # how vLLM (and verifiers' train client) spell a token id where text is expected
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's spelling of a raw byte


class TokenText:
    """One token's text and bytes, cached per id. Decoding a token alone gives U+FFFD when it holds part of a
    multi-byte character; its bytes must be its own, so that a client can join the bytes of several tokens
    into the character (OpenAI's `bytes` field)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._special = {int(i): str(token) for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self.text = functools.lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = functools.lru_cache(maxsize=1 << 16)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._special:
            return self._special[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and all(char in BYTE_LEVEL_ALPHABET for char in piece):
                return bytes(BYTE_LEVEL_ALPHABET[char] for char in piece)
            if match := BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(match.group(1), 16)])
        return self.text(token_id).encode()


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2, Qwen, Llama 3): every byte is spelled by one printable character,
    itself for printable Latin-1, and 256 + k for the k-th other byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = (byte for byte in range(256) if byte not in printable)
    alphabet = {chr(byte): byte for byte in printable}
    alphabet.update({chr(256 + k): byte for k, byte in enumerate(others)})
    return alphabet


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def _is_byte_level(tokenizer: Any) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return "ByteLevel" in repr(decoder)


def visible_text(tokenizer: Any, token_ids: list[int], finish_reason: str, stop: tuple[str, ...]) -> tuple[str, int]:
    """The text OpenAI clients see and how many tokens it covers: cut before the first stop string, and
    without the EOS / stop token that ended the sample (usage still counts every generated token)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stop if s in text]
    if cuts:
        text = text[: min(cuts)]
        # The fewest tokens whose text reaches the cut; decoded lengths grow with the prefix.
        low, high = 0, len(token_ids)
        while low < high:
            middle = (low + high) // 2
            if len(tokenizer.decode(token_ids[:middle], skip_special_tokens=True)) >= len(text):
                high = middle
            else:
                low = middle + 1
        return text, low
    if finish_reason == "stop":
        return text, len(token_ids) - 1
    return text, len(token_ids)


class SampleText:
    """One sample's tokens turned into text deltas as they arrive. A delta never shows part of a stop string
    or half a UTF-8 character, and the deltas add up to the text of the same answer unstreamed."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.sent_tokens = 0  # tokens whose text has been sent
        self.sent_text = ""

    def add(self, token_id: int, logprob: float, top: list[tuple[int, float]], finish_reason: str | None) -> str:
        """Record a token; return the text that became safe to show (may be empty)."""
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.top_logprobs.append(top)
        if finish_reason is not None:
            text, covered = visible_text(self.tokenizer, self.token_ids, finish_reason, self.stop)
        else:
            text, covered = self._settled()
        delta = text[len(self.sent_text) :]
        self.sent_text, self.sent_tokens = text, max(covered, self.sent_tokens)
        return delta

    def _settled(self) -> tuple[str, int]:
        """The longest token prefix whose text is final: no trailing replacement character (a multi-byte
        character cut between tokens) and no tail that a stop string could still start with. Only the tokens
        not sent yet are decoded: decoding the whole sample at every token would make a stream quadratic."""
        count = len(self.token_ids)
        text = self._text_through(count)
        limit = len(text) - self._stop_prefix_length(text)
        while count > self.sent_tokens and (len(text) > limit or text.endswith("\ufffd")):
            count -= 1
            text = self._text_through(count)
        if count <= self.sent_tokens:
            return self.sent_text, self.sent_tokens
        return text, count

    def _text_through(self, count: int) -> str:
        """The text of the first `count` tokens (count >= sent_tokens): the text sent so far plus the new part,
        decoded from a few tokens back so that the piece decodes as it does within the whole (a tokenizer may
        drop a leading space, or join bytes across tokens)."""
        start = max(0, self.sent_tokens - DECODE_CONTEXT)
        before = self.tokenizer.decode(self.token_ids[start : self.sent_tokens], skip_special_tokens=True)
        window = self.tokenizer.decode(self.token_ids[start:count], skip_special_tokens=True)
        return self.sent_text + window[len(before) :]

    def _stop_prefix_length(self, text: str) -> int:
        """The length of the longest end of `text` that a stop string starts with (it may still complete)."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop[k - 1] == text[-1] and text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


def chat_logprob_entries(
    tokens: TokenText, token_ids: list[int], logprobs: list[float], top_logprobs: list[list[tuple[int, float]]]
) -> list[dict]:
    def entry(token_id: int, logprob: float) -> dict:
        return {"token": tokens.text(token_id), "logprob": logprob, "bytes": list(tokens.bytes(token_id))}

    return [
        {**entry(token_id, logprob), "top_logprobs": [entry(*pair) for pair in top]}
        for token_id, logprob, top in zip(token_ids, logprobs, top_logprobs or [[]] * len(token_ids))
    ]


def completion_logprobs(
    tokens: TokenText,
    token_ids: list[int],
    logprobs: list[float],
    top_logprobs: list[list[tuple[int, float]]],
    with_top: bool,
    text_offset: int = 0,
) -> dict:
    texts = [tokens.text(token_id) for token_id in token_ids]
    tops = [{tokens.text(i): lp for i, lp in top} for top in top_logprobs] if with_top else None
    return {
        "tokens": texts,
        "token_logprobs": logprobs,
        "top_logprobs": tops or [None] * len(texts),
        "text_offset": list(itertools.accumulate((len(text) for text in texts), initial=text_offset))[:-1],
    }


def token_id_logprobs(completion: Completion) -> list[dict]:
    """Logprob entries of vLLM's token route: the token is spelled `token_id:N` (verifiers' train client
    checks that) and also given as an int `token_id` (vLLM 0.32's tokens mode)."""

    def entry(token_id: int, logprob: float) -> dict:
        return {"token": f"{TOKEN_ID_PREFIX}{token_id}", "token_id": token_id, "logprob": logprob}

    tops = completion.top_logprobs or [[]] * len(completion.token_ids)
    return [
        {**entry(token_id, logprob), "top_logprobs": [entry(*pair) for pair in top]}
        for token_id, logprob, top in zip(completion.token_ids, completion.logprobs, tops)
    ]
