"""What a load drill is asked to do (LoadDrillSpec), validated at the boundary."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from drills.lengths import LengthDistribution


class LoadDrillSpec(BaseModel):
    """One drill against one OpenAI-compatible endpoint: a single rate, rising steps, or a trace replay."""

    url: str = Field(description="server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is optional)")
    model: str = Field(min_length=1, description="model id sent in every request")
    api_key_env: str | None = Field(None, description="name of the env var holding the API key (never the key)")
    endpoint: Literal["completions", "chat"] = Field("completions", description="/v1/completions or /v1/chat/completions")
    rate: float | None = Field(None, gt=0, description="single-step mode: offered requests per second")
    duration_s: float | None = Field(None, gt=0, description="single-step mode: seconds of arrivals")
    steps: list[float] | None = Field(None, min_length=1, description="step mode: offered rates (req/s), in order")
    hold_s: float | None = Field(None, gt=0, description="step mode: seconds of arrivals per step")
    arrival: Literal["poisson", "constant"] = Field("poisson", description="inter-arrival law within a step")
    prompt_len: LengthDistribution = Field(default_factory=lambda: LengthDistribution.parse("uniform:16:64"),
                                           description="prompt tokens per request")
    output_len: LengthDistribution = Field(default_factory=lambda: LengthDistribution.parse("fixed:32"),
                                           description="max_tokens per request")
    trace: Path | None = Field(None, description="JSONL of {prompt, max_tokens, arrival_s?}; replaces the distributions")
    tokenizer_dir: Path | None = Field(None, description="checkpoint dir whose tokenizer calibrates prompt lengths exactly")
    temperature: float | None = Field(None, ge=0, le=2, description="sampling temperature sent (None = the server's "
                                                                    "default; 0 = greedy, answers that can be replayed)")
    ignore_eos: bool = Field(True, description="ask the server to generate all max_tokens (vLLM-style extra field)")
    slo_ttft_ms: float | None = Field(None, gt=0, description="time-to-first-token SLO; None = not checked")
    slo_tpot_ms: float | None = Field(None, gt=0, description="time-per-output-token SLO; None = not checked")
    slo_quantile: float = Field(0.9, gt=0, lt=1, description="a step holds its SLOs when this quantile is within them")
    max_error_rate: float = Field(0.01, ge=0, le=1, description="a step holds only with an error rate below this")
    max_in_flight: int = Field(1024, ge=1, description="open requests allowed; arrivals over it are counted as errors")
    request_timeout_s: float = Field(60.0, gt=0, description="a request still open after this is an error")
    seed: int = Field(0, description="seeds arrivals, lengths and prompt words")
    flow_run_id: str | None = Field(None, pattern=r"^[0-9a-fA-F-]{1,64}$",
                                    description="the Prefect flow run sending this load: every request carries it in "
                                                "its W3C baggage, so the fleet's traces name the run")
    expectations_suite: Path | Literal["packaged"] | None = Field(
        "packaged", description="GX suite (JSON) the step table must pass; packaged: drills/load_drill_suite.json; "
                                "None = skip")
    out_dir: Path | None = Field(None, description="where the CSV, JSON and PNG reports go; None = not written")
    progress_bar: bool = Field(True, description="tqdm bar on stderr")

    @field_validator("prompt_len", "output_len", mode="before")
    @classmethod
    def _parse_length(cls, v: object) -> object:
        return LengthDistribution.parse(v) if isinstance(v, str) else v

    @field_validator("steps")
    @classmethod
    def _positive_steps(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and any(r <= 0 for r in v):
            raise ValueError("every step rate must be > 0")
        return v

    @model_validator(mode="after")
    def _one_mode(self) -> LoadDrillSpec:
        single = self.rate is not None or self.duration_s is not None
        stepped = self.steps is not None or self.hold_s is not None
        if single and stepped:
            raise ValueError("give either rate+duration_s or steps+hold_s, not both")
        if single and (self.rate is None or self.duration_s is None):
            raise ValueError("rate and duration_s go together")
        if stepped and (self.steps is None or self.hold_s is None):
            raise ValueError("steps and hold_s go together")
        if not (single or stepped) and self.trace is None:
            raise ValueError("give rate+duration_s, steps+hold_s, or a trace with arrival_s")
        return self

    @property
    def base_url(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"

    @property
    def step_rates(self) -> list[float]:
        """Offered rate of each step (empty for a timed trace replay)."""
        if self.steps is not None:
            return list(self.steps)
        return [self.rate] if self.rate is not None else []

    @property
    def step_hold_s(self) -> float:
        return self.hold_s if self.hold_s is not None else (self.duration_s or 0.0)
