"""Encode leases instead of row locks held while encoding, and a crash count per fact.

``encode_claims`` counts the claims of a fact; every recorded outcome counts in
``encode_attempts``, so ``encode_claims - encode_attempts`` is how many workers died (or lost
their lease) while encoding it. ``claimed_until`` is the end of the current claim's lease.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("facts", sa.Column("encode_claims", sa.Integer, nullable=False,
                                     server_default="0"))
    op.add_column("facts", sa.Column("claimed_until", sa.DateTime(timezone=True)))
    op.create_index("ix_facts_claimed", "facts", ["claimed_until"],
                    postgresql_where=sa.text("claimed_until IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("ix_facts_claimed", "facts")
    op.drop_column("facts", "claimed_until")
    op.drop_column("facts", "encode_claims")
