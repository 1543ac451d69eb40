"""Runnable Kafka consumers of InferScale."""
