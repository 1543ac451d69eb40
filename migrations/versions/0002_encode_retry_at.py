"""When a fact whose encoding failed may be tried again (exponential backoff).

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("facts", sa.Column("retry_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("facts", "retry_at")
