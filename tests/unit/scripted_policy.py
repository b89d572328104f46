"""A policy that answers with given texts: it stands in for the inference server in episode-loop tests."""

from __future__ import annotations

from asyncrl.environments.base import Completion
from asyncrl.models.offline import build_tokenizer


class ScriptedPolicy:
    """Answers with the given texts, in order, as byte tokens ending in <|im_end|> (cut at `max_tokens`),
    recording every prompt it is sent."""

    temperature = 1.0
    seq_len = None

    def __init__(self, answers: list[str], max_tokens: int = 64, tokenizer=None):
        self.tokenizer = tokenizer or build_tokenizer()
        self.answers = list(answers)
        self.max_tokens = max_tokens
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []

    async def generate(self, prompt_ids, n, max_tokens=None):
        completions = []
        for _ in range(n):
            self.prompts.append(list(prompt_ids))
            ids = self.tokenizer.encode(self.answers.pop(0)) + [self.tokenizer.eos_token_id]
            limit = max_tokens or self.max_tokens
            finish = "stop" if len(ids) <= limit else "length"
            ids = ids[:limit]
            self.sampled.append(ids)
            completions.append(Completion(ids, [-0.5] * len(ids), [0] * len(ids), finish))
        return completions
