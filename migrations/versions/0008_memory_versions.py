"""A version per memory owner, bumped by every change to which facts the owner has.

Servers keep each owner's fact embeddings in memory (``inferscale/owner_index.py``) and ask
for this one number per request: equal means their copy is current. Statement-level triggers
on ``facts`` bump it for every owner whose live facts a statement changes, and count what
changed: ``inserted`` (facts stored) and ``retired`` (facts deleted, or ``deleted_at`` set or
cleared; a truncate counts for every owner). A copy that saw no retirement since it was read
catches up with the facts stored after it alone. Versions come from one sequence, so they
never repeat, even across truncates of this table.

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
DECLARE
    changes memory_change[];
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        UPDATE memory_versions SET version = nextval('memory_version_seq'), retired = retired + 1;
        RETURN NULL;
    ELSIF TG_OP = 'INSERT' THEN
        SELECT array_agg(c) INTO changes FROM (
            SELECT (user_id, count(*), 0)::memory_change c FROM new_rows GROUP BY user_id) g;
    ELSIF TG_OP = 'DELETE' THEN
        SELECT array_agg(c) INTO changes FROM (
            SELECT (user_id, 0, count(*))::memory_change c FROM old_rows GROUP BY user_id) g;
    ELSE  -- UPDATE: rows retired or revived (encoding a fact does not count)
        SELECT array_agg(c) INTO changes FROM (
            SELECT (n.user_id, 0, count(*))::memory_change c
            FROM new_rows n JOIN old_rows o ON o.id = n.id
            WHERE (n.deleted_at IS NULL) <> (o.deleted_at IS NULL) GROUP BY n.user_id) g;
    END IF;
    -- owners in a fixed order: concurrent statements lock their version rows alike; an
    -- existing row takes its number once locked, so an owner's versions grow in commit order
    INSERT INTO memory_versions AS m (user_id, version, inserted, retired)
    SELECT c.user_id, nextval('memory_version_seq'), c.inserted, c.retired
    FROM (SELECT * FROM unnest(changes) ORDER BY user_id) c
    ON CONFLICT (user_id) DO UPDATE SET version = nextval('memory_version_seq'),
        inserted = m.inserted + EXCLUDED.inserted, retired = m.retired + EXCLUDED.retired;
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
               "version bigint NOT NULL, inserted bigint NOT NULL, retired bigint NOT NULL)")
    op.execute("INSERT INTO memory_versions SELECT user_id, nextval('memory_version_seq'), "
               "count(*), 0 FROM facts GROUP BY user_id")
    op.execute("CREATE TYPE memory_change AS (user_id varchar(256), inserted bigint, "
               "retired bigint)")
    op.execute(BUMP)
    for name, event, referencing in TRIGGERS:
        op.execute(f"CREATE TRIGGER {name} {event} ON facts {referencing} "
                   "FOR EACH STATEMENT EXECUTE FUNCTION bump_memory_versions()")


def downgrade() -> None:
    for name, _, _ in TRIGGERS:
        op.execute(f"DROP TRIGGER {name} ON facts")
    op.execute("DROP FUNCTION bump_memory_versions()")
    op.execute("DROP TYPE memory_change")
    op.execute("DROP TABLE memory_versions")
    op.execute("DROP SEQUENCE memory_version_seq")
