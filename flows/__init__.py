"""Prefect flow graphs over the tasks; one file per graph."""
