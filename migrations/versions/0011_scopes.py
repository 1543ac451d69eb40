"""Scopes beyond the owner: the agent and the run (session) a turn was published under, and
every fact extracted from it.

NULL: no agent (run). Requests and memory API routes may filter by either; a filter matches
only facts with that exact value, no filter matches every fact of the owner. A fact's scope
never changes (an edit's new version keeps it).

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("turns", "facts"):
        op.add_column(table, sa.Column("agent_id", sa.String(256)))
        op.add_column(table, sa.Column("run_id", sa.String(256)))


def downgrade() -> None:
    for table in ("turns", "facts"):
        op.drop_column(table, "run_id")
        op.drop_column(table, "agent_id")
