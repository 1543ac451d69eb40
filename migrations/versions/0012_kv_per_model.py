"""KV per (fact, model): one fleet encodes and serves a memory for several models at once.

``kv_models``: the models encode workers encode for (a worker registers its model at start).
``fact_kv``: one row per fact and registered model, with everything that is the model's: its
token ids (the model's tokenizer), the encoding's context, the blob's location, size and
checksums, eviction, and the encode queue's state (claims, attempts, errors, backoff). A
statement-level trigger gives every fact inserted a row per registered model; registering a
model gives every live fact a row (``enrolled``: encoded after the fleet's fresh facts). A
fact's rows go with it; a model's rows go with the model.

Upgrading: each model a fact was encoded for is registered, and the fact's KV columns become its
row for that model; a fact encoded for no model yet keeps its queue state in a row per
registered model (none where no model was ever recorded: the first worker enrols it afresh).
Downgrading keeps, per fact, the row of its most recently encoded model.

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

# The columns that move, in their order in facts (their types are those of revisions 1-10).
MODEL_COLUMNS = (
    ("token_ids", ARRAY(sa.Integer)), ("token_count", sa.Integer), ("window", sa.Integer),
    ("context_facts", sa.Integer), ("kv_location", sa.Text), ("kv_bytes", sa.BigInteger),
    ("kv_checksum", sa.String(64)), ("kv_lead_checksum", sa.String(64)),
    ("kv_evicted_at", sa.DateTime(timezone=True)), ("kv_wanted_at", sa.DateTime(timezone=True)),
    ("encode_error", sa.Text), ("retry_at", sa.DateTime(timezone=True)),
    ("claimed_until", sa.DateTime(timezone=True)), ("encoded_at", sa.DateTime(timezone=True)),
)
COUNTERS = ("backfill_due", "encode_attempts", "encode_claims")  # NOT NULL with defaults
QUEUE = ("kv_evicted_at", "kv_wanted_at", "encode_attempts", "encode_error", "retry_at",
         "encode_claims", "claimed_until")  # what a fact encoded for no model carries

ENROL = """
CREATE FUNCTION enrol_new_facts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO fact_kv (fact_id, model_fingerprint)
    SELECT n.id, m.fingerprint FROM new_rows n CROSS JOIN kv_models m;
    RETURN NULL;
