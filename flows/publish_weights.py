"""publish_weights: checksum + multipart upload + manifest last, then verify the stored version."""

from __future__ import annotations

from prefect import flow

from engine.offline.default_model import DEFAULT_CONFIG, write_default_model
from engine.runtime.paths import home
from flows.params import WeightsParams
from tasks.weights import publish_weights as publish_task
from tasks.weights import verify_weights


@flow(name="publish_weights", log_prints=True)
def publish_weights(params: WeightsParams = WeightsParams()) -> str:
    """Returns the version's URL; emits tideflow.weights.published (the canary's trigger) unless told not to."""
    src = params.model_dir
    if src is None:
        src = home() / "models" / f"{params.name}-seed{params.seed}"
        if not (src / "config.json").exists():
            write_default_model(src, DEFAULT_CONFIG, seed=params.seed)
    url = params.url()
    publish_task(src, url, params.name, params.version, force=params.force, announce=params.announce)
    verify_weights(url, deep=params.deep_verify)
    return url
