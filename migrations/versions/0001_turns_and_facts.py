"""Turns and facts, with a pgvector HNSW cosine index on fact embeddings.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from pgvector.sqlalchemy import Vector
from sqlalchemy.dialects.postgresql import ARRAY

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE EXTENSION IF NOT EXISTS vector")
    op.create_table(
        "turns",
        sa.Column("user_id", sa.String(256), primary_key=True),
        sa.Column("conversation_id", sa.String(256), primary_key=True),
        sa.Column("turn_id", sa.String(256), primary_key=True),
        sa.Column("speaker", sa.String(256), nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("ts", sa.DateTime(timezone=True), nullable=False),
        sa.Column("source_topic", sa.String(256)),
        sa.Column("source_partition", sa.Integer),
        sa.Column("source_offset", sa.BigInteger),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
    )
    op.create_index("ix_turns_conversation_order", "turns", ["user_id", "conversation_id", "ts"])
    op.create_table(
        "facts",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("user_id", sa.String(256), nullable=False),
        sa.Column("conversation_id", sa.String(256), nullable=False),
        sa.Column("turn_ids", ARRAY(sa.String(256)), nullable=False),
        sa.Column("ordinal", sa.Integer, nullable=False, server_default="0"),
        sa.Column("extractor", sa.String(64), nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("ts", sa.DateTime(timezone=True), nullable=False),
        sa.Column("embedding", Vector(384), nullable=False),
        sa.Column("token_ids", ARRAY(sa.Integer)),
        sa.Column("token_count", sa.Integer),
        sa.Column("window", sa.Integer),
        sa.Column("model_fingerprint", sa.String(64)),
        sa.Column("kv_location", sa.Text),
        sa.Column("kv_bytes", sa.BigInteger),
        sa.Column("kv_checksum", sa.String(64)),
        sa.Column("encode_attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("encode_error", sa.Text),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("encoded_at", sa.DateTime(timezone=True)),
        sa.Column("deleted_at", sa.DateTime(timezone=True)),
        sa.UniqueConstraint(
            "user_id", "conversation_id", "extractor", "turn_ids", "ordinal", name="uq_facts_source"
        ),
    )
    op.create_index("ix_facts_user", "facts", ["user_id"])
    op.create_index(
        "ix_facts_pending",
        "facts",
        ["id"],
        postgresql_where=sa.text("kv_location IS NULL AND deleted_at IS NULL"),
    )
    op.create_index(
        "ix_facts_embedding_hnsw",
        "facts",
        ["embedding"],
        postgresql_using="hnsw",
        postgresql_ops={"embedding": "vector_cosine_ops"},
    )


def downgrade() -> None:
    op.drop_table("facts")
    op.drop_table("turns")
