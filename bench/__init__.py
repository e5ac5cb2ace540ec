"""Benchmarks and the demo: scripts that print tables (not run by CI)."""
