"""Idempotent imports (``contracts/memory_export.py``): the database gets an identity of its
own (``memory_origin``, one random row) that its exports carry, so a fact version is named
across databases by (origin, owner exported, id): its ``import_key``. A fact imported keeps
that key, and one owner holds each key at most once, so importing the same records again adds
nothing. ``import_successor`` is the key of the version that replaced an imported retired fact,
until that version is imported too and ``superseded_by`` points at it.

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("memory_origin", sa.Column("origin", sa.String(32), primary_key=True))
    op.execute("INSERT INTO memory_origin SELECT replace(gen_random_uuid()::text, '-', '')")
    op.add_column("facts", sa.Column("import_key", sa.String(64)))
    op.add_column("facts", sa.Column("import_successor", sa.String(64)))
    op.create_index("ix_facts_import_key", "facts", ["user_id", "import_key"], unique=True,
                    postgresql_where=sa.text("import_key IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("ix_facts_import_key", table_name="facts")
    op.drop_column("facts", "import_successor")
    op.drop_column("facts", "import_key")
    op.drop_table("memory_origin")
