"""The engine's own forward passes against Hugging Face's (slots and paged KV caches), and the padding CUDA
graphs add."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from asyncrl.errors import AsyncRLError
from asyncrl.inference.engine import model_runner
from asyncrl.inference.engine.kv_cache import KVCache
from asyncrl.inference.engine.model_runner import (
    ModelRunner,
    check_supported,
    decode_attention_kernel,
    paged_attention_kernel,
)
from asyncrl.inference.engine.paged_cache import PagedKVCache
from asyncrl.models.offline import init_model

PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [40, 41, 42]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("runner") / "tiny"
    init_model(path, "tiny", seed=3)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def runner_for(model, num_slots: int = 8, max_len: int = 32, compile: bool = False) -> ModelRunner:
    config = model.config
    cache = KVCache(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, num_slots, max_len,
                    torch.float32, torch.device("cpu"))  # fmt: skip
    return ModelRunner(model, cache, cuda_graphs=False, compile=compile)


def last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@torch.inference_mode()
def test_prefill_and_decode_match_the_hugging_face_forward(model, compile):
    """Compiled: the decoding step's elementwise work fused by torch.compile, as on GPUs (here on CPU)."""
    runner = runner_for(model, compile=compile)
    # Slots 0-1 share prompt 0 (two samples of one request), slot 2 gets prompt 2, slot 3 prompt 1.
    logits = runner.prefill(PROMPTS, rows=[0, 0, 2, 1], first_slot=0)
    for prompt, row in zip(PROMPTS, logits):
        assert torch.allclose(row, last_logits(model, prompt), atol=1e-5)
    next_tokens = [11, 12, 13, 14]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    decoded = runner.decode(next_tokens, [len(p) for p in prompts])
    for prompt, token, row in zip(prompts, next_tokens, decoded):
        assert torch.allclose(row, last_logits(model, prompt + [token]), atol=1e-5)
    # A second step with fewer rows (a new batch size: compiled again, with a dynamic batch dimension).
    [first, second] = runner.decode([21, 22], [len(prompts[0]) + 1] * 2)
    assert torch.allclose(first, last_logits(model, prompts[0] + [11, 21]), atol=1e-5)
    assert torch.allclose(second, last_logits(model, prompts[1] + [12, 22]), atol=1e-5)


