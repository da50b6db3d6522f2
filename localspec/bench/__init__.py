"""Benchmark scripts (not tests): each prints a table and writes JSON."""
