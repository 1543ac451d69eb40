"""Benchmarks: each prints a table and writes JSON next to its baseline, measured in one run."""
