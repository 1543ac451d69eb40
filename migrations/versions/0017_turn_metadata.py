"""Metadata on turns: a turn event v3 may carry an application's metadata
(``contracts/metadata.py``), kept with the stored turn and given to the facts extracted from it.

``turns.metadata`` is never NULL (``{}``: none).

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("turns", sa.Column("metadata", JSONB, nullable=False,
                                     server_default=sa.text("'{}'::jsonb")))


def downgrade() -> None:
    op.drop_column("turns", "metadata")
