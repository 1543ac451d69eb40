"""A version per memory owner, bumped by every change to which facts the owner has.

Servers keep each owner's fact embeddings in memory (``inferscale/owner_index.py``) and ask
for this one number per request: equal means their copy is current. Statement-level triggers
on ``facts`` bump it for every owner whose live facts a statement changes: rows inserted or
deleted, ``deleted_at`` set or cleared; a truncate bumps all. Versions come from one sequence,
so they never repeat, even across truncates of this table.

Revision ID: 0008
Revises: 0007
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

BUMP = """
CREATE FUNCTION bump_memory_versions() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        UPDATE memory_versions SET version = nextval('memory_version_seq');
        RETURN NULL;
    END IF;
    -- owners in a fixed order: concurrent statements lock their version rows alike
    IF TG_OP = 'INSERT' THEN
        INSERT INTO memory_versions (user_id, version)
        SELECT user_id, nextval('memory_version_seq')
        FROM (SELECT DISTINCT user_id FROM new_rows ORDER BY user_id) changed
        ON CONFLICT (user_id) DO UPDATE SET version = EXCLUDED.version;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO memory_versions (user_id, version)
        SELECT user_id, nextval('memory_version_seq')
        FROM (SELECT DISTINCT user_id FROM old_rows ORDER BY user_id) changed
        ON CONFLICT (user_id) DO UPDATE SET version = EXCLUDED.version;
    ELSE  -- UPDATE: only rows retired or revived (encoding a fact does not count)
        INSERT INTO memory_versions (user_id, version)
        SELECT user_id, nextval('memory_version_seq')
        FROM (SELECT DISTINCT n.user_id FROM new_rows n JOIN old_rows o ON o.id = n.id
              WHERE (n.deleted_at IS NULL) <> (o.deleted_at IS NULL)
              ORDER BY n.user_id) changed
        ON CONFLICT (user_id) DO UPDATE SET version = EXCLUDED.version;
    END IF;
    RETURN NULL;
END $$
"""
TRIGGERS = (
    ("facts_bump_on_insert", "AFTER INSERT", "REFERENCING NEW TABLE AS new_rows"),
    ("facts_bump_on_update", "AFTER UPDATE",
     "REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows"),
    ("facts_bump_on_delete", "AFTER DELETE", "REFERENCING OLD TABLE AS old_rows"),
    ("facts_bump_on_truncate", "AFTER TRUNCATE", ""),
)


def upgrade() -> None:
    op.execute("CREATE SEQUENCE memory_version_seq")
    op.execute("CREATE TABLE memory_versions (user_id varchar(256) PRIMARY KEY, "
               "version bigint NOT NULL)")
    op.execute("INSERT INTO memory_versions SELECT user_id, nextval('memory_version_seq') "
               "FROM (SELECT DISTINCT user_id FROM facts) owners")
    op.execute(BUMP)
    for name, event, referencing in TRIGGERS:
        op.execute(f"CREATE TRIGGER {name} {event} ON facts {referencing} "
                   "FOR EACH STATEMENT EXECUTE FUNCTION bump_memory_versions()")


def downgrade() -> None:
    for name, _, _ in TRIGGERS:
        op.execute(f"DROP TRIGGER {name} ON facts")
    op.execute("DROP FUNCTION bump_memory_versions()")
    op.execute("DROP TABLE memory_versions")
    op.execute("DROP SEQUENCE memory_version_seq")
