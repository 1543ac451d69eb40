"""Lead encoding: the checksum of each fact's second blob, its KV encoded after the preamble
alone (served when the fact comes first). NULL for facts encoded without one.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("facts", sa.Column("kv_lead_checksum", sa.String(64)))


def downgrade() -> None:
    op.drop_column("facts", "kv_lead_checksum")
