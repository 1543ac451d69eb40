"""Tombstones of forgotten users: turns published before the forget never come back.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "forgotten_users",
        sa.Column("user_id", sa.String(256), primary_key=True),
        sa.Column("forgotten_at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.func.now()),
    )


def downgrade() -> None:
    op.drop_table("forgotten_users")
