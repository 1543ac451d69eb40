"""A KV budget: facts whose KV was evicted, facts a request wants encoded again, and when each
user's memory was last served.

``kv_evicted_at``: the fact's blobs were evicted to keep the durable tier under its budget (its
text and embedding stay; it is served as text). The encode stage leaves such a fact alone until
a request wants it (``kv_wanted_at``), then encodes it before its backlog. ``kv_bytes`` counts
the fact's blobs (its lead blob too, for facts encoded from this revision on).
``memory_activity``: when each user's memory was last served (eviction takes the least recently
served users' KV first).

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("facts", sa.Column("kv_evicted_at", sa.DateTime(timezone=True)))
    op.add_column("facts", sa.Column("kv_wanted_at", sa.DateTime(timezone=True)))
    op.create_index("ix_facts_kv_held", "facts", ["user_id"],
                    postgresql_where=sa.text("kv_location IS NOT NULL AND deleted_at IS NULL"))
    op.create_table(
        "memory_activity",
        sa.Column("user_id", sa.String(256), primary_key=True),
        sa.Column("served_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("memory_activity")
    op.drop_index("ix_facts_kv_held", "facts")
    op.drop_column("facts", "kv_wanted_at")
    op.drop_column("facts", "kv_evicted_at")
