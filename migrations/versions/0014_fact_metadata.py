"""Metadata on facts: a bounded JSON object an application sets when it adds or edits a fact
(``contracts/metadata.py`` bounds it), returned with the fact and filtered on
(``contracts/filters.py``).

``facts.metadata`` is never NULL (``{}``: none). Like a fact's text, scope and embedding it never
changes in place: an edit of text or metadata stores a new version. A GIN index (``jsonb_ops``)
serves containment (``@>``) and key existence (``?``) across owners.

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("facts", sa.Column("metadata", JSONB, nullable=False,
                                     server_default=sa.text("'{}'::jsonb")))
    op.create_index("ix_facts_metadata", "facts", ["metadata"], postgresql_using="gin")


def downgrade() -> None:
    op.drop_index("ix_facts_metadata", table_name="facts")
    op.drop_column("facts", "metadata")
