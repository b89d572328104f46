"""Document-masked attention: a packed row gives each sample exactly what it gets alone, gradients too."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.config.schema import PerfConfig
from asyncrl.models import init_model
from asyncrl.trainer.attention import DOCUMENT_ATTENTION, Documents
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
