"""Facts that expire: ``facts.expires_at`` (NULL: never). An expired fact is never served (the
server's reads check the time), and the maintenance stage retires it (``deleted_at``) and
removes its KV, so it leaves the KV budgets too (``db/expiry.py``).

Revision ID: 0018
Revises: 0017
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("facts", sa.Column("expires_at", sa.DateTime(timezone=True)))
    op.create_index("ix_facts_expiring", "facts", ["expires_at"],
                    postgresql_where=sa.text("deleted_at IS NULL AND expires_at IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("ix_facts_expiring", table_name="facts")
    op.drop_column("facts", "expires_at")
