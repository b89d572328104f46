"""Document-masked attention: a packed row gives each sample exactly what it gets alone, gradients too; which
kernel runs which row."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from asyncrl.config.schema import PerfConfig
from asyncrl.errors import AsyncRLError
from asyncrl.models.offline import init_model
from asyncrl.trainer.attention import (
    CUDNN_MIN_TOKENS,
    DOCUMENT_ATTENTION,
    AttentionKernels,
    Documents,
    choose_kernels,
    cudnn_attention_problem,
    document_attention,
)
from asyncrl.trainer.logprobs import compute_logprobs, token_logprobs
from asyncrl.trainer.model import prepare_model

LENGTHS = [9, 14, 5, 20]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def plain_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    init_model(path, "tiny", architecture=request.param)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def packed_row(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 259, (sum(LENGTHS),), generator=generator)
    return input_ids, torch.cat([torch.arange(n) for n in LENGTHS])


def test_documents_are_read_from_where_positions_restart():
    documents = Documents.from_position_ids(torch.cat([torch.arange(n) for n in LENGTHS]))
    assert documents.cu_seqlens.tolist() == [0, 9, 23, 28, 48]
    assert documents.lengths == LENGTHS
    assert documents.padded_longest == 32


def test_packed_row_logprobs_and_gradients_equal_each_sample_run_alone(plain_model):
    model = prepare_model(copy.deepcopy(plain_model), PerfConfig(attention="document"))
    assert model.config._attn_implementation == DOCUMENT_ATTENTION
    input_ids, position_ids = packed_row()
    temperature = torch.full((sum(LENGTHS),), 0.9)
    packed, packed_entropy = compute_logprobs(model, input_ids, position_ids, temperature, chunk_size=16)
    first_of_sample = position_ids == 0
    packed.masked_fill(first_of_sample, 0.0).sum().backward()

    alone, alone_entropy = [], []
    for ids in input_ids.split(LENGTHS):
        logprobs, entropy = token_logprobs(plain_model(input_ids=ids[None], use_cache=False).logits[0], ids, 0.9)
        alone.append(logprobs)
        alone_entropy.append(entropy)
    alone, alone_entropy = torch.cat(alone), torch.cat(alone_entropy)
    alone.sum().backward()

    keep = ~first_of_sample
    torch.testing.assert_close(packed[keep], alone[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_entropy[keep], alone_entropy[keep], rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), plain_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_dense_attention_gives_the_same_logprobs(plain_model):
    document = prepare_model(copy.deepcopy(plain_model), PerfConfig(attention="document"))
    dense = prepare_model(copy.deepcopy(plain_model), PerfConfig(attention="dense"))
    input_ids, position_ids = packed_row(seed=1)
    with torch.no_grad():
        a, _ = compute_logprobs(document, input_ids, position_ids)
        b, _ = compute_logprobs(dense, input_ids, position_ids)
    keep = position_ids != 0
    torch.testing.assert_close(a[keep], b[keep], rtol=1e-5, atol=1e-5)


def test_calling_the_model_without_document_boundaries_names_the_fix(plain_model):
    model = prepare_model(copy.deepcopy(plain_model), PerfConfig(attention="document"))
    with pytest.raises(ValueError, match="attention_kwargs"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


# ---- which kernel runs which row ----


def test_auto_takes_cudnn_for_long_one_document_rows_and_varlen_for_packed_rows_on_a_gpu():
    kernels = choose_kernels("auto", on_cuda=True, varlen=True, cudnn_problem=None)
    assert kernels.for_row([65536]) == "cudnn"
    assert kernels.for_row([CUDNN_MIN_TOKENS]) == "cudnn"
    assert kernels.for_row([CUDNN_MIN_TOKENS - 1]) == "varlen"  # short rows of new lengths would pay planning
    assert kernels.for_row([32768, 32768]) == "varlen"  # cuDNN's fast path has no document mask
    assert choose_kernels("auto", True, varlen=False, cudnn_problem=None).for_row([1000, 24]) == "flex"


def test_auto_falls_back_to_flash_with_one_warning_when_cudnn_fails_its_check(caplog):
    with caplog.at_level(logging.WARNING, logger="asyncrl.trainer.attention"):
        kernels = choose_kernels("auto", True, True, cudnn_problem="RuntimeError: no execution plan")
    assert kernels == AttentionKernels("varlen", "varlen")
    assert [r.getMessage() for r in caplog.records] == [
        "cuDNN attention is not used (RuntimeError: no execution plan); one-document rows take varlen"
    ]


def test_forced_kernels_and_the_cpu():
    assert choose_kernels("auto", on_cuda=False, varlen=True, cudnn_problem="x") == AttentionKernels("sdpa", "sdpa")
    assert choose_kernels("sdpa", True, True, None) == AttentionKernels("sdpa", "sdpa")
    assert choose_kernels("flash", True, True, None) == AttentionKernels("varlen", "varlen")
    assert choose_kernels("flex", True, True, None) == AttentionKernels("flex", "flex")
    forced = choose_kernels("cudnn", True, True, None)
    assert forced.for_row([100]) == "cudnn" and forced.for_row([60, 40]) == "varlen"


@pytest.mark.parametrize(
    "choice, on_cuda, varlen, problem, fix",
    [
        ("cudnn", False, True, None, "needs a CUDA GPU"),
        ("flash", False, True, None, "needs a CUDA GPU"),
        ("cudnn", True, True, "RuntimeError: boom", "cannot serve this model .RuntimeError: boom. .use 'auto'"),
        ("flash", True, False, None, "varlen flash attention .torch >= 2.11; use 'auto'"),
    ],
)
def test_a_kernel_the_device_cannot_run_is_one_error_naming_the_fix(choice, on_cuda, varlen, problem, fix):
    with pytest.raises(AsyncRLError, match=fix):
        choose_kernels(choice, on_cuda, varlen, problem)


def test_the_cudnn_check_answers_why_not_off_cuda():
    assert cudnn_attention_problem(torch.device("cpu"), 4, 2, 32) == "not a CUDA device"


def test_a_model_prepared_on_the_cpu_attends_per_sample(plain_model):
    model = prepare_model(copy.deepcopy(plain_model), PerfConfig(attention_kernel="auto"))
    assert model.attention_kernels == AttentionKernels("sdpa", "sdpa")
    with pytest.raises(AsyncRLError, match="needs a CUDA GPU"):
        prepare_model(copy.deepcopy(plain_model), PerfConfig(attention_kernel="cudnn"))


def grouped_query_row(tokens: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(3)
    shapes = [(1, 4, tokens, 32), (1, 2, tokens, 32), (1, 2, tokens, 32)]
    return [torch.randn(*shape, generator=generator).to(dtype).requires_grad_() for shape in shapes]


def attention_and_grads(kernel: str, dtype: torch.dtype, tokens: int = 67) -> list[torch.Tensor]:
    q, k, v = grouped_query_row(tokens, dtype)
    documents = Documents.from_position_ids(torch.arange(tokens), kernel=kernel)
    out, _ = document_attention(None, q, k, v, None, scaling=0.2, documents=documents)
    out.float().square().sum().backward()
    return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]


def test_the_one_document_path_is_causal_grouped_query_attention_over_the_row():
    """In half precision the "cudnn" kernel is torch's scaled-dot-product attention, cuDNN first (on a CPU
    torch's own flash kernel runs it): same values and gradients as float32 attention, within bf16 rounding."""
    reference = attention_and_grads("sdpa", torch.float32)
    for fused, exact in zip(attention_and_grads("cudnn", torch.bfloat16), reference):
        assert float((fused - exact).norm() / exact.norm()) < 1e-2


def test_float32_rows_take_per_sample_attention_whatever_the_kernel():
    """cuDNN and flash take half precision only: a float32 row falls back to exact per-sample attention."""
    for fallback, exact in zip(attention_and_grads("cudnn", torch.float32), attention_and_grads("sdpa", torch.float32)):
        torch.testing.assert_close(fallback, exact, rtol=0, atol=0)
    q, k, v = grouped_query_row(67, torch.float32)
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=True).transpose(1, 2)
    out, _ = document_attention(
        None, q, k, v, None, scaling=0.2, documents=Documents.from_position_ids(torch.arange(67))
    )
    torch.testing.assert_close(out, plain)


def test_the_one_document_path_traces_into_a_compiled_layer_without_a_graph_break():
    """`perf.compile` compiles each decoder layer around the attention call; the kernel choice (a context
    manager) must trace, or the layer would fall apart into pieces."""
    q, k, v = grouped_query_row(37, torch.bfloat16)
    documents = Documents.from_position_ids(torch.arange(37), kernel="cudnn")

    def layer_attention(q, k, v):
        return document_attention(None, q, k, v, None, scaling=0.2, documents=documents)[0]

    compiled = torch.compile(layer_attention, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), layer_attention(q, k, v))
