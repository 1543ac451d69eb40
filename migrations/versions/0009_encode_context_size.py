"""Early-fact backfill: how many facts each fact's KV was encoded after, and a mark for
re-encoding.

A fact stored before its user had ``window`` earlier facts was encoded after fewer (the first
after none); once the user has 3 x ``window`` facts the encode stage marks it (``backfill_due``)
and encodes it again (``claim_backfill_facts``). Facts encoded before this revision get an
estimate: their rank among their user's facts, at most their window.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("facts", sa.Column("context_facts", sa.Integer))
    op.add_column("facts", sa.Column("backfill_due", sa.Boolean, nullable=False,
                                     server_default=sa.false()))
    op.create_index("ix_facts_backfill_due", "facts", ["id"],
                    postgresql_where=sa.text("backfill_due AND deleted_at IS NULL"))
    op.execute("""
        UPDATE facts f SET context_facts = LEAST(f."window", r.earlier)
        FROM (SELECT id, row_number() OVER (PARTITION BY user_id ORDER BY ts, id) - 1 AS earlier
              FROM facts WHERE deleted_at IS NULL) r
        WHERE r.id = f.id AND f.kv_location IS NOT NULL""")


def downgrade() -> None:
    op.drop_index("ix_facts_backfill_due", "facts")
    op.drop_column("facts", "backfill_due")
    op.drop_column("facts", "context_facts")