@torch.inference_mode()
def test_decoding_with_weights_packed_for_onednn_matches_the_hugging_face_forward(tmp_path):
    """Weights this large are reordered for oneDNN on a float32 CPU (`PACKED_MIN_WEIGHT`); the products
    must stay those of the model, also after new weights are copied in."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=300,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    runner = runner_for(model)
    if not runner.pack:
        pytest.skip("this torch has no oneDNN linear ops")
    assert len(runner.packed) == 4  # q/k/v, gate/up, o_proj, down_proj (the LM head is below the size)
    runner.prefill(PROMPTS, rows=[0, 1, 2], first_slot=0)
    decoded = runner.decode([11, 12, 13], [len(p) for p in PROMPTS])
    for prompt, token, row in zip(PROMPTS, [11, 12, 13], decoded):
        assert torch.allclose(row, last_logits(model, prompt + [token]), atol=1e-4)

    model.model.layers[0].mlp.down_proj.weight.mul_(0.5)  # an in-place update, as the engine's load does
    runner.weights_loaded()
    runner.prefill(PROMPTS, rows=[0, 1, 2], first_slot=0)
    decoded = runner.decode([11, 12, 13], [len(p) for p in PROMPTS])
    assert torch.allclose(decoded[0], last_logits(model, PROMPTS[0] + [11]), atol=1e-4)


@torch.inference_mode()
def test_padding_the_batch_and_context_as_cuda_graphs_do_changes_no_logits(model):
    runner = runner_for(model)
    runner.prefill(PROMPTS, rows=[0, 1, 2], first_slot=0)
    tokens, positions = [11, 12, 13], [len(p) for p in PROMPTS]
    exact = runner.decode(tokens, positions).clone()
    runner.tokens[:8] = torch.tensor(tokens + [0] * 5)
    runner.positions[:8] = torch.tensor(positions + [0] * 5)
    padded = runner._decode_step(batch=8, context=32)  # what the graph of bucket (8, 32) computes
    assert torch.allclose(padded[:3], exact, atol=1e-6)


@torch.inference_mode()
def test_a_moved_slot_decodes_as_before(model):
    runner = runner_for(model)
    runner.prefill(PROMPTS, rows=[0, 1, 2], first_slot=0)
    runner.cache.move(source=2, target=0, length=len(PROMPTS[2]))
    [row] = runner.decode([13], [len(PROMPTS[2])])
    assert torch.allclose(row, last_logits(model, PROMPTS[2] + [13]), atol=1e-5)


def paged_runner_for(model, num_blocks: int = 16, block_size: int = 2, max_len: int = 32) -> ModelRunner:
    config = model.config
    cache = PagedKVCache(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, num_blocks,
                         block_size, max_len, 8, torch.float32, torch.device("cpu"))  # fmt: skip
    return ModelRunner(model, cache, cuda_graphs=False)


@torch.inference_mode()
def test_paged_prefill_and_decode_give_the_logits_of_the_slots_layout(model):
    """Rows 0 and 1 share prompt 0's blocks (two samples of one request), their last block partly filled;
    row 0 writes its token into a copy of that block (copy-on-write), row 1 into the original. Blocks are
    scattered through the pool; sdpa over the gathered blocks gives the slots layout's logits exactly."""
    slots, paged = runner_for(model), paged_runner_for(model)
    expected_prefill = slots.prefill(PROMPTS, rows=[0, 0, 2, 1], first_slot=0)
    # Prompt 0 (5 tokens) in blocks 9, 3, 12; prompt 1 (2 tokens) in 5; prompt 2 (3 tokens) in 0, 7.
    prefill = paged.prefill_paged(PROMPTS, [[9, 3, 12], [5], [0, 7]])
    assert torch.equal(prefill, expected_prefill)
    paged.cache.copy_block(12, 14)
    tables = [[9, 3, 14], [9, 3, 12], [0, 7], [5, 1]]  # prompt 1's next token starts block 1
    next_tokens = [11, 12, 13, 14]
    positions = [5, 5, 3, 2]
    expected = slots.decode(next_tokens, positions)
    decoded = paged.decode_paged(next_tokens, positions, tables)
    assert torch.equal(decoded, expected)
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    for prompt, token, row in zip(prompts, next_tokens, decoded):
        assert torch.allclose(row, last_logits(model, prompt + [token]), atol=1e-5)
    tables[0].append(2)
    tables[1].append(13)
    [first, second] = paged.decode_paged([21, 22], [6, 6], tables[:2])
    assert torch.allclose(first, last_logits(model, PROMPTS[0] + [11, 21]), atol=1e-5)
    assert torch.allclose(second, last_logits(model, PROMPTS[0] + [12, 22]), atol=1e-5)


@torch.inference_mode()
def test_a_paged_batch_padded_to_its_graphs_size_decodes_as_before_and_pads_into_the_scratch_block(model):
    """What a captured graph computes: the batch padded to its bucket (3 -> 4 rows) at the whole cache's
    length; the padding row writes only the scratch block, so every block a sequence may hold is as the
    unpadded step left it."""
    exact_runner, padded_runner = paged_runner_for(model), paged_runner_for(model)
    tables = [[9, 3, 12], [5, 1], [0, 7]]
    for runner in (exact_runner, padded_runner):
        runner.prefill_paged(PROMPTS, [tables[0], tables[1][:1], tables[2]])
    tokens, positions = [11, 12, 13], [5, 2, 3]
    exact = exact_runner.decode_paged(tokens, positions, tables)
    padded_runner.graphs = SimpleNamespace(run=padded_runner._paged_decode_step)  # a graph's work, eagerly
    padded = padded_runner.decode_paged(tokens, [5, 2, 3], [np.array(t, dtype=np.int32) for t in tables])
    assert torch.allclose(padded, exact, atol=1e-6)
    scratch = padded_runner.cache.scratch_block
    assert torch.allclose(padded_runner.cache.keys[:, :scratch], exact_runner.cache.keys[:, :scratch], atol=1e-6)
    assert padded_runner.cache.keys[:, scratch].abs().sum() > 0 == exact_runner.cache.keys[:, scratch].abs().sum()


