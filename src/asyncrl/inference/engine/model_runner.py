"""The forward passes of the policy: prefill of new prompts and one decoding step of the running batch.

Written over the parameters of our model of a registered family (`asyncrl.models`: RMSNorm, rotary embeddings,
on all or part of each head, grouped-query attention with or without q/k/v biases, Qwen3's q/k norms, SwiGLU
MLPs or mixtures of experts), not through `model.forward`: a cache and masks cost more than the math at decode
time. A mixture-of-experts layer runs the family's own router and grouped experts (`models/moe.py`), the very
code the trainer runs, so both route alike; for router replay the experts of every token are recorded
(`routed`). A decoding step of a small model is bound by
how many kernels it launches, so the step uses few: q/k/v and gate/up are one matrix each (`fuse_linears`),
the q and k heads are normalized and rotated together. The parameters stay the model's (the fused
matrices hold them as views), so a weight update that copies into them (`load_state_dict`) is seen at
once, CUDA graphs included. Every operation follows transformers' order and dtypes (norms in float32,
then cast, then the weight; rotary tables in the model dtype), so logprobs match a teacher-forced Hugging
Face forward.

- Prefill: the distinct prompts, right-padded to the longest, through causal attention (padding sits after
  every real token, so no mask is needed); keys and values go to the samples' slots, one row per sample.
  Outside attention each prompt token is one row, as in decoding, so both share the (compiled) functions.
  With the prefix cache (paged layout), a prompt whose first positions are in cached blocks computes only
  the rest, attending to the cached keys and values gathered from its blocks under a causal mask.
- Decode: one token per running sample; slot i of the KV cache is batch row i. Attention reads the slots in
  place. On a GPU in half precision a kernel reads each slot up to its own length, so no row reads keys
  past its end: our Triton split-KV kernel (`kernels/decode_attention.py`) or torch's flash attention
  (`seqused_k`); elsewhere scaled-dot-product attention up to the longest context of the batch, with each
  row's length as the mask. With the Triton kernel, one more (`kernels/decode_heads.py`) takes each layer from the
  q/k/v projection to attention: q/k norms, rotary at each row's position, k and v written into the cache.
  On a GPU the step is replayed from a CUDA graph (`cuda_graphs.py`): one per batch bucket with the Triton
  kernel, all captured at start (`warm_up`); one per (batch, context) bucket otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from asyncrl.errors import AsyncRLError
from asyncrl.inference.engine.cuda_graphs import DecodeGraphs, bucket
from asyncrl.inference.engine.kv_cache import KVCache
from asyncrl.inference.engine.paged_cache import PagedKVCache
from asyncrl.inference.kernels.decode_attention import AVAILABLE as TRITON_DECODE
from asyncrl.inference.kernels.decode_attention import decode_attention
from asyncrl.inference.kernels.decode_heads import decode_heads
from asyncrl.inference.kernels.moe_experts import AVAILABLE as FUSED_EXPERTS
from asyncrl.inference.kernels.moe_experts import fused_experts
from asyncrl.inference.kernels.paged_decode_attention import paged_decode_attention
from asyncrl.inference.kernels.triton_import import INTERPRETED
from asyncrl.models import native_problem
from asyncrl.models.checkpoint import from_transformers
from asyncrl.models.moe import expert_counts
from asyncrl.models.transformer import CausalLM


def _find_flash_decode():
    """torch's varlen flash attention forward, where it takes `seqused_k` (keys used per sequence): decoding
    then reads each slot's keys up to its own length, in a kernel made for many short queries."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    try:
        names = {argument.name for argument in op.default._schema.arguments}
    except (AttributeError, RuntimeError):
        return None
    return op.default if "seqused_k" in names else None


FLASH_DECODE = _find_flash_decode()


def _find_packed_linear():
    """oneDNN's matrix multiplication over a weight reordered once into its blocked layout (the ops torch's
    inductor uses for frozen CPU models): in float32 it ran 15-25% faster than `F.linear` on one core of
    the development machine (30M model's shapes, 64 rows as in decoding and 2,048 as in a prefill)."""
    try:
        ops = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None
    return ops if torch.backends.mkldnn.is_available() else None


PACKED_LINEAR = _find_packed_linear()
PACKED_ROWS_HINT = 64  # rows oneDNN tunes the packed layout for (a decoding batch); any number works
# Smaller weights stay with F.linear: the 0.1M and 0.8M presets' decoding steps were slower packed (1.3 vs
# 1.0 ms, 5.2 vs 5.0 ms); the 30M preset's smallest matrix (512 x 512) gains.
PACKED_MIN_WEIGHT = 1 << 18

# Decoding with "sdpa" (CPU; float32 on a GPU) attends under a mask. On a GPU, where flash takes no mask, it is
# pinned to the memory-efficient kernel (on the H200, bf16, batch 128 x context 384: 0.12 ms per layer;
# cuDNN's 0.10, math 0.66; FLASH_DECODE later measured 0.05), which captures into CUDA graphs, rather than
# left to per-shape dispatch. On CPU, flash takes masks and beats math ~2x.
DECODE_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Rows (tokens) up to which a mixture-of-experts layer takes the Triton experts kernel when `moe_kernel` says
# so: decoding batches; a prefill's thousands of rows are matrix products grouped_mm runs well.
FUSED_EXPERTS_MAX_ROWS = 1024
# Prefill leaves out cuDNN's attention, which torch prefers on Hopper: it plans each new (prompts, width)
# shape anew, and a run whose prompts arrived in two prefills of new shapes took ~0.2 s longer on the H200.
PREFILL_ATTENTION = DECODE_ATTENTION


