"""Choose the next token of every row of a batch, on the batch's device, and record its log-probability.

The recorded log-probability is log_softmax(logits / temperature)[token]: the distribution at the
sampling temperature, taken BEFORE top-k / top-p / min-p filtering. The trainer recomputes exactly this
quantity with teacher forcing (one forward pass, same temperature, no filtering), so the two sides of the
importance ratio in the loss measure the same thing. Filtering only narrows which tokens can be drawn.

Temperature 0 means greedy decoding; its log-probabilities are taken at temperature 1. So does any temperature
below MIN_TEMPERATURE, as in vLLM: dividing by it would overflow the logits (NaN logprobs, a wrong token).

Each row draws by inverting its cumulative distribution at one uniform number that the caller supplies
from the row's own generator: a whole batch samples in a few vectorized kernels, and a row's draw depends
only on its own seed, never on what else shares the batch. The inversion runs in float64 in two levels
(`inverse_cdf`): first over blocks of the vocabulary, then within the one block the draw falls in, so the
float64 cumulative sums cover blocks, not the whole [batch x vocab] (on an H200, at 128 x 151,936, one
float64 scan over everything took 0.3 ms of a 5.9 ms decoding step).

Before the temperature, `logit_bias` and the repetition penalties change the logits themselves
(`LogitAdjustments`): unlike filtering they change the distribution, so the recorded log-probability is of
the adjusted logits (as vLLM's processed logprobs), which a trainer's recompute from the model alone does not
know.

On a GPU, a batch whose rows ask for nothing but a temperature (no adjustments, no filtering, no top
logprobs) samples in two Triton kernels instead (`kernels/sampling_kernel.py`): the same draw from the same uniform,
at one read of the logits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from asyncrl.inference.kernels import sampling_kernel

MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy


class SamplingParams(Protocol):
    prompt_ids: list[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    top_logprobs: int
    logit_bias: Mapping[int, float]
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float


class LogitAdjustments:
    """The logit_bias and penalties of a batch's rows, applied to the raw logits in vLLM's order: bias, then
    repetition (HF's and vLLM's: a logit of a token of the prompt or the output is divided by the penalty if
    positive, multiplied by it if not), then frequency (minus the penalty x the token's count in the output),
    then presence (minus the penalty if the token is in the output at all). Rows that ask for none get neutral
    values.

    Each row's output counts live on the device, [batch x vocab], made from the host's token lists when the
    batch is formed and updated by `record` as tokens are drawn, in the device's order: a step launched
    before the host has read the previous one's tokens still counts them."""

    def __init__(self, rows: Sequence[SamplingParams], outputs: Sequence[Sequence[int]], device: torch.device | str):
        self.device = device
        bias = [(row, token, value) for row, params in enumerate(rows) for token, value in params.logit_bias.items()]
        self.bias = None
        if bias:
            rows_, tokens, values = zip(*bias)
            self.bias = (
                torch.tensor(rows_, device=device),
                torch.tensor(tokens, device=device),
                torch.tensor(values, dtype=torch.float32, device=device),
            )

        def column(values: list[float], neutral: float) -> torch.Tensor | None:
            if all(value == neutral for value in values):
                return None
            return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

        self.repetition = column([row.repetition_penalty for row in rows], 1.0)
        self.frequency = column([row.frequency_penalty for row in rows], 0.0)
        self.presence = column([row.presence_penalty for row in rows], 0.0)
        self.counted = self.repetition is not None or self.frequency is not None or self.presence is not None
        # The token lists, copied: the host appends to them while the device works.
        self._prompts = [list(row.prompt_ids) for row in rows] if self.repetition is not None else None
        self._outputs = [list(output) for output in outputs] if self.counted else None
        self.output_counts: torch.Tensor | None = None  # [B, V] float32, made at the first `apply`
        self.in_prompt: torch.Tensor | None = None  # [B, V] bool, for the repetition penalty
        self._rows = torch.arange(len(rows), device=device)

    @classmethod
    def of(
        cls, rows: Sequence[SamplingParams], outputs: Sequence[Sequence[int]], device: torch.device | str
    ) -> LogitAdjustments | None:
        """The adjustments of `rows` (given their `outputs` so far), or None when no row asks for any."""
        if not any(
            row.logit_bias or row.repetition_penalty != 1 or row.frequency_penalty or row.presence_penalty
            for row in rows
        ):
            return None
        return cls(rows, outputs, device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The adjusted logits [B, V], float32, in a new tensor (the model's own output buffer stays)."""
        adjusted = logits.to(torch.float32, copy=True)
        if self.bias is not None:
            adjusted.index_put_(self.bias[:2], self.bias[2], accumulate=True)
        if self.counted and self.output_counts is None:
            self._count(adjusted.shape[1])
        if self.repetition is not None:
            seen = self.in_prompt | (self.output_counts > 0)
            penalized = torch.where(adjusted > 0, adjusted / self.repetition, adjusted * self.repetition)
            adjusted = torch.where(seen, penalized, adjusted)
        if self.frequency is not None:
            adjusted -= self.frequency * self.output_counts
        if self.presence is not None:
            adjusted -= self.presence * (self.output_counts > 0)
        return adjusted

    def record(self, token_ids: torch.Tensor) -> None:
        """Count the tokens just drawn, one per row."""
        if self.output_counts is not None:
            self.output_counts.index_put_(
                (self._rows, token_ids), torch.ones_like(token_ids, dtype=torch.float32), accumulate=True
            )

    def _count(self, vocab: int) -> None:
        self.output_counts = _bins(self._outputs, vocab, self.device).float()
        if self._prompts is not None:
            self.in_prompt = _bins(self._prompts, vocab, self.device) > 0
        self._prompts = self._outputs = None


def _bins(token_lists: list[list[int]], vocab: int, device: torch.device | str) -> torch.Tensor:
    """Per row, how many times each token id occurs in its list: [rows, vocab] int64."""
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), torch.tensor([len(ids) for ids in token_lists]))
    tokens = torch.tensor([token for ids in token_lists for token in ids], dtype=torch.long)
    bins = torch.zeros(len(token_lists), vocab, dtype=torch.long)
    bins.index_put_((rows, tokens), torch.ones_like(tokens), accumulate=True)
    return bins.to(device)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors, plus what the host knows about them, so that sampling never
    has to ask the device (which would stall it) whether some row needs filtering."""

    temperature: torch.Tensor  # [B] float32; 1 on greedy rows
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] long, 0 = no limit
    min_p: torch.Tensor  # [B] float32
    greedy: torch.Tensor  # [B] bool
    any_greedy: bool
    any_filtered: bool  # some row has top-k, top-p or min-p
    num_top: int  # the largest top_logprobs asked for
    adjustments: LogitAdjustments | None = None  # some row has a logit_bias or a penalty

    @classmethod
    def of(
        cls,
        rows: Sequence[SamplingParams],
        device: torch.device | str,
        outputs: Sequence[Sequence[int]] | None = None,
    ) -> SamplingBatch:
        """`outputs`: each row's tokens generated so far (none if not given), which the penalties count."""

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        greedy = [row.temperature < MIN_TEMPERATURE for row in rows]
        return cls(
            temperature=column([1.0 if g else row.temperature for g, row in zip(greedy, rows)], torch.float32),
            top_p=column([row.top_p for row in rows], torch.float32),
            top_k=column([row.top_k for row in rows], torch.long),
            min_p=column([row.min_p for row in rows], torch.float32),
            greedy=column(greedy, torch.bool),
            any_greedy=any(greedy),
            any_filtered=any(row.top_k > 0 or row.top_p < 1 or row.min_p > 0 for row in rows),
            num_top=max((row.top_logprobs for row in rows), default=0),
            adjustments=LogitAdjustments.of(rows, outputs or [[] for _ in rows], device),
        )


@dataclass
class SampledTokens:
    token_ids: torch.Tensor  # [B] long
    logprobs: torch.Tensor  # [B] float32 (float64 from the Triton kernels)
    top_ids: torch.Tensor  # [B, K] long, K = the largest top_logprobs asked for in the batch (may be 0)
    top_logprobs: torch.Tensor  # [B, K] float32
    table: torch.Tensor | None = None  # [B, 2 + 2K] float64, the four columns side by side, where made at once

    def to_host(self) -> HostCopy:
        return HostCopy(self)


class HostCopy:
    """Sampled tokens on their way to the host: one device-to-host copy of all four tables, queued behind the
    work that makes them. On a GPU it lands in pinned memory and `read` waits for it alone, not for the
    device's later work, so the next decoding step can already run (the engine decodes one step ahead).
    Token ids and float32 values are exact in float64."""

    def __init__(self, sampled: SampledTokens):
        self.top = sampled.top_ids.shape[1]
        table = sampled.table
        if table is None:
            columns = (sampled.token_ids[:, None], sampled.logprobs[:, None], sampled.top_ids, sampled.top_logprobs)
            table = torch.cat([column.double() for column in columns], dim=1)
        self.ready = None
        if table.device.type == "cuda":
            self.table = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
            self.table.copy_(table, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.table = table

    def read(self) -> tuple[list[int], list[float], list[list[int]], list[list[float]]]:
        """Token ids, their logprobs, and the top ids and logprobs of each row, as Python lists."""
        if self.ready is not None:
            self.ready.synchronize()
        rows = self.table.tolist()
        top_ids = [[int(token) for token in row[2 : 2 + self.top]] for row in rows]
        return [int(row[0]) for row in rows], [row[1] for row in rows], top_ids, [row[2 + self.top :] for row in rows]


def sample(logits: torch.Tensor, batch: SamplingBatch, uniforms: torch.Tensor, kernels: bool = False) -> SampledTokens:
    """`logits` [B, V]; `uniforms` [B] float64 in [0, 1), one fresh draw per row from the row's generator.
    `kernels`: sample with the Triton kernels (`sample_fused`) where the batch allows it."""
    if kernels and batch.adjustments is None and not batch.any_filtered and batch.num_top == 0:
        return sample_fused(logits, batch, uniforms)
    if batch.adjustments is not None:
        logits = batch.adjustments.apply(logits)
    # bfloat16 logits divided by float32 temperatures give float32, in one kernel.
    logprobs = torch.log_softmax(logits / batch.temperature[:, None], dim=-1)
    candidates = filter_logprobs(logprobs, batch.top_k, batch.top_p, batch.min_p) if batch.any_filtered else logprobs
    token_ids = inverse_cdf(candidates.exp(), uniforms.to(logits.device))
    if batch.any_greedy:
        token_ids = torch.where(batch.greedy, logprobs.argmax(dim=-1), token_ids)
    if batch.adjustments is not None:
        batch.adjustments.record(token_ids)
    chosen = logprobs.gather(-1, token_ids[:, None])[:, 0]
    top_logprobs, top_ids = logprobs.topk(batch.num_top, dim=-1)
    return SampledTokens(token_ids, chosen, top_ids, top_logprobs)


def sample_fused(logits: torch.Tensor, batch: SamplingBatch, uniforms: torch.Tensor) -> SampledTokens:
    """`sample` in two Triton kernels (`kernels/sampling_kernel.py`), for batches without adjustments, filtering or top
    logprobs."""
    token_ids, table = sampling_kernel.sample_rows(
        logits, batch.temperature, batch.greedy, uniforms.to(logits.device, non_blocking=True)
    )
    empty = table[:, 2:]
    return SampledTokens(token_ids, table[:, 1], empty.long(), empty.float(), table)


BLOCK = 1024  # vocabulary entries per block of the two-level inverse CDF


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """For each row of `probs` [B, V] (not necessarily normalized), the first token whose cumulative mass
    exceeds uniforms[row] x the row's total mass, in float64 so that even very unlikely tokens keep their
    share of [0, 1). side="right": that token has non-zero mass."""
    rows, vocab = probs.shape
    blocks = F.pad(probs, (0, -vocab % BLOCK)).view(rows, -1, BLOCK)
    block_mass = blocks.sum(-1, dtype=torch.float64)  # [B, blocks]
    block_end = block_mass.cumsum(-1)
    targets = uniforms[:, None] * block_end[:, -1:]
    block = torch.searchsorted(block_end, targets, right=True).clamp_(max=blocks.shape[1] - 1)  # [B, 1]
    inside = targets - (block_end.gather(-1, block) - block_mass.gather(-1, block))
    chosen = blocks.gather(1, block[:, :, None].expand(rows, 1, BLOCK))[:, 0].cumsum(-1, dtype=torch.float64)
    offset = torch.searchsorted(chosen, inside, right=True).clamp_(max=BLOCK - 1)
    return (block * BLOCK + offset)[:, 0].clamp_(max=vocab - 1)


def filter_logprobs(
    logprobs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Renormalized log-probabilities with everything outside each row's top-k, then top-p nucleus, then
    min-p set to -inf (the order of Hugging Face's processors). The most likely token always survives.
    Rows without limits come back unchanged."""
    vocab = logprobs.shape[-1]
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logprobs.device)
    k = torch.where(top_k > 0, top_k, vocab)
    sorted_lp = sorted_lp.masked_fill(rank >= k[:, None], float("-inf"))
    # top-p acts on the distribution left by top-k (as in Hugging Face and vLLM): drop a token when the
    # tokens ranked above it already hold top_p of the mass.
    probs = torch.softmax(sorted_lp, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # The most likely token (rank 0) always stays, also for a top_p that rounds to 0 in float32.
    dropped = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1) & (rank > 0)
    sorted_lp = sorted_lp.masked_fill(dropped, float("-inf"))
    # min-p: keep tokens at least min_p times as likely as the most likely one (which top-k/p never drop).
    sorted_lp = sorted_lp.masked_fill(sorted_lp < sorted_lp[:, :1] + min_p.log()[:, None], float("-inf"))
    kept = torch.full_like(logprobs, float("-inf")).scatter(-1, order, sorted_lp)
    limited = (top_k > 0) & (top_k < vocab) | (top_p < 1) | (min_p > 0)
    return torch.where(limited[:, None], torch.log_softmax(kept, dim=-1), logprobs)