def test_what_cannot_read_paged_blocks_yet_is_refused_with_the_fix():
    with pytest.raises(AsyncRLError, match="only with the Triton paged kernel.*cuda_graphs = false"):
        paged_attention_kernel("sdpa", "sdpa", cuda_graphs=True)
    with pytest.raises(AsyncRLError, match="cuda_graphs = false"):
        paged_attention_kernel("auto", "flash", cuda_graphs=True)  # a GPU without triton
    assert paged_attention_kernel("auto", "triton", cuda_graphs=True) == "triton"
    with pytest.raises(AsyncRLError, match="'flash' reads contiguous slots"):
        paged_attention_kernel("flash", "flash", cuda_graphs=False)
    assert paged_attention_kernel("auto", "flash", cuda_graphs=False) == "sdpa"  # a GPU without triton
    assert paged_attention_kernel("auto", "triton", cuda_graphs=False) == "triton"


def test_an_unsupported_architecture_is_refused_with_the_fix(model):
    config = model.config.__class__(**{**model.config.to_dict(), "hidden_act": "gelu"})
    with pytest.raises(AsyncRLError, match="activation is 'gelu'.*vLLM"):
        check_supported(config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU decoding kernels and CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("attention", ["triton", "flash"])
@torch.inference_mode()
def test_gpu_decoding_kernels_match_masked_attention(attention):
    """The GPU path (bf16: a kernel reading each slot to its own length, grouped query heads; compiled; CUDA
    graphs) against the masked attention path of the same runner."""
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).eval()
    cache = KVCache(2, 2, 64, 8, 32, torch.bfloat16, torch.device("cuda"))
    runner = ModelRunner(model, cache, cuda_graphs=True, compile=True, attention=attention)
    runner.prefill(PROMPTS, rows=[0, 1, 2], first_slot=0)
    tokens, positions = [11, 12, 13], [len(p) for p in PROMPTS]
    fast = runner.decode(tokens, positions).float()
    runner.attention = "sdpa"  # the same step through the masked path, eager
    runner.graphs = None
    masked = runner.decode(tokens, positions).float()
    assert (fast - masked).abs().max() < 0.02 * masked.abs().max()
    assert (fast.argmax(-1) == masked.argmax(-1)).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU decoding kernels and CUDA graphs need a CUDA GPU")
@torch.inference_mode()
def test_gpu_paged_decoding_in_cuda_graphs_matches_masked_attention():
    """The paged GPU path (bf16, the Triton paged kernel, compiled, CUDA graphs of padded batches) against
    the eager masked path over the gathered blocks of the same runner, blocks scattered through the pool."""
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).eval()
    cache = PagedKVCache(2, 2, 64, 16, 2, 32, 8, torch.bfloat16, torch.device("cuda"))
    runner = ModelRunner(model, cache, cuda_graphs=True, compile=True)
    assert runner.attention == "triton"
    runner.warm_up()
    tables = [[9, 3, 12], [5, 1], [0, 7]]
    runner.prefill_paged(PROMPTS, [tables[0], tables[1][:1], tables[2]])
    tokens, positions = [11, 12, 13], [5, 2, 3]
    fast = runner.decode_paged(tokens, positions, tables).float()
    runner.attention = "sdpa"  # the same step through the masked path, eager
    runner.graphs = None
    masked = runner.decode_paged(tokens, positions, tables).float()
    assert (fast - masked).abs().max() < 0.02 * masked.abs().max()
    assert (fast.argmax(-1) == masked.argmax(-1)).all()


def test_a_decoding_kernel_the_device_lacks_is_refused_with_the_fix():
    with pytest.raises(AsyncRLError, match="decode_attention = 'flash' needs a CUDA GPU.*use 'auto'"):
        decode_attention_kernel("flash", torch.device("cpu"), torch.float32)
    assert decode_attention_kernel("auto", torch.device("cpu"), torch.bfloat16) == "sdpa"


