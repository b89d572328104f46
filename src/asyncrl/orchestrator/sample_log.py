"""One line of samples.jsonl: a scored rollout as the dashboard's rollout viewer shows it.

Besides the text (prompt, completion, reward, conversation), each of the rollout's token samples is kept
token by token, as the trainer sees it: token id, the text piece it decodes to, the logprob inference
sampled it with, whether it is in the loss, and the policy version that sampled it. `segments` cut the
token stream into turns: the prompt, each assistant turn (the sampled tokens) and the environment's
messages between them.
"""

from __future__ import annotations

from typing import Any

from asyncrl.environments.base import Rollout, TokenSample


def token_pieces(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """The text of each token, such that the pieces join to the decoded text. A character split over several
    byte-level tokens belongs to the last of them (the others get ""), instead of decoding to U+FFFD each."""
    pieces, pending = [], []
    for token_id in token_ids:
        pending.append(token_id)
        text = tokenizer.decode(pending)
        if text.endswith("\ufffd") and len(pending) < 4:  # a UTF-8 character takes at most 4 bytes
            pieces.append("")
            continue
        pieces.append(text)
        pending = []
    if pending:  # an unfinished character at the very end
        pieces[-1] = tokenizer.decode(pending)
    return pieces


def turn_segments(loss_mask: list[bool], first_sample: bool) -> list[dict[str, Any]]:
    """Runs of the token stream: sampled tokens are the assistant's turns, the run before the first one is
    the prompt (or, in a later sample, the conversation as the chat template re-rendered it), and the runs
    after an assistant turn are the environment's answer."""
    segments: list[dict[str, Any]] = []
    start = 0
    for i in range(1, len(loss_mask) + 1):
        if i == len(loss_mask) or loss_mask[i] != loss_mask[start]:
            if loss_mask[start]:
                role = "assistant"
            elif not segments:
                role = "prompt" if first_sample else "context"
            else:
                role = "environment"
            segments.append({"role": role, "start": start, "end": i})
            start = i
    return segments


def _sample_tokens(tokenizer: Any, sample: TokenSample, versions: list[int], first: bool) -> dict[str, Any]:
    sampled = iter(versions)
    return {
        "token_ids": sample.input_ids,
        "pieces": token_pieces(tokenizer, sample.input_ids),
        "logprobs": [round(lp, 6) if m else None for lp, m in zip(sample.inference_logprobs, sample.loss_mask)],
        "loss_mask": [bool(m) for m in sample.loss_mask],
        "policy_versions": [next(sampled, None) if m else None for m in sample.loss_mask],
        "segments": turn_segments(sample.loss_mask, first),
    }


def sample_record(
    step: int, label: str, rollout: Rollout, advantage: float | None, tokenizer: Any, group: int | None = None
) -> dict[str, Any]:
    """The samples.jsonl line of one scored rollout of batch `step` from environment `label` (and group number
    `group`). `advantage` is the one its tokens were trained with (None when the rollout stayed out of the
    batch)."""
    prompt = rollout.example.prompt
    # Rollout.policy_versions lists the sampled tokens' versions in order, over all token samples and turns.
    versions = list(rollout.policy_versions)
    samples, used = [], 0
    for index, sample in enumerate(rollout.samples):
        count = sum(sample.loss_mask)
        samples.append(_sample_tokens(tokenizer, sample, versions[used : used + count], index == 0))
        used += count
    return {
        "step": step,
        "group": group,
        "env": label,
        "prompt": prompt[-1]["content"] if prompt else "",
        "completion": rollout.completion_text,
        "answer": rollout.example.answer,
        "reward": rollout.reward,
        "advantage": advantage,
        "metrics": rollout.metrics,
        "error": rollout.error,
        "finish_reason": rollout.finish_reason,
        "is_truncated": rollout.is_truncated,
        "turns": rollout.turns,
        "policy_versions": [rollout.min_policy_version, max(versions, default=0)],
        "conversation": rollout.messages[len(prompt) :],
        "samples": samples,
    }
