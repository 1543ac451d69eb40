"""Run the alembic migrations programmatically (``inferscale db upgrade``).

The migrations ship in the wheel as ``inferscale.migrations`` (the repository's
``migrations/``), so a plain install migrates as an editable one does (the repository's
``alembic.ini`` serves plain ``alembic``)."""

from __future__ import annotations

from importlib.resources import files

from alembic import command
from alembic.config import Config


def alembic_config(database_url: str) -> Config:
    """Alembic config for this project's migrations against ``database_url``."""
    config = Config()
    config.set_main_option("script_location", str(files("inferscale.migrations")))
    config.attributes["database_url"] = database_url
    config.attributes["configure_logger"] = False
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Migrate the schema up to ``revision``."""
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    """Migrate the schema down to ``revision``."""
    command.downgrade(alembic_config(database_url), revision)
