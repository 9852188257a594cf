"""Thin Prefect tasks: one verb each, calling engine/ or tideflow_kernels/."""
