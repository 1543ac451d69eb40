"""Extraction as its own stage, and facts that can be superseded.

``turns`` gain the extract stage's claim (``extract_claims``, ``extract_until``: a lease, as for
encoding) and ``extracted_at``, set in the transaction that stores the turn's facts, so a turn is
extracted once whatever is redelivered or restarted. ``facts.superseded_by`` keeps the history
of an UPDATE (the old fact is also marked ``deleted_at``). Turns stored before this revision had
their facts extracted at ingest: they count as extracted.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("turns", sa.Column("extracted_at", sa.DateTime(timezone=True)))
    op.add_column("turns", sa.Column("extract_claims", sa.Integer, nullable=False,
                                     server_default="0"))
    op.add_column("turns", sa.Column("extract_until", sa.DateTime(timezone=True)))
    op.add_column("turns", sa.Column("extract_error", sa.Text))
    op.execute("UPDATE turns SET extracted_at = created_at")
    op.create_index("ix_turns_unextracted", "turns", ["created_at"],
                    postgresql_where=sa.text("extracted_at IS NULL"))
    op.add_column("facts", sa.Column("superseded_by", sa.BigInteger))


def downgrade() -> None:
    op.drop_column("facts", "superseded_by")
    op.drop_index("ix_turns_unextracted", "turns")
    for column in ("extract_error", "extract_until", "extract_claims", "extracted_at"):
        op.drop_column("turns", column)