END $$
"""


def upgrade() -> None:
    op.create_table(
        "kv_models",
        sa.Column("fingerprint", sa.String(64), primary_key=True),
        sa.Column("registered_at", sa.DateTime(timezone=True), server_default=sa.func.now(),
                  nullable=False),
    )
    op.create_table(
        "fact_kv",
        sa.Column("model_fingerprint", sa.String(64),
                  sa.ForeignKey("kv_models.fingerprint", ondelete="CASCADE"), primary_key=True),
        sa.Column("fact_id", sa.BigInteger, sa.ForeignKey("facts.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("enrolled", sa.Boolean, nullable=False, server_default="false"),
        sa.Column("backfill_due", sa.Boolean, nullable=False, server_default="false"),
        sa.Column("encode_attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("encode_claims", sa.Integer, nullable=False, server_default="0"),
        *(sa.Column(name, kind) for name, kind in MODEL_COLUMNS),
    )
    op.create_index("ix_fact_kv_fact", "fact_kv", ["fact_id"])
    op.create_index("ix_fact_kv_pending", "fact_kv", ["model_fingerprint", "fact_id"],
                    postgresql_where=sa.text("kv_location IS NULL"))
    op.create_index("ix_fact_kv_claimed", "fact_kv", ["claimed_until"],
                    postgresql_where=sa.text("claimed_until IS NOT NULL"))
    op.create_index("ix_fact_kv_backfill_due", "fact_kv", ["model_fingerprint", "fact_id"],
                    postgresql_where=sa.text("backfill_due"))
    op.create_index("ix_fact_kv_held", "fact_kv", ["fact_id"],
                    postgresql_where=sa.text("kv_location IS NOT NULL"))

    moved = [f'"{name}"' for name, _ in MODEL_COLUMNS] + list(COUNTERS)
    op.execute("INSERT INTO kv_models (fingerprint) SELECT DISTINCT model_fingerprint "
               "FROM facts WHERE model_fingerprint IS NOT NULL")
    op.execute(f"INSERT INTO fact_kv (model_fingerprint, fact_id, {', '.join(moved)}) "
               f"SELECT model_fingerprint, id, {', '.join(moved)} FROM facts "
               "WHERE model_fingerprint IS NOT NULL")
    op.execute(f"INSERT INTO fact_kv (model_fingerprint, fact_id, {', '.join(QUEUE)}) "
               f"SELECT m.fingerprint, f.id, {', '.join('f.' + c for c in QUEUE)} "
               "FROM facts f CROSS JOIN kv_models m WHERE f.model_fingerprint IS NULL")
    op.execute("INSERT INTO fact_kv (model_fingerprint, fact_id, enrolled) "
               "SELECT m.fingerprint, f.id, true FROM facts f CROSS JOIN kv_models m "
               "WHERE f.model_fingerprint IS NOT NULL AND f.deleted_at IS NULL "
               "ON CONFLICT DO NOTHING")

    for index in ("ix_facts_pending", "ix_facts_claimed", "ix_facts_backfill_due",
                  "ix_facts_kv_held"):
        op.drop_index(index, "facts")
    for name in (*(name for name, _ in MODEL_COLUMNS), *COUNTERS, "model_fingerprint"):
        op.drop_column("facts", name)
    op.execute(ENROL)
    op.execute("CREATE TRIGGER facts_enrol_on_insert AFTER INSERT ON facts "
               "REFERENCING NEW TABLE AS new_rows "
               "FOR EACH STATEMENT EXECUTE FUNCTION enrol_new_facts()")


def downgrade() -> None:
    op.execute("DROP TRIGGER facts_enrol_on_insert ON facts")
    op.execute("DROP FUNCTION enrol_new_facts()")
    op.add_column("facts", sa.Column("model_fingerprint", sa.String(64)))
    for name, kind in MODEL_COLUMNS:
        op.add_column("facts", sa.Column(name, kind))
    for name in COUNTERS:
        default = "false" if name == "backfill_due" else "0"
        op.add_column("facts", sa.Column(name, sa.Boolean if name == "backfill_due"
                                         else sa.Integer, nullable=False,
                                         server_default=default))
    moved = [f'"{name}"' for name, _ in MODEL_COLUMNS] + list(COUNTERS)
    op.execute(f"""
        UPDATE facts f SET model_fingerprint = k.model_fingerprint,
            {', '.join(f'{c} = k.{c}' for c in moved)}
        FROM (SELECT DISTINCT ON (fact_id) * FROM fact_kv
              ORDER BY fact_id, kv_location IS NULL, encoded_at DESC NULLS LAST) k
        WHERE k.fact_id = f.id""")
    op.execute("UPDATE facts SET model_fingerprint = NULL WHERE encoded_at IS NULL")
    op.drop_table("fact_kv")
    op.drop_table("kv_models")
    op.create_index("ix_facts_pending", "facts", ["id"],
                    postgresql_where=sa.text("kv_location IS NULL AND deleted_at IS NULL"))
    op.create_index("ix_facts_claimed", "facts", ["claimed_until"],
                    postgresql_where=sa.text("claimed_until IS NOT NULL"))
    op.create_index("ix_facts_backfill_due", "facts", ["id"],
                    postgresql_where=sa.text("backfill_due AND deleted_at IS NULL"))
    op.create_index("ix_facts_kv_held", "facts", ["user_id"],
                    postgresql_where=sa.text("kv_location IS NOT NULL AND deleted_at IS NULL"))