def decode_attention_kernel(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """The decoding attention kernel for `inference.decode_attention`: "triton" (`kernels/decode_attention.py`),
    "flash" (torch's flash attention, `seqused_k`) or "sdpa" (scaled-dot-product attention under a mask).
    "auto": triton, else flash, on a GPU in half precision; sdpa elsewhere (CPU, or float32, where the others
    would multiply in lower precision). Asked for by name, "triton" also takes a float32 model on a GPU (its
    products in tf32), and under Triton's interpreter CPU tensors too (tests)."""
    gpu_half = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    available = {"triton": gpu_half and TRITON_DECODE, "flash": gpu_half and FLASH_DECODE is not None, "sdpa": True}
    if choice == "auto":
        return next(kernel for kernel, ok in available.items() if ok)
    if choice == "triton" and not ((device.type == "cuda" and TRITON_DECODE) or INTERPRETED):
        raise AsyncRLError("inference.decode_attention = 'triton' needs a CUDA GPU and triton (use 'auto')")
    if choice == "flash" and not available["flash"]:
        raise AsyncRLError(
            "inference.decode_attention = 'flash' needs a CUDA GPU, a float16/bfloat16 model and a torch whose "
            "flash attention takes seqused_k (use 'auto')"
        )
    return choice


def paged_attention_kernel(choice: str, resolved: str, cuda_graphs: bool) -> str:
    """The decoding attention of the paged layout, from `inference.decode_attention` (`choice`) and what
    `decode_attention_kernel` made of it: the Triton paged kernel (`kernels/paged_decode_attention.py`) or sdpa
    over the gathered blocks. Refused: torch's flash attention (contiguous slots only; "auto" leaves it for
    sdpa), and CUDA graphs without the Triton kernel (sdpa gathers each step's context, which a graph would
    fix)."""
    if resolved == "flash":
        if choice != "auto":
            raise AsyncRLError(
                "inference.decode_attention = 'flash' reads contiguous slots, not the blocks of "
                "inference.kv_cache_layout = 'paged' (use 'triton' or 'sdpa', or kv_cache_layout = 'slots')"
            )
        resolved = "sdpa"
    if cuda_graphs and resolved != "triton":
        raise AsyncRLError(
            "inference.kv_cache_layout = 'paged' replays decoding steps as CUDA graphs only with the Triton "
            "paged kernel, which needs a CUDA GPU and triton, and which 'auto' leaves out for a float32 model "
            "(set inference.decode_attention = 'triton', or inference.cuda_graphs = false)"
        )
    return resolved


def flash_decode(q, keys, values, used, context: int, query_starts, key_starts) -> torch.Tensor:
    """torch's flash attention over the cache in place, read as [slots x max_len, kv heads, dim]: row i's keys
    start at `key_starts[i]` (i x max_len) and it uses `used[i]` of them. The `group` query heads that share
    a KV head go in as that head's `group` queries (`query_starts[i]` = i x group; not causal: all see the
    same keys), so each KV head's keys are read once per row, not once per query head. `context` (at least
    the longest used length) only sizes its work. q: [batch, heads, dim]; returns the same shape."""
    batch, heads, dim = q.shape
    slots, max_len, kv_heads, _ = keys.shape
    group = heads // kv_heads
    flat = (slots * max_len, kv_heads, dim)
    # Query head kv x group + g is row g of KV head kv.
    queries = q.reshape(batch, kv_heads, group, dim).transpose(1, 2).reshape(batch * group, kv_heads, dim)
    attention = FLASH_DECODE(
        queries,
        keys.view(flat),
        values.view(flat),
        query_starts,
        key_starts,
        group,
        context,
        0.0,
        False,
        False,
        seqused_k=used,
    )[0]
    return attention.view(batch, group, kv_heads, dim).transpose(1, 2).reshape(batch, heads, dim)


def moe_kernel_for(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """`inference.moe_kernel` resolved: "triton" (`kernels/moe_experts.py`, decoding batches) or "grouped_mm"."""
    gpu_half = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and FUSED_EXPERTS
    if choice == "auto":
        return "triton" if gpu_half else "grouped_mm"
    if choice == "triton" and not (gpu_half or INTERPRETED):
        raise AsyncRLError(
            "inference.moe_kernel = 'triton' needs a CUDA GPU, a float16/bfloat16 model and triton (use 'auto')"
        )
    return choice


def check_supported(config) -> None:
    problem = native_problem(config)
    if problem:
        raise AsyncRLError(f"the native inference engine cannot serve this model: {problem} (serve it with vLLM)")


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    return normalize(x, norm.variance_epsilon) * norm.weight


def normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x), computed in float32 and cast back to x's dtype, as transformers does before the weight."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def rotary_partner(x: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Each dimension's partner in the rotation: the other half of the first `rotary_dim` dimensions (rolled by
    half of them); the dimensions past `rotary_dim` are their own (their sine is 0)."""
    if rotary_dim == x.shape[-1]:
        return x.roll(rotary_dim // 2, dims=-1)
    half = rotary_dim // 2
    return torch.cat((x[..., half:rotary_dim], x[..., :half], x[..., rotary_dim:]), dim=-1)


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' tables [positions, rotary dims] as ours [positions, head_dim]: transformers rotates x into
    cat(-x2, x1) * sin; with sin's halves equal (they are), that is partner(x) * cat(-sin1, sin2): the same
    products, one kernel. Dimensions past the rotary ones get cos 1 and sin 0, which leave them as they are."""
    half, rest = cos.shape[-1] // 2, head_dim - cos.shape[-1]
    sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    if rest:
        cos = torch.cat((cos, cos.new_ones(cos.shape[0], rest)), dim=-1)
        sin = torch.cat((sin, sin.new_zeros(sin.shape[0], rest)), dim=-1)
    return cos, sin


def split_heads(
    qkv: torch.Tensor,
    qk_scale: torch.Tensor | None,
    qk_eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    head_dim: int,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused q/k/v projection's output as queries, keys, values [..., heads, head_dim], with Qwen3's q/k
    norms (`qk_scale`: their weights, one row per head) and rotary embeddings applied (`rotary_tables`)."""
    qkv = qkv.unflatten(-1, (-1, head_dim))
    num_kv_heads = (qkv.shape[-2] - num_heads) // 2
    qk, v = qkv.split([num_heads + num_kv_heads, num_kv_heads], dim=-2)
    if qk_scale is not None:
        qk = normalize(qk, qk_eps) * qk_scale
    qk = qk * cos + rotary_partner(qk, rotary_dim) * sin
    return qk[..., :num_heads, :], qk[..., num_heads:, :], v


def add_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual addition and the RMS norm that reads its result: the new residual stream and the norm."""
    x = x + delta
    return x, normalize(x, eps) * weight


def split_heads_contiguous(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`split_heads` with each output written contiguously, by the compiled kernel itself: the cache writes
    and attention then copy nothing."""
    return tuple(tensor.contiguous() for tensor in split_heads(*args))


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class DecodeOps(NamedTuple):
    """The elementwise work between a decoding step's matrix products and attention kernels."""

    split_heads: Callable = split_heads
    add_norm: Callable = add_norm
    swiglu: Callable = swiglu

    @classmethod
    def compiled(cls) -> DecodeOps:
        """The same functions through torch.compile, each fused into one or two kernels: unfused, they are
        ~20 small kernels per layer, most of a GPU decoding step's kernel count. Compiled on first use for
        the first batch size, and once more for all others (torch's automatic dynamic shapes); the CUDA
        graphs then capture the compiled kernels like any others."""
        functions = (split_heads_contiguous, add_norm, swiglu)
        return cls(*(torch.compile(function, fullgraph=True) for function in functions))


def dense_mlp(layer: nn.Module) -> nn.Module | None:
    """The SwiGLU (gate_proj, up_proj, down_proj) a decoder layer runs for every token: its MLP, the shared
    experts of a mixture of experts, or None (routed experts only)."""
    return getattr(layer.mlp, "shared_experts", None) if layer.is_moe else layer.mlp


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) matrix whose row blocks are the given layers' parameters: each layer's parameter
    becomes a view of its block, so whatever is copied into the parameters lands in the fused matrix."""
    fused = []
    for attribute in ("weight", "bias"):
        parts = [getattr(linear, attribute) for linear in linears]
        if any(part is None for part in parts):
            fused.append(None)
            continue
        matrix = torch.cat([part.detach() for part in parts])
        offset = 0
        for layer, part in zip(linears, parts):
            block = matrix[offset : offset + part.shape[0]]
            setattr(layer, attribute, nn.Parameter(block, requires_grad=False))
            offset += part.shape[0]
        fused.append(matrix)
    return fused[0], fused[1]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        cache: KVCache,
        cuda_graphs: bool,
        compile: bool = False,
        attention: str = "auto",
        share_prompts: bool = False,
        moe_kernel: str = "auto",
    ):
        """`compile`: fuse the decoding step's elementwise work with torch.compile (`DecodeOps.compiled`).
        `attention`: the decoding attention kernel (`decode_attention_kernel`). `share_prompts`: with the
        Triton kernel, rows may read their prompt from another slot (`shares_prompts`; `decode`'s prefix
        arguments, `prefill`'s `holders`)."""
        config = model.config
        check_supported(config)
        if not isinstance(model, CausalLM):  # a transformers model of a registered family: ours, same tensors
            model = from_transformers(model)
        self.model = model
        self.cache = cache
        self.layers = list(model.model.layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        # Qwen3's q and k norm weights, one row per head, so both are scaled in one multiplication.
        self.qk_scales = [self._qk_scale(layer) for layer in self.layers] if self.qk_norm else []
        self.qkv = [fuse_linears([a.q_proj, a.k_proj, a.v_proj]) for a in (layer.self_attn for layer in self.layers)]
        # The dense SwiGLU of each layer: its MLP, a mixture of experts' shared experts, or none (`dense_mlp`).
        self.dense_mlps = [dense_mlp(layer) for layer in self.layers]
        self.gate_up = [fuse_linears([m.gate_proj, m.up_proj]) if m is not None else None for m in self.dense_mlps]
        # Mixture-of-experts layers: their place among them (the column of `routed`) and the experts per token.
        self.moe_index = {index: j for j, index in enumerate(i for i, layer in enumerate(self.layers) if layer.is_moe)}
        moe = next((layer.mlp for layer in self.layers if layer.is_moe), None)
        embeddings = model.get_input_embeddings().weight
        self.device = embeddings.device
        positions = torch.arange(cache.max_len, device=self.device)[None]
        cos, sin = model.model.rotary_emb(embeddings[:1], positions)
        self.rotary_dim = cos.shape[-1]
        self.cos, self.sin = rotary_tables(cos[0], sin[0], self.head_dim)  # [max_len, head_dim], the model dtype
        # The decoding step reads its inputs from these buffers, so a captured graph sees each step's values.
        rows = cache.max_sequences
        self.tokens = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=self.device)
        # ... and writes each row's experts here: [slot, MoE layer, k] (router replay reads them after a step).
        top_k = moe.gate.top_k if moe is not None else 0
        self.routed = torch.zeros(rows, len(self.moe_index), top_k, dtype=torch.int16, device=self.device)
        self.compiled = compile
        # Per layer, the norms that follow its two residual additions in decoding: its own post-attention norm,
        # then the next layer's input norm (the final norm after the last layer).
        following = [layer.input_layernorm for layer in self.layers[1:]] + [model.model.norm]
        self.residual_norms = [(layer.post_attention_layernorm, after) for layer, after in zip(self.layers, following)]
        self.ops = DecodeOps.compiled() if compile else DecodeOps()
        self.paged = isinstance(cache, PagedKVCache)
        step = self._paged_decode_step if self.paged else self._decode_step
        self.graphs = DecodeGraphs(step) if cuda_graphs and self.device.type == "cuda" else None
        if self.paged:  # ... and, in the paged layout, where each row's key and value go and its blocks
            self.written = torch.zeros(rows, dtype=torch.long, device=self.device)
            self.block_table = torch.zeros(rows, cache.max_blocks, dtype=torch.int32, device=self.device)
        # CPU, float32: the larger linear weights reordered for oneDNN (a second copy), refreshed on updates.
        self.pack = PACKED_LINEAR is not None and self.device.type == "cpu" and embeddings.dtype == torch.float32
        self.packed: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        self._pack_weights()
        self.attention = decode_attention_kernel(attention, self.device, cache.keys.dtype)
        if self.paged:
            self.attention = paged_attention_kernel(attention, self.attention, self.graphs is not None)
        self.moe_kernel = moe_kernel_for(moe_kernel, self.device, cache.keys.dtype) if self.moe_index else None
        # Only the Triton kernel reads a row's prompt from another slot; the others need it in the row's own.
        self.shares_prompts = share_prompts and self.attention == "triton"
        # Per row: the slot holding its prompt and the positions read from there (0: its own slot only).
        self.prefix_slots = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.prefix_lens = torch.zeros(rows, dtype=torch.int32, device=self.device)
        # Flash attention's view of the batch: row i's `group` queries (`flash_decode`) start at i x group, its
        # keys at slot i's first position.
        slots = torch.arange(rows + 1, dtype=torch.int32, device=self.device)
        self.query_starts = slots * (self.num_heads // self.num_kv_heads)
        self.key_starts = slots * cache.max_len

    def warm_up(self) -> None:
        """Compile and capture now what the first requests would otherwise wait for: the compiled functions
        and the Triton kernels (one decoding step of one row, a few tiny prefills), and, for the Triton
        kernel's graphs (one per batch size, `_graph_context`), every graph. A toolchain that cannot compile
        then stops the server with the way out, instead of failing every request. All this writes keys and
        values of token 0 into the first free slots, which prefills overwrite."""
        if not self.compiled and self.attention != "triton":
            return
        if self.paged:
            self._warm_up_paged()
            return
        try:
            with torch.inference_mode():
                self._decode_step(1, 1)
                # Prefills of 1 and of 2 and 6 token rows: torch.compile specializes a single row, then makes
                # the row count dynamic on the second size, so no later prefill compiles again.
                for prompts in ([[0]], [[0, 0]], [[0, 0], [0, 0, 0]]):
                    if len(prompts) <= self.cache.num_slots and len(prompts[-1]) <= self.cache.max_len:
                        self.prefill(prompts, list(range(len(prompts))), 0)
                if self.graphs is not None and self.attention == "triton":
                    sizes = sorted(
                        {bucket(count, self.cache.num_slots) for count in range(1, self.cache.num_slots + 1)}
                    )
                    for batch in sizes:
                        self.graphs.run(batch, self.cache.max_len)
        except Exception as error:
            lines = str(error).strip().splitlines()
            raise AsyncRLError(
                f"the decoding step could not be compiled for this GPU ({type(error).__name__}: "
                f"{lines[0] if lines else 'no message'}); serve without compiling: inference.compile = false "
                "and inference.decode_attention = 'flash'"
            ) from error

    def _warm_up_paged(self) -> None:
        """`warm_up` for the paged layout: one decoding step and the same prefills, into the scratch block,
        and with CUDA graphs every batch size's graph."""
        scratch = [self.cache.scratch_block]
        try:
            with torch.inference_mode():
                self.decode_paged([0], [0], [scratch])
                for prompts in ([[0]], [[0, 0]], [[0, 0], [0, 0, 0]]):
                    if len(prompts) <= self.cache.max_sequences:
                        self.prefill_paged(prompts, [scratch] * len(prompts))
                if self.graphs is not None:
                    rows = self.cache.max_sequences
                    for batch in sorted({bucket(count, rows) for count in range(1, rows + 1)}):
                        self.decode_paged([0] * batch, [0] * batch, [scratch] * batch)
        except Exception as error:
            lines = str(error).strip().splitlines()
            raise AsyncRLError(
                f"the decoding step could not be compiled for this GPU ({type(error).__name__}: "
                f"{lines[0] if lines else 'no message'}); serve without compiling: inference.compile = false "
                "and inference.decode_attention = 'sdpa'"
            ) from error

    def weights_loaded(self) -> None:
        """Refresh what is derived from the weights after new ones were copied into the parameters; in place,
        so that captured CUDA graphs read the new values."""
        for scale, layer in zip(self.qk_scales, self.layers):
            scale.copy_(self._qk_scale(layer))
        self._pack_weights()

    def _pack_weights(self) -> None:
        if not self.pack:
            return
        weights = [weight for weight, _ in self.qkv + [fused for fused in self.gate_up if fused is not None]]
        weights += [layer.self_attn.o_proj.weight for layer in self.layers]
        weights += [mlp.down_proj.weight for mlp in self.dense_mlps if mlp is not None]
        weights.append(self.model.get_output_embeddings().weight)
        reorder = PACKED_LINEAR[0]
        self.packed = {
            (w.data_ptr(), tuple(w.shape)): reorder(w.detach(), PACKED_ROWS_HINT)
            for w in weights
            if w.numel() >= PACKED_MIN_WEIGHT
        }

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = self.packed.get((weight.data_ptr(), tuple(weight.shape))) if self.packed else None
        if packed is None:
            return F.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        return PACKED_LINEAR[1](rows, packed, bias, "none", [], "").view(*x.shape[:-1], weight.shape[0])

    def _layer_linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        return self._linear(x, layer.weight, layer.bias)

    def _qk_scale(self, layer: nn.Module) -> torch.Tensor:
        attention = layer.self_attn
        return torch.cat(
            (attention.q_norm.weight.expand(self.num_heads, -1), attention.k_norm.weight.expand(self.num_kv_heads, -1))
        )

    def prefill(
        self,
        prompts: list[list[int]],
        rows: list[int],
        first_slot: int,
        holders: list[bool] | None = None,
        routed_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run `prompts` and store their keys and values: slot `first_slot + j` gets prompt `rows[j]`, or
        with `holders` only the slots j where holders[j] (the others read their prompt from there).
        Returns the logits after each prompt's last token, [len(prompts), vocab]. With `routed_out` (a
        mixture-of-experts model), each prompt's experts [its length, MoE layers, k] are appended to it."""
        count = len(prompts)
        slots = slice(first_slot, first_slot + len(rows))
        gather = None if rows == list(range(count)) else torch.tensor(rows, device=self.device)
        if holders is not None and not all(holders):
            written = [j for j, holds in enumerate(holders) if holds]
            slots = torch.tensor([first_slot + j for j in written], device=self.device)
            gather = (
                None
                if [rows[j] for j in written] == list(range(count))
                else slots.new_tensor([rows[j] for j in written])
            )
        width = max(len(prompt) for prompt in prompts)

        def store(index: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.cache.keys[index, slots, :width] = k if gather is None else k[gather]
            self.cache.values[index, slots, :width] = v if gather is None else v[gather]

        return self._prefill(prompts, store, routed_out)

    def prefill_paged(
        self,
        prompts: list[list[int]],
        tables: list[list[int]],
        routed_out: list[torch.Tensor] | None = None,
        starts: list[int] | None = None,
    ) -> torch.Tensor:
        """`prefill` into the paged cache: prompt j's keys and values go to the blocks of table j (a prompt
        that samples share is written once, into the blocks they share). With `starts` (the prefix cache),
        prompt j's first starts[j] positions are in its blocks already: only the rest is computed, attending
        to them as well."""
        block_size = self.cache.block_size
        starts = starts or [0] * len(prompts)
        width = max(len(prompt) - start for prompt, start in zip(prompts, starts))
        offsets = torch.arange(width, device=self.device)
        start = torch.tensor(starts, device=self.device)[:, None]
        positions = start + offsets  # [prompts, width]
        real = torch.tensor([len(prompt) for prompt in prompts], device=self.device)[:, None] > positions
        blocks = max(-(-max(len(prompt) for prompt in prompts) // block_size), *(len(t) for t in tables))
        table = torch.tensor([t + [0] * (blocks - len(t)) for t in tables], dtype=torch.long, device=self.device)
        flat = table.gather(1, (positions // block_size).clamp(max=blocks - 1)) * block_size + positions % block_size
        written = flat[real]

        def store(index: int, k: torch.Tensor, v: torch.Tensor) -> None:
            keys, values = self.cache.flat(index)
            keys[written] = k[real]
            values[written] = v[real]

        attend = None
        if any(starts):
            # Each query attends to every position up to its own, the cached ones read back from the blocks
            # (after `store`, so the prompt's new keys are there too).
            span = torch.arange(max(len(prompt) for prompt in prompts), device=self.device)
            gathered = table[:, span // block_size] * block_size + span % block_size  # [prompts, context]
            visible = (span <= positions[:, :, None])[:, None]  # [prompts, 1, width, context]

            def attend(index: int, q: torch.Tensor) -> torch.Tensor:
                keys, values = self.cache.flat(index)
                k, v = keys[gathered].transpose(1, 2), values[gathered].transpose(1, 2)
                with sdpa_kernel(PREFILL_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)

        suffixes = [prompt[first:] for prompt, first in zip(prompts, starts)]
        return self._prefill(suffixes, store, routed_out, positions.clamp(max=self.cache.max_len - 1), attend)

    def _prefill(
        self,
        prompts: list[list[int]],
        store: Callable[[int, torch.Tensor, torch.Tensor], None],
        routed_out: list[torch.Tensor] | None,
        positions: torch.Tensor | None = None,
        attend: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The prompts' forward pass; `store(layer, k, v)` puts each layer's keys and values [prompts, width,
        kv heads, dim] into the cache. The prompts' tokens go through the layers as one [prompts x width]
        batch of rows, as decoding's rows do, so the same (compiled) elementwise functions serve both; only
        attention sees the prompts: causal over the prompts themselves, or `attend(layer, q)` (a prefix in
        the cache). `positions` [prompts, width]: each token's position (default: from 0)."""
        lengths = [len(prompt) for prompt in prompts]
        count, width = len(prompts), max(lengths)
        routed = self.routed.new_zeros(count * width, *self.routed.shape[1:]) if routed_out is not None else None
        input_ids = torch.tensor([prompt + [0] * (width - len(prompt)) for prompt in prompts]).to(self.device)
        if positions is None:
            positions = torch.arange(width, device=self.device).repeat(count)
        else:
            positions = positions.flatten()
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        x = F.embedding(input_ids.flatten(), self.model.get_input_embeddings().weight)  # [count x width, hidden]
        h = rms_norm(x, self.layers[0].input_layernorm)
        for index, layer in enumerate(self.layers):
            qkv = self._linear(h, *self.qkv[index])
            q, k, v = (  # [count, width, heads, dim]
                t.unflatten(0, (count, width))
                for t in self.ops.split_heads(
                    qkv, *self._qk_norm(index), cos, sin, self.num_heads, self.head_dim, self.rotary_dim
                )
            )
            store(index, k, v)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [count, heads, width, dim]
            if attend is not None:
                attention = attend(index, q)
            else:
                with sdpa_kernel(PREFILL_ATTENTION):
                    attention = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            delta = self._layer_linear(attention.transpose(1, 2).flatten(0, 1).flatten(1), layer.self_attn.o_proj)
            middle_norm, next_norm = self.residual_norms[index]
            x, h = self.ops.add_norm(x, delta, middle_norm.weight, middle_norm.variance_epsilon)
            x, h = self.ops.add_norm(x, self._mlp(h, index, routed), next_norm.weight, next_norm.variance_epsilon)
        if routed_out is not None:  # each prompt's tokens' experts, without the padding
            routed_out.extend(
                rows[:length] for rows, length in zip(routed.view(count, width, *routed.shape[1:]), lengths)
            )
        # h is the final norm's output; each prompt's last real token gives its logits.
        last = torch.tensor([row * width + length - 1 for row, length in enumerate(lengths)], device=self.device)
        return self._layer_linear(h[last], self.model.get_output_embeddings())

    def decode(
        self,
        tokens: list[int],
        positions: list[int],
        prefix_slots: list[int] | None = None,
        prefix_lens: list[int] | None = None,
    ) -> torch.Tensor:
        """Feed token i at position i of slot i, for the running slots [0, len(tokens)); returns the logits
        [len(tokens), vocab]. With `shares_prompts`, row i reads its first prefix_lens[i] positions from slot
        prefix_slots[i] (default: none, all from its own slot)."""
        count = len(tokens)
        context = max(positions) + 1
        batch = bucket(count, self.cache.num_slots) if self.graphs is not None else count
        # Padding rows decode token 0 at position 0 of free slots: harmless, the next prefill overwrites it.
        padding = [0] * (batch - count)
        rows = [tokens + padding, positions + padding]
        if self.shares_prompts:
            rows += [(prefix_slots or [0] * count) + padding, (prefix_lens or [0] * count) + padding]
        inputs = torch.tensor(rows)
        if self.device.type == "cuda":
            inputs = inputs.pin_memory()  # so that the copy does not wait for the device's queued work
        self.tokens[:batch].copy_(inputs[0], non_blocking=True)
        self.positions[:batch].copy_(inputs[1], non_blocking=True)
        if self.shares_prompts:
            self.prefix_slots[:batch].copy_(inputs[2], non_blocking=True)
            self.prefix_lens[:batch].copy_(inputs[3], non_blocking=True)
        return self._run_step(count, batch, context)

    def decode_next(self, tokens: torch.Tensor, context: int) -> torch.Tensor:
        """The next step of the batch the last `decode` or `decode_next` ran, fed from the device: row i's
        token `tokens[i]` goes one position past row i's last one. `context`: the new longest context."""
        count = tokens.shape[0]
        self.tokens[:count].copy_(tokens)
        self.positions[:count] += 1
        batch = bucket(count, self.cache.num_slots) if self.graphs is not None else count
        return self._run_step(count, batch, context)

    def decode_paged(
        self, tokens: list[int] | torch.Tensor, positions: list[int], tables: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Feed token i at position i of the sequence whose blocks are `tables[i]` (lists or int32 arrays, the
        block of that position already writable: `BlockTables.prepare_write`); returns the logits
        [len(tokens), vocab]. `tokens` may be on the device already (the tokens a step in flight samples,
        decoding one step ahead). With CUDA graphs the batch is padded to its bucket by rows of token 0 at
        position 0 of the scratch block."""
        count, block_size = len(positions), self.cache.block_size
        context = max(positions) + 1
        batch = bucket(count, self.cache.max_sequences) if self.graphs is not None else count
        blocks = -(-context // block_size)
        table = np.zeros((batch, blocks), dtype=np.int32)
        for row, blocks_of_row in enumerate(tables):
            table[row, : min(len(blocks_of_row), blocks)] = blocks_of_row[:blocks]
        table[count:, 0] = self.cache.scratch_block
        written = [int(t[p // block_size]) * block_size + p % block_size for t, p in zip(tables, positions)]
        padding = [0] * (batch - count)
        on_device = isinstance(tokens, torch.Tensor)
        inputs = torch.tensor(
            [
                [0] * batch if on_device else tokens + padding,
                positions + padding,
                written + [self.cache.scratch_block * block_size] * (batch - count),
            ]
        )
        table = torch.from_numpy(table)
        if self.device.type == "cuda":  # so that the copies do not wait for the device's queued work
            inputs, table = inputs.pin_memory(), table.pin_memory()
        if on_device:
            self.tokens[:count].copy_(tokens)
            self.tokens[count:batch].zero_()
        else:
            self.tokens[:batch].copy_(inputs[0], non_blocking=True)
        self.positions[:batch].copy_(inputs[1], non_blocking=True)
        self.written[:batch].copy_(inputs[2], non_blocking=True)
        self.block_table[:batch, :blocks].copy_(table, non_blocking=True)
        if self.graphs is not None:
            return self.graphs.run(batch, self.cache.max_len)[:count]
        return self._paged_decode_step(batch, context)

    def _paged_decode_step(self, batch: int, context: int) -> torch.Tensor:
        """`_decode_step` over the paged cache, on the input buffers: each row's key and value go to `written`
        (its position's place in the cache read as one run of positions), then attention reads the row's
        blocks through `block_table`: the Triton paged kernel (each row up to its own length, so a graph
        captured for the whole cache length serves every context), or sdpa over the blocks gathered into
        [batch, context] under a mask. Block-table entries past a row's length are never read."""
        tokens, positions, written = self.tokens[:batch], self.positions[:batch], self.written[:batch]
        table = self.block_table[:batch]
        block_size = self.cache.block_size
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        used = (positions + 1).to(torch.int32)
        if self.attention == "sdpa":
            span = torch.arange(context, device=self.device)
            gathered = table[:, span // block_size].long() * block_size + span % block_size  # [batch, context]
            mask = torch.zeros(batch, 1, 1, context, dtype=self.cos.dtype, device=self.device)
            mask.masked_fill_((span > positions[:, None])[:, None, None], float("-inf"))
        x = F.embedding(tokens, self.model.get_input_embeddings().weight)
        h = rms_norm(x, self.layers[0].input_layernorm)
        for index, layer in enumerate(self.layers):
            qkv = self._linear(h, *self.qkv[index])
            q, k, v = self.ops.split_heads(
                qkv, *self._qk_norm(index), cos, sin, self.num_heads, self.head_dim, self.rotary_dim
            )
            keys, values = self.cache.flat(index)
            keys[written] = k
            values[written] = v
            if self.attention == "triton":
                attention = paged_decode_attention(
                    q.contiguous(), self.cache.keys[index], self.cache.values[index], table, used, context
                )
            else:
                attention = self._masked_decode(q, keys[gathered], values[gathered], batch, context, mask)
            delta = self._layer_linear(attention.reshape(batch, -1), layer.self_attn.o_proj)
            middle_norm, next_norm = self.residual_norms[index]
            x, h = self.ops.add_norm(x, delta, middle_norm.weight, middle_norm.variance_epsilon)
            x, h = self.ops.add_norm(
                x, self._mlp(h, index, self.routed[:batch]), next_norm.weight, next_norm.variance_epsilon
            )
        return self._layer_linear(h, self.model.get_output_embeddings())

    def _run_step(self, count: int, batch: int, context: int) -> torch.Tensor:
        if self.graphs is not None:
            return self.graphs.run(batch, self._graph_context(context))[:count]
        return self._decode_step(batch, context)

    def _graph_context(self, context: int) -> int:
        """The context a CUDA graph is captured for. The Triton kernel reads each row up to its own length
        whatever the bound, so its graphs take the cache's whole length and one graph per batch size serves
        every context (`warm_up` captures them all); the other kernels size their work by the bound, so
        their graphs go by context buckets, captured on first use."""
        return self.cache.max_len if self.attention == "triton" else bucket(context, self.cache.max_len)

    def _decode_step(self, batch: int, context: int) -> torch.Tensor:
        tokens, positions = self.tokens[:batch], self.positions[:batch]
        if self.attention != "triton":  # the triton path's `decode_heads` gathers and writes by position itself
            rows = torch.arange(batch, device=self.device)
            cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        if self.attention != "sdpa":
            used = (positions + 1).to(torch.int32)  # row i attends to positions 0..positions[i] of its slot
        else:
            # The same as an additive mask over the batch's longest context, made once per step.
            hidden = torch.arange(context, device=self.device) > positions[:, None]
            mask = torch.zeros(batch, 1, 1, context, dtype=self.cos.dtype, device=self.device)
            mask.masked_fill_(hidden[:, None, None], float("-inf"))
        x = F.embedding(tokens, self.model.get_input_embeddings().weight)
        h = rms_norm(x, self.layers[0].input_layernorm)
        for index, layer in enumerate(self.layers):
            qkv = self._linear(h, *self.qkv[index])
            keys, values = self.cache.keys[index], self.cache.values[index]
            if self.attention == "triton":
                # One kernel: q/k norms, rotary at each row's position, k and v written into the cache.
                norm = self._qk_norm(index)
                q = decode_heads(
                    qkv, *norm, self.cos, self.sin, positions, keys, values, self.num_heads, self.rotary_dim
                )
                prefix = {}
                if self.shares_prompts:
                    prefix = {"prefix_slots": self.prefix_slots[:batch], "prefix_lens": self.prefix_lens[:batch]}
                attention = decode_attention(q, keys, values, used, context, **prefix)
            else:
                q, k, v = self.ops.split_heads(
                    qkv, *self._qk_norm(index), cos, sin, self.num_heads, self.head_dim, self.rotary_dim
                )
                keys[rows, positions] = k
                values[rows, positions] = v
                if self.attention == "flash":
                    starts = self.query_starts[: batch + 1], self.key_starts[: batch + 1]
                    attention = flash_decode(q, keys, values, used, context, *starts)
                else:
                    attention = self._masked_decode(q, keys, values, batch, context, mask)
            delta = self._layer_linear(attention.reshape(batch, -1), layer.self_attn.o_proj)
            middle_norm, next_norm = self.residual_norms[index]
            x, h = self.ops.add_norm(x, delta, middle_norm.weight, middle_norm.variance_epsilon)
            x, h = self.ops.add_norm(
                x, self._mlp(h, index, self.routed[:batch]), next_norm.weight, next_norm.variance_epsilon
            )
        return self._layer_linear(h, self.model.get_output_embeddings())

    def _mlp(self, h: torch.Tensor, index: int, routed: torch.Tensor | None) -> torch.Tensor:
        """Layer `index`'s MLP on rows h [rows, hidden]: its SwiGLU, or its router and grouped experts (the
        family's own, `models/moe.py`) plus its shared experts; each row's experts go to `routed[:, j]`."""
        layer, fused = self.layers[index], self.gate_up[index]
        dense = None
        if fused is not None:
            dense = self._layer_linear(self.ops.swiglu(self._linear(h, *fused)), self.dense_mlps[index].down_proj)
        if not layer.is_moe:
            return dense
        moe = layer.mlp
        routing = moe.gate(h)
        if routed is not None:
            routed[:, self.moe_index[index]] = routing.indices
        if self.moe_kernel == "triton" and h.shape[0] <= FUSED_EXPERTS_MAX_ROWS:
            out = fused_experts(h, routing.indices, routing.weights, moe.experts.gate_up_proj, moe.experts.down_proj)
        else:
            out = moe.experts(h, routing, expert_counts(routing.indices, moe.experts.num_experts))
        return out if dense is None else out + dense

    def _masked_decode(self, q, keys, values, batch: int, context: int, mask: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention without repeating keys: the `group` query heads that share a KV head are
        that head's queries. [batch, kv heads, group, dim] against [batch, kv heads, context, dim]."""
        group = self.num_heads // self.num_kv_heads
        with sdpa_kernel(DECODE_ATTENTION):
            return F.scaled_dot_product_attention(
                q.view(batch, self.num_kv_heads, group, self.head_dim),
                keys[:batch, :context].transpose(1, 2),
                values[:batch, :context].transpose(1, 2),
                attn_mask=mask,
            )

    def _qk_norm(self, index: int) -> tuple[torch.Tensor | None, float]:
        """Layer `index`'s q/k norm weights (one row per head) and epsilon; None where the model has none."""
        if not self.qk_norm:
            return None, 0.0
        return self.qk_scales[index], self.layers[index].self_attn.q_norm.variance_epsilon