def test_triton_asked_for_by_name_serves_a_float32_model_on_a_gpu_and_auto_leaves_it_to_sdpa(monkeypatch):
    monkeypatch.setattr(model_runner, "TRITON_DECODE", True)
    monkeypatch.setattr(model_runner, "INTERPRETED", False)
    gpu = torch.device("cuda")  # only named: the choice reads the device's type
    assert decode_attention_kernel("triton", gpu, torch.float32) == "triton"
    assert decode_attention_kernel("auto", gpu, torch.float32) == "sdpa"
    with pytest.raises(AsyncRLError, match="decode_attention = 'triton' needs a CUDA GPU and triton.*use 'auto'"):
        decode_attention_kernel("triton", torch.device("cpu"), torch.float32)


def emulated_flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, seqused_k):
    """torch's varlen flash attention forward as the engine calls it (not causal, `seqused_k`), on CPU."""
    assert not causal and dropout == 0.0
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        queries = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)  # [heads, queries, dim]
        start = int(cu_k[i])
        keys = k[start : start + int(seqused_k[i])].transpose(0, 1)
        values = v[start : start + int(seqused_k[i])].transpose(0, 1)
        out[cu_q[i] : cu_q[i + 1]] = F.scaled_dot_product_attention(queries, keys, values).transpose(0, 1)
    return (out,)


@torch.inference_mode()
def test_flash_decoding_packs_grouped_query_heads_as_their_kv_heads_queries(monkeypatch):
    """The "flash" path's layout (a KV head's query heads as its queries, rows' keys at their slots) checked
    on CPU against the masked path, with flash attention's forward emulated."""
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    monkeypatch.setattr(model_runner, "FLASH_DECODE", emulated_flash_forward)
    runner = runner_for(model)
    runner.prefill(PROMPTS, rows=[0, 1, 2], first_slot=0)
    tokens, positions = [11, 12, 13], [len(p) for p in PROMPTS]
    masked = runner.decode(tokens, positions).clone()
    runner.attention = "flash"
    assert torch.allclose(runner.decode(tokens, positions), masked, atol=1e-5)


def test_a_decoding_step_that_cannot_compile_stops_the_start_with_the_way_out(model):
    """As on a GPU whose toolchain cannot build the compiled kernels: `warm_up` (run when the engine starts)
    names the settings that serve without them."""
    runner = runner_for(model)

    def fails_to_compile(*_):
        raise RuntimeError("backend compiler failed\n(a long inductor traceback)")

    runner.compiled = True
    runner.ops = runner.ops._replace(add_norm=fails_to_compile)
    with pytest.raises(AsyncRLError, match=r"could not be compiled .*RuntimeError: backend compiler failed\); "
                       r"serve without compiling: inference.compile = false"):  # fmt: skip
        runner.warm_up()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU decoding kernels and CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("architecture", ["qwen3_moe", "glm4_moe"])
@torch.inference_mode()
def test_gpu_mixture_of_experts_decoding_matches_the_eager_path(tmp_path, architecture):
    """Router and grouped experts captured in CUDA graphs (bf16, Triton heads with GLM's partial rotary) against
    the same runner's eager masked path; and the experts the captured step records are those it routed to."""
    from asyncrl.models.checkpoint import load_native

    init_model(tmp_path / "moe", "tiny", seed=2, architecture=architecture)
    model = load_native(str(tmp_path / "moe"), "cuda", torch.bfloat16).eval()
    config = model.config
    cache = KVCache(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 8, 32, torch.bfloat16,
                    torch.device("cuda"))  # fmt: skip
    runner = ModelRunner(model, cache, cuda_graphs=True, compile=True, attention="auto")
    runner.warm_up()
    runner.prefill(PROMPTS, rows=[0, 1, 2], first_slot=0)
    tokens, positions = [11, 12, 13], [len(p) for p in PROMPTS]
    fast = runner.decode(tokens, positions).float()
    routed = runner.routed[:3].clone()
    runner.attention, runner.graphs = "sdpa", None
    runner.routed.zero_()
    masked = runner.decode(tokens, positions).float()
    assert (fast - masked).abs().max() < 0.02 * masked.abs().max()
    assert (fast.argmax(-1) == masked.argmax(-1)).all()
    assert torch.equal(routed.sort(-1).values, runner.routed[:3].sort(-1).values)
