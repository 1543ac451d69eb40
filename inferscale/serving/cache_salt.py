"""The cache salt of a memory prompt: which of vLLM's prefix-cache blocks a request may reuse.

vLLM hashes a prompt's KV blocks in a chain from the first block, and only the first block
carries the request's ``cache_salt``: two requests share a block only where their salts and
every token up to the block's end are equal. The salt is keyed by the server's secret (no
client can compute it to probe an owner's blocks) and holds the owner, the model, the client's
own salt, the request's class (memory mode, tail recompute, lead blobs, key scales, scope,
filter and how many facts retrieval ranked) and the memory's ids: the owner's pinned facts
where they have any, else every fact of the prompt. Fact ids are never reused and a fact's text
never changes under its id, so the blocks of a forgotten owner's memory are never reached again
(nor, without pinned facts, those of an edited or deleted fact); with pinned facts, the blocks
after them are reached only by a prompt of the same owner, pinned facts and class holding the
same tokens in the same places.

Invariant: within one class, a fact's place in the prompt decides how its KV is made: the last
``recompute`` of the ranked facts are prefilled; any other fact is injected where it has usable
KV, else prefilled for lack of it (as is every fact where a pinned one has none). So equal
tokens at equal places under one salt mean the same kind of KV: an injected (approximate)
block is never reused by a request that prefills those tokens by choice (text mode, a
recompute tail), and a request that would have injected them may reuse exact ones. Requests of
one owner whose prompts share a prefix (the pinned facts, and any facts in the same places)
share its blocks.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence

from inferscale.serving.request_options import MemoryOptions

CLASS_FIELDS = {"mode", "recompute", "lead", "key_scales", "agent_id", "run_id", "filters"}


class CacheSalts:
    """Salts for one server, keyed by its plan secret."""

    def __init__(self, secret: str) -> None:
        self._key = hashlib.sha256(b"inferscale cache salt\0" + secret.encode()).digest()

    def salt(self, owner: str, fingerprint: str, options: MemoryOptions, retrieved: int,
             pinned: Sequence[int], fact_ids: Sequence[int], client_salt: object) -> str:
        """The salt of a memory prompt (see the module's docstring): ``pinned``, the owner's
        pinned facts in it; ``fact_ids``, every fact in it."""
        memory = ["pinned", *pinned] if pinned else ["facts", *fact_ids]
        digest = hmac.new(self._key, json.dumps(
            [owner, fingerprint, options.model_dump(include=CLASS_FIELDS), retrieved, memory,
             client_salt], sort_keys=True).encode(), hashlib.sha256).hexdigest()
        return f"inferscale-{digest[:32]}"
