from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.models.offline import init_model


def test_model_init_round_trips_through_hugging_face(tmp_path):
    count = init_model(tmp_path / "m", "tiny")
    assert 50_000 < count < 200_000
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>"


def test_byte_level_tokenizer_round_trips_any_text(tmp_path):
    init_model(tmp_path / "m", "tiny")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    for text in ["hello world", "  spaces\tand\nnewlines ", "ünïcödé — 漢字 🙂", ""]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode("abc", add_special_tokens=False)) == 3


def test_chat_template_is_chatml_and_extends_the_prompt(tmp_path):
    init_model(tmp_path / "m", "tiny")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    messages = [{"role": "user", "content": "abc"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n"
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    full_ids = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": "cba"}], tokenize=True, return_dict=False
    )
    assert full_ids[: len(prompt_ids)] == prompt_ids
    assert tokenizer.decode(full_ids[len(prompt_ids) :]) == "cba<|im_end|>\n"


def test_llama_architecture_loads_and_keeps_packed_samples_apart(tmp_path):
    import torch

    from asyncrl.config.schema import ModelConfig
    from asyncrl.loading import load_model

    init_model(tmp_path / "m", "tiny", architecture="llama")
    model = load_model(ModelConfig(name=str(tmp_path / "m")))
    assert type(model).__name__ == "LlamaForCausalLM"
    a, b = [5, 6, 7, 8], [9, 10, 11]
    with torch.no_grad():
        packed = model(
            input_ids=torch.tensor([a + b]), position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2]]), use_cache=False
        ).logits[0]
        alone = model(input_ids=torch.tensor([b]), use_cache=False).logits[0]
    assert torch.allclose(packed[4:], alone, atol=1e-5)
