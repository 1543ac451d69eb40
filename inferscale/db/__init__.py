"""Postgres + pgvector persistence: table definitions, engine and queries."""
