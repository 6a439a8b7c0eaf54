"""Benchmarks: each script compares two ways of doing one thing; run one as `python -m benchmarks.<name>`."""
