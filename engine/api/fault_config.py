"""What a member's fault injection breaks (engine/server/faults.py applies it): a leaf, so that a group spec can
carry a member's faults without importing the member's server."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class FaultConfig(BaseModel):
    """What to break; the defaults break nothing."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    error_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of completion/chat requests answered with HTTP 500")
    token_delay_s: float = Field(0.0, ge=0.0, le=10.0, description="extra delay before each output of a request (slows TTFT and TPOT)")
    seed: int = Field(0, description="seed of the RNG that picks the failed requests")

    @classmethod
    def parse(cls, text: str) -> "FaultConfig":
        """A FaultConfig from inline JSON or from the path of a JSON file; ValueError names the field."""
        source = text if text.lstrip().startswith("{") else _read(text)
        try:
            return cls.model_validate(json.loads(source))
        except json.JSONDecodeError as exc:
            raise ValueError(f"--faults is not valid JSON: {exc}") from None
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "faults"
            raise ValueError(f"--faults: {where}: {first['msg']}") from None


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--faults: cannot read {path}: {exc}") from None
