"""Schema-constrained JSON generation from chat prompts: a local HF model or an OpenAI server.

Every call blocks; callers run it in a thread executor. A prompt whose output is not a JSON object
valid for the schema yields None, never an exception.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch
from jsonschema.validators import validator_for
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]


class JsonGenerator(Protocol):
    def generate(self, prompts: list[Messages], schema: dict,
                 max_tokens: int = 256) -> list[dict | None]:
        """One JSON object per prompt (a list of chat messages {"role","content"}), valid for
        `schema`; None for a prompt whose output could not be parsed as such (never raises for
        one bad output)."""
        ...


def parse_object(text: str, schema: dict) -> dict | None:
    """``text`` as a JSON object valid for ``schema``, else None."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return None
    if not isinstance(value, dict) or not validator_for(schema)(schema).is_valid(value):
        return None
    return value


class LocalJsonGenerator:
    """Greedy, batched decoding with a HF causal LM, constrained by an xgrammar JSON grammar."""

    def __init__(self, model_path: Path, device: str | None = None,
                 dtype: torch.dtype | None = None):
        """``dtype`` defaults to float32 on CPU and to the model's own dtype elsewhere."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or (torch.float32 if torch.device(device).type == "cpu" else "auto")
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                     local_files_only=True)
        self._setup(model.to(device).eval(), tokenizer)

    @classmethod
    def from_loaded(cls, model: Any, tokenizer: Any,
                    lock: threading.Lock | None = None) -> LocalJsonGenerator:
        """Share a model and tokenizer that are already loaded (e.g. the encoder's), and the
        ``lock`` that keeps its other users' forward passes apart from ours."""
        self = cls.__new__(cls)
        self._setup(model, tokenizer, lock)
        return self

    def _setup(self, model: Any, tokenizer: Any, lock: threading.Lock | None = None) -> None:
        import xgrammar as xgr

        self.model, self.tokenizer = model, tokenizer
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = eos if isinstance(eos, list) else [eos]
        self.stop_ids = sorted({t for t in [*eos, tokenizer.eos_token_id] if t is not None})
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_ids[0]
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_ids)
        self.compiler = xgr.GrammarCompiler(info)  # caches compiled schemas
        self._lock = lock or threading.Lock()

    def _encode(self, messages: Messages) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompts: list[Messages], schema: dict,
                 max_tokens: int = 256) -> list[dict | None]:
        if not prompts:
            return []
        # Compact JSON: no free whitespace, which small models tend to loop on.
        grammar = self.compiler.compile_json_schema(schema, any_whitespace=False)
        with self._lock:
            outputs = self._decode([self._encode(m) for m in prompts], grammar, max_tokens)
        return [parse_object(self.tokenizer.decode(ids), schema) if ids is not None else None
                for ids in outputs]

    @torch.inference_mode()
    def _decode(self, prompts: list[list[int]], grammar: Any,
                max_tokens: int) -> list[list[int] | None]:
        """Greedy decoding of left-padded prompts; the tokens of each prompt whose grammar
        completed (stop token excluded), else None."""
        import xgrammar as xgr

        n, width = len(prompts), max(map(len, prompts))
        device = self.model.device
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        matchers = [xgr.GrammarMatcher(grammar) for _ in prompts]
        bitmask = xgr.allocate_token_bitmask(n, self.vocab_size)
        tokens: list[list[int]] = [[] for _ in prompts]
        cache = None
        for _ in range(max_tokens):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
            alive = set(live)
            for i in live:
                matchers[i].fill_next_token_bitmask(bitmask, i)
            logits = out.logits[:, -1, :].float()
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=live)
            chosen = logits.argmax(-1).tolist()
            for i in live:
                if not matchers[i].accept_token(chosen[i]):  # cannot happen under the mask
                    raise RuntimeError(f"grammar rejected token {chosen[i]}")
                if not matchers[i].is_terminated():
                    tokens[i].append(chosen[i])
            if all(m.is_terminated() for m in matchers):
                break
            step = [chosen[i] if i in alive else self.pad_id for i in range(n)]
            ids = torch.tensor(step, device=device).unsqueeze(1)
            mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)
            positions = positions[:, -1:] + 1
        # A grammar that completed without room for the stop token still counts.
        return [t if m.is_terminated() or m.is_completed() else None
                for t, m in zip(tokens, matchers, strict=True)]


class _Transient(Exception):
    """A response worth retrying (429 or 5xx)."""


class OpenAIJsonGenerator:
    """An OpenAI-compatible server (vLLM, ...) with `response_format` json_schema."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 timeout_s: float = 60, concurrency: int = 8, attempts: int = 4,
                 backoff_s: float = 0.5, transport: httpx.BaseTransport | None = None):
        """Transient failures (connection errors, 429, 5xx) are retried ``attempts`` times in
        all, waiting ``backoff_s`` * 2^k (at most 10 s) between tries."""
        base = base_url.rstrip("/")
        base = base.removesuffix("/v1")
        self.url = f"{base}/v1/chat/completions"
        self.model = model
        self.concurrency = concurrency
        self.attempts, self.backoff_s = attempts, backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=timeout_s, transport=transport,
                                   limits=httpx.Limits(max_connections=concurrency))

    def close(self) -> None:
        self.client.close()

    def generate(self, prompts: list[Messages], schema: dict,
                 max_tokens: int = 256) -> list[dict | None]:
        if not prompts:
            return []
        with ThreadPoolExecutor(min(self.concurrency, len(prompts))) as pool:
            return list(pool.map(lambda m: self._one(m, schema, max_tokens), prompts))

    def _post(self, body: dict) -> httpx.Response:
        response = self.client.post(self.url, json=body)
        if response.status_code == 429 or response.status_code >= 500:
            raise _Transient(f"HTTP {response.status_code}")
        return response

    def _one(self, messages: Messages, schema: dict, max_tokens: int) -> dict | None:
        body = {"model": self.model, "messages": messages, "temperature": 0,
                "max_tokens": max_tokens,
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "output", "schema": schema, "strict": True}}}
        retrying = Retrying(stop=stop_after_attempt(self.attempts), reraise=True,
                            wait=wait_exponential(multiplier=self.backoff_s, max=10),
                            retry=retry_if_exception_type((httpx.TransportError, _Transient)))
        try:
            response = retrying(self._post, body)
        except (httpx.HTTPError, _Transient) as error:
            log.warning("chat completion failed: %r", error)
            return None
        if response.is_error:
            log.warning("chat completion refused: HTTP %d", response.status_code)
            return None
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            log.warning("malformed chat completion (%d bytes)", len(response.content))
            return None
        value = parse_object(content, schema)
        if value is None:
            log.warning("completion is not a JSON object valid for the schema (%d chars)",
                        len(str(content)))
        return value
