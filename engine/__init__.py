"""tideflow's inference engine: model, KV cache, scheduler, workers, router, groups (no Prefect here)."""

__version__ = "0.1.0"
