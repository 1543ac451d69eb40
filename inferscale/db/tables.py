"""Table definitions (the alembic migrations are the source of truth for the schema)."""

from __future__ import annotations

from pgvector.sqlalchemy import Vector
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    func,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

EMBEDDING_DIM = 384

metadata = MetaData()

turns = Table(
    "turns",
    metadata,
    Column("user_id", String(256), primary_key=True),
    Column("conversation_id", String(256), primary_key=True),
    Column("turn_id", String(256), primary_key=True),
    Column("speaker", String(256), nullable=False),
    Column("text", Text, nullable=False),
    Column("ts", DateTime(timezone=True), nullable=False),
    Column("agent_id", String(256)),  # the turn's scopes (migration 0011; NULL: none)
    Column("run_id", String(256)),
    Column("metadata", JSONB, nullable=False, server_default="{}"),  # migration 0017
    Column("source_topic", String(256)),
    Column("source_partition", Integer),
    Column("source_offset", BigInteger),
    Column("created_at", DateTime(timezone=True), server_default=func.now(), nullable=False),
    Column("extracted_at", DateTime(timezone=True)),
    Column("extract_claims", Integer, nullable=False, server_default="0"),
    Column("extract_until", DateTime(timezone=True)),
    Column("extract_error", Text),
)

facts = Table(
    "facts",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("user_id", String(256), nullable=False),
    Column("conversation_id", String(256), nullable=False),
    Column("turn_ids", ARRAY(String(256)), nullable=False),
    Column("ordinal", Integer, nullable=False, server_default="0"),
    Column("extractor", String(64), nullable=False),
    Column("text", Text, nullable=False),
    Column("ts", DateTime(timezone=True), nullable=False),
    Column("embedding", Vector(EMBEDDING_DIM), nullable=False),
    Column("agent_id", String(256)),  # its turn's scopes (migration 0011; NULL: none)
    Column("run_id", String(256)),
    # An application's bounded JSON object (migration 0014; {}: none), never changed in place.
    Column("metadata", JSONB, nullable=False, server_default="{}"),
    Column("created_at", DateTime(timezone=True), server_default=func.now(), nullable=False),
    Column("deleted_at", DateTime(timezone=True)),
    Column("superseded_by", BigInteger),
    Column("expires_at", DateTime(timezone=True)),  # never served after (migration 0018)
    # In every memory prompt of its owner, first (migration 0020); never changed in place.
    Column("pinned", Boolean, nullable=False, server_default="false"),
    # The export record it was imported from, and the one that replaced it while that is not
    # imported yet (migration 0016; NULL: not imported / resolved).
    Column("import_key", String(64)),
    Column("import_successor", String(64)),
)

# The database's identity, which its exports carry (migration 0016): one row.
memory_origin = Table("memory_origin", metadata, Column("origin", String(32), primary_key=True))

# The models encode workers encode for (migration 0012): each registers its own at start.
kv_models = Table(
    "kv_models",
    metadata,
    Column("fingerprint", String(64), primary_key=True),
    Column("registered_at", DateTime(timezone=True), server_default=func.now(), nullable=False),
)

# A fact's KV for one registered model, and that model's encode queue state for it (migration
# 0012): a trigger gives each new fact a row per registered model.
fact_kv = Table(
    "fact_kv",
    metadata,
    Column("model_fingerprint", String(64), ForeignKey("kv_models.fingerprint", ondelete="CASCADE"),
           primary_key=True),
    Column("fact_id", BigInteger, ForeignKey("facts.id", ondelete="CASCADE"), primary_key=True),
    Column("enrolled", Boolean, nullable=False, server_default="false"),  # with its model
    Column("token_ids", ARRAY(Integer)),  # the model's tokens of the fact's text
    Column("token_count", Integer),
    Column("window", Integer),
    Column("context_facts", Integer),  # how many facts its KV was encoded after
    Column("backfill_due", Boolean, nullable=False, server_default="false"),  # re-encode it
    Column("kv_location", Text),
    Column("kv_bytes", BigInteger),
    Column("kv_checksum", String(64)),
    Column("kv_lead_checksum", String(64)),  # the lead blob's (NULL: none)
    Column("kv_evicted_at", DateTime(timezone=True)),  # its KV evicted (budget); served as text
    Column("kv_wanted_at", DateTime(timezone=True)),  # evicted, and a request wants it again
    Column("encode_attempts", Integer, nullable=False, server_default="0"),
    Column("encode_error", Text),
    Column("retry_at", DateTime(timezone=True)),
    Column("encode_claims", Integer, nullable=False, server_default="0"),
    Column("claimed_until", DateTime(timezone=True)),
    Column("encoded_at", DateTime(timezone=True)),
    # A request served the fact by this model (migration 0013): eviction spares it in the grace.
    Column("served_at", DateTime(timezone=True)),
)

# An add through the memory API (migration 0015): the turns it published and the facts it
# stored, ids only; how far it has come is read from the turns and facts (db/memory_events.py).
memory_events = Table(
    "memory_events",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("user_id", String(256), nullable=False),
    Column("turns", JSONB, nullable=False, server_default="[]"),  # [[conversation, turn], ...]
    Column("fact_ids", ARRAY(BigInteger), nullable=False, server_default="{}"),
    Column("created_at", DateTime(timezone=True), server_default=func.now(), nullable=False),
)

# Changes to which facts are live, written by triggers on facts in the changing transaction
# (migration 0019: a transactional outbox), until the change relay publishes them.
memory_changes = Table(
    "memory_changes",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("user_id", String(256), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("fact_id", BigInteger),  # NULL: a forgotten owner
    Column("superseded_by", BigInteger),
    Column("agent_id", String(256)),
    Column("run_id", String(256)),
    Column("at", DateTime(timezone=True), nullable=False),
)

# A forgotten user's tombstone: turns published (Kafka record time) up to forgotten_at are
# dropped on (re)delivery; later turns start a new memory.
forgotten_users = Table(
    "forgotten_users",
    metadata,
    Column("user_id", String(256), primary_key=True),
    Column("forgotten_at", DateTime(timezone=True), server_default=func.now(), nullable=False),
)

# Kept by triggers on facts (migration 0008): a new version (from one sequence) whenever an
# owner's set of live facts changes, with running counts of facts inserted and retired.
memory_versions = Table(
    "memory_versions",
    metadata,
    Column("user_id", String(256), primary_key=True),
    Column("version", BigInteger, nullable=False),
    Column("inserted", BigInteger, nullable=False),
    Column("retired", BigInteger, nullable=False),
)

# When each user's memory was last served (migration 0010): eviction takes the least recently
# served users' KV first.
memory_activity = Table(
    "memory_activity",
    metadata,
    Column("user_id", String(256), primary_key=True),
    Column("served_at", DateTime(timezone=True), nullable=False),
)
