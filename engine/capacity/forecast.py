"""The traffic a plan provisions for: a request rate for each hour of the day, in a named time zone.

Sources: a CSV of `hour,rps` rows (hours 0-23 of the zone, each once) or the built-in tidal day (a low night, a
morning ramp, a peak, an evening fall). Every rate is checked at the boundary: a forecast that is empty, has a
negative or non-finite rate, misses or repeats an hour, or names a zone that does not exist is refused with the
row that is wrong, because a plan built on it would provision for traffic nobody forecast.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.scaling.policy import iana_zone


class Forecast(BaseModel):
    """Requests per second in each hour of the day (index = hour of `timezone`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hourly_rps: list[float] = Field(description="24 rates, hour 0 first")
    timezone: str = Field("UTC", description="the zone whose hours these are (an IANA name)")
    source: str = Field("", description="where the rates came from")

    @field_validator("hourly_rps")
    @classmethod
    def _day(cls, rates: list[float]) -> list[float]:
        if len(rates) != 24:
            raise ValueError(f"a forecast has one rate per hour of the day: 24, got {len(rates)}")
        for hour, rate in enumerate(rates):
            if not math.isfinite(rate) or rate < 0:
                raise ValueError(f"hour {hour}: rate {rate!r} is not a finite number >= 0")
        if not any(rates):
            raise ValueError("every hour's rate is 0: nothing to plan for")
        return rates

    _zone = field_validator("timezone")(lambda zone: iana_zone(zone))


class TidalShape(BaseModel):
    """The built-in tidal day: rates per phase, linear within the ramp and the fall."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    night_rps: float = Field(0.5, ge=0)
    peak_rps: float = Field(6.0, gt=0)
    ramp_start_h: int = Field(7, ge=0, le=23)
    peak_start_h: int = Field(10, ge=0, le=23)
    fall_start_h: int = Field(17, ge=0, le=23)
    night_start_h: int = Field(22, ge=0, le=23)

    def forecast(self, timezone: str = "UTC") -> Forecast:
        if not self.ramp_start_h < self.peak_start_h <= self.fall_start_h < self.night_start_h:
            raise ValueError("the tidal day needs ramp_start_h < peak_start_h <= fall_start_h < night_start_h")
        rates = []
        for hour in range(24):
            mid = hour + 0.5  # the rate over the hour is the one at its middle (linear phases)
            if mid < self.ramp_start_h or mid >= self.night_start_h:
                rate = self.night_rps
            elif mid < self.peak_start_h:
                rate = self.night_rps + (self.peak_rps - self.night_rps) * (mid - self.ramp_start_h) / (
                    self.peak_start_h - self.ramp_start_h)
            elif mid < self.fall_start_h:
                rate = self.peak_rps
            else:
                rate = self.peak_rps - (self.peak_rps - self.night_rps) * (mid - self.fall_start_h) / (
                    self.night_start_h - self.fall_start_h)
            rates.append(round(rate, 6))
        return Forecast(hourly_rps=rates, timezone=timezone, source="the built-in tidal day")


def from_csv(path: Path, timezone: str = "UTC") -> Forecast:
    """`hour,rps` rows (a header row is allowed), hours 0-23 of `timezone`, each exactly once."""
    try:
        lines = list(enumerate(csv.reader(Path(path).read_text().splitlines()), start=1))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"forecast {path}: cannot be read ({exc})") from None
    rows = [(n, r) for n, r in lines if r and any(c.strip() for c in r)]
    if rows and not rows[0][1][0].strip().lstrip("-").isdigit():
        rows = rows[1:]  # the header
    if not rows:
        raise ValueError(f"forecast {path}: no rows (want `hour,rps` for hours 0-23)")
    rates: dict[int, float] = {}
    for line, row in rows:
        try:
            hour, rate = int(row[0]), float(row[1])
        except (ValueError, IndexError):
            raise ValueError(f"forecast {path}: line {line} {row!r} is not `hour,rps`") from None
        if not 0 <= hour <= 23:
            raise ValueError(f"forecast {path}: line {line}: hour {hour} is not 0-23")
        if hour in rates:
            raise ValueError(f"forecast {path}: hour {hour} appears twice")
        rates[hour] = rate
    missing = sorted(set(range(24)) - set(rates))
    if missing:
        raise ValueError(f"forecast {path}: no rate for hour(s) {', '.join(map(str, missing))}")
    return Forecast(hourly_rps=[rates[h] for h in range(24)], timezone=timezone, source=str(path))
