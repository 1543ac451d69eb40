"""Pinned facts: ``facts.pinned`` (an owner's profile, standing instructions). A pinned fact is
in every memory prompt of its owner (within the request's scope and filter), first, in id
order, whatever the question; like a fact's text, it never changes (pinning or unpinning is an
edit: a new version). The partial index reads an owner's pinned facts without their others.

Revision ID: 0020
Revises: 0019
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("facts", sa.Column("pinned", sa.Boolean, nullable=False,
                                     server_default=sa.false()))
    op.create_index("ix_facts_pinned", "facts", ["user_id", "id"],
                    postgresql_where=sa.text("pinned AND deleted_at IS NULL"))


def downgrade() -> None:
    op.drop_index("ix_facts_pinned", table_name="facts")
    op.drop_column("facts", "pinned")
