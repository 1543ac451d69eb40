"""Exact nearest-fact search within one owner: the global HNSW index goes.

Every vector query here is filtered to one user. An HNSW graph over all users' facts is walked
first and filtered after: without iterative scans it returned fewer than k of a user's facts,
with them it missed many of the true nearest ones (recall@50 0.40 at 10k facts per user), and
with many owners it was slower than reading one owner's rows. Two of the three queries already
kept the planner off it. Without it, every query reads the owner's rows through
``ix_facts_user`` and ranks them exactly (README, "TTFT vs k": retrieval).

Revision ID: 0007
Revises: 0006
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_facts_embedding_hnsw", table_name="facts")


def downgrade() -> None:
    op.create_index("ix_facts_embedding_hnsw", "facts", ["embedding"], postgresql_using="hnsw",
                    postgresql_ops={"embedding": "vector_cosine_ops"})
