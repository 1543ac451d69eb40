"""The memory layout contract shared by the encoder and the server.

Serving prompt = ``[preamble][fact 1 segment]...[fact k segment][suffix]``:
- preamble: the chat template up to the memory (BOS/system header + a fixed memory intro);
- fact segment: ``"- <fact text>\\n"``, tokenized on its own at encode time and reused verbatim;
- suffix: the rest of the system message, the conversation and the generation prompt.
The text-prefill baseline uses exactly the same token ids, so the two differ only in how the
memory span's K/V is produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MEMORY_INTRO = (
    "You are a helpful assistant with a long-term memory of past conversations with the user. "
    "Relevant memories, each with its date:\n"
)
DEFAULT_INSTRUCTIONS = "Answer the user's question using these memories. Be brief."
_MEMORY_MARK = "\u2063MEMORY\u2063"


@dataclass(frozen=True)
class PromptPlan:
    """A composed prompt: token ids and where each fact segment sits in it."""

    token_ids: list[int]
    preamble_len: int
    fact_spans: list[tuple[int, int]]  # [start, end) per fact, in prompt order


class MemoryLayout:
    """Tokenizes prompt pieces so that fact segments are position-independent units."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        rendered = self._render([{"role": "system", "content": f"{MEMORY_INTRO}{_MEMORY_MARK}"}])
        head, _ = rendered.split(_MEMORY_MARK, 1)
        self.preamble_ids: list[int] = self._ids(head)

    def _ids(self, text: str, literal: bool = False) -> list[int]:
        """Token ids of ``text``; ``literal``: special-token strings in it stay plain text."""
        ids: list[int] = self.tokenizer(text, add_special_tokens=False,
                                        split_special_tokens=literal)["input_ids"]
        return ids

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        rendered: str = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        return rendered

    def fact_segment(self, text: str) -> list[int]:
        """Token ids of one fact as it appears in memory (encode time == serving time). Memory
        is data: a fact saying ``<|im_start|>system`` gets no role markers from it."""
        return self._ids(f"- {' '.join(text.split())}\n", literal=True)

    def suffix_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Everything after the memory: instructions, the chat messages, the generation prompt.

        A leading client system message becomes the instructions; the rest render as given.
        """
        messages = list(messages)
        instructions = DEFAULT_INSTRUCTIONS
        if messages and messages[0].get("role") == "system":
            instructions = str(messages.pop(0).get("content") or "")
        system = {"role": "system", "content": f"{MEMORY_INTRO}{_MEMORY_MARK}{instructions}"}
        rendered = self._render([system, *messages], generation_prompt=True)
        _, tail = rendered.split(_MEMORY_MARK, 1)
        return self._ids(tail)

    def compose(self, fact_segments: Sequence[Sequence[int]],
                messages: Sequence[dict[str, Any]]) -> PromptPlan:
        """The full prompt for these fact segments (in order) and chat messages."""
        ids = list(self.preamble_ids)
        spans = []
        for segment in fact_segments:
            spans.append((len(ids), len(ids) + len(segment)))
            ids.extend(segment)
        ids.extend(self.suffix_ids(messages))
        return PromptPlan(token_ids=ids, preamble_len=len(self.preamble_ids), fact_spans=spans)
