"""When each fact's KV was last served: the eviction grace protects facts, not users.

``fact_kv.served_at``: when a request last served the fact by the row's model (with its KV or,
missing, as text). Eviction skips a row served within the grace period (no plan in flight names
it); the rest of an active user's KV is held to the budgets like anyone's. Not indexed, so its
stamps stay HOT updates.

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("fact_kv", sa.Column("served_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("fact_kv", "served_at")
