"""Flow parameters as pydantic models, so the Prefect UI renders typed forms with defaults."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field



class WeightsParams(BaseModel):
    """A checkpoint to publish as a named version."""

    model_dir: Path | None = Field(None, description="checkpoint directory; default: the default model, written when missing")
    name: str = Field("default", pattern=r"^[a-z0-9][a-z0-9._-]*$", description="model name in the store")
    version: str = Field("v1", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="version to publish")
    store_url: str | None = Field(None, description="s3://bucket/prefix/ or file:///path/; default: the embedded filesystem store")
    seed: int = Field(0, description="seed of the default model's weights (when model_dir is unset)")
    force: bool = Field(False, description="overwrite a version that exists with other content")
    deep_verify: bool = Field(False, description="re-hash every byte when verifying")
    announce: bool = Field(True, description="emit tideflow.weights.published, which starts the canary-release "
                                             "deployment's trigger; a release publishes without it (it runs its own canary)")

    def url(self) -> str:
        from engine.weights import default_store_url

        if self.store_url is None:
            return default_store_url(self.name, self.version)
        return self.store_url.rstrip("/") + f"/models/{self.name}/{self.version}/"


class DeployParams(BaseModel):
    """A group to bring up from a spec file, serving a published weights version."""

    spec_file: Path = Field(Path("deployments/groups/tiny-pd.yaml"), description="InferenceGroup spec (YAML)")
    name: str | None = Field(None, description="group name (default: the spec's)")
    version: str | None = Field(None, description="group version (default: the spec's)")
    weights_url: str | None = Field(None, description="published version to pull into the node cache")
    weight: float = Field(1.0, ge=0, description="traffic weight once Ready (0 = registered, no traffic)")
    ready_timeout_s: float = Field(600.0, gt=0, description="how long members may take to become Ready")
