"""Adds that say when they are done: an add of turns or facts through the memory API records an
event (its id, the owner, the turns it published, the facts it stored), from which the server
answers how far the add has come (``db/memory_events.py``).

An event holds ids only, never text; forgetting the owner deletes its events.

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "memory_events",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("user_id", sa.String(256), nullable=False),
        # [[conversation_id, turn_id], ...] published to the turn topic
        sa.Column("turns", JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
        sa.Column("fact_ids", ARRAY(sa.BigInteger), nullable=False, server_default="{}"),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(),
                  nullable=False),
    )
    op.create_index("ix_memory_events_user", "memory_events", ["user_id"])


def downgrade() -> None:
    op.drop_index("ix_memory_events_user", table_name="memory_events")
    op.drop_table("memory_events")
