"""Thin Prefect flows that compose tasks into the release pipelines."""
