"""Evaluation and promotion: evaluation during training, a checkpoint evaluated apart from its run, promotion of a
checkpoint with every decision on record, and sweeps of config variants compared."""
