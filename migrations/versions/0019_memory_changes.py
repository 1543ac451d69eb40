"""Change events (a transactional outbox): every change to which facts are live is written,
by triggers on ``facts``, to ``memory_changes`` in the transaction that makes it, so a change is
recorded if and only if it commits. The worker's change relay (``workers/change_relay.py``)
publishes the rows to the change topic and deletes them (``contracts/change_events.py``).

Kinds: ``added`` (a live fact stored: extracted, given, imported, or an edit's new version),
``superseded`` (retired by an edit: ``superseded_by`` names the new version), ``expired``
(retired at its ``expires_at``), ``deleted`` (retired otherwise), ``forgotten`` (the owner's
facts deleted; one row per owner, no fact). Retired versions stored by an import are not
changes to the live memory and record nothing.

Revision ID: 0019
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

RECORD = """
CREATE FUNCTION record_memory_changes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO memory_changes (user_id, kind, fact_id, agent_id, run_id)
        SELECT user_id, 'added', id, agent_id, run_id FROM new_rows
        WHERE deleted_at IS NULL ORDER BY id;
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO memory_changes (user_id, kind, fact_id, superseded_by, agent_id, run_id)
        SELECT n.user_id,
               CASE WHEN n.superseded_by IS NOT NULL THEN 'superseded'
                    WHEN n.expires_at IS NOT NULL AND n.expires_at <= n.deleted_at
                        THEN 'expired'
                    ELSE 'deleted' END,
               n.id, n.superseded_by, n.agent_id, n.run_id
        FROM new_rows n JOIN old_rows o ON o.id = n.id
        WHERE o.deleted_at IS NULL AND n.deleted_at IS NOT NULL ORDER BY n.id;
    ELSE  -- DELETE: an owner forgotten
        INSERT INTO memory_changes (user_id, kind)
        SELECT DISTINCT user_id, 'forgotten' FROM old_rows ORDER BY user_id;
    END IF;
    RETURN NULL;
END $$
"""
TRIGGERS = (
    ("facts_changes_on_insert", "AFTER INSERT", "REFERENCING NEW TABLE AS new_rows"),
    ("facts_changes_on_update", "AFTER UPDATE",
     "REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows"),
    ("facts_changes_on_delete", "AFTER DELETE", "REFERENCING OLD TABLE AS old_rows"),
)


def upgrade() -> None:
    op.create_table(
        "memory_changes",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("user_id", sa.String(256), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("fact_id", sa.BigInteger),
        sa.Column("superseded_by", sa.BigInteger),
        sa.Column("agent_id", sa.String(256)),
        sa.Column("run_id", sa.String(256)),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.text("clock_timestamp()")),
    )
    op.execute(RECORD)
    for name, event, referencing in TRIGGERS:
        op.execute(f"CREATE TRIGGER {name} {event} ON facts {referencing} "
                   "FOR EACH STATEMENT EXECUTE FUNCTION record_memory_changes()")


def downgrade() -> None:
    for name, _, _ in TRIGGERS:
        op.execute(f"DROP TRIGGER {name} ON facts")
    op.execute("DROP FUNCTION record_memory_changes()")
    op.drop_table("memory_changes")
