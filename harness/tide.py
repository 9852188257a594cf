"""A tidal day compressed into minutes: request rates per phase, a JSONL trace of it, and its schedule.

Phases follow a service's day: low night, morning ramp, peak, evening fall, night again. The trace
is what the load generator replays (`LoadDrillSpec.trace`), with arrival times from a Poisson
process whose rate follows the phases (linear within the ramp and the fall).
"""

from __future__ import annotations

import json
from datetime import datetime, time, timedelta, timezone
from pathlib import Path
from time import monotonic

import numpy as np
from pydantic import BaseModel, Field

from drills.workload import VOCABULARY
from engine.scaling.policy import Schedule, ScheduleEntry

DAY_S = 86_400.0


class TidalDay(BaseModel):
    """Rates (requests per real second of the replay) and phase boundaries (hours of the virtual day)."""

    day_s: float = Field(120.0, gt=0, description="real seconds one virtual day lasts")
    night_rps: float = Field(0.5, gt=0, description="rate at night")
    peak_rps: float = Field(6.0, gt=0, description="rate at the peak")
    ramp_start_h: float = Field(7.0, ge=0, lt=24, description="morning ramp begins")
    peak_start_h: float = Field(10.0, ge=0, lt=24, description="peak begins (end of the ramp)")
    fall_start_h: float = Field(17.0, ge=0, lt=24, description="evening fall begins")
    night_start_h: float = Field(22.0, ge=0, lt=24, description="night begins (end of the fall)")
    spike_start_h: float | None = Field(None, ge=0, lt=24, description="an unforecast burst begins (None: no burst)")
    spike_hours: float = Field(1.2, gt=0, le=24, description="how long the burst lasts (1.2 h: 5 % of the day)")
    spike_factor: float = Field(3.0, ge=1, description="the burst multiplies the rate by this")
    prompt_words: int = Field(24, ge=1, description="words (about tokens) per prompt")
    max_tokens: int = Field(32, ge=1, description="tokens asked per request")

    def phase(self, hour: float) -> str:
        if hour < self.ramp_start_h or hour >= self.night_start_h:
            return "night"
        if hour < self.peak_start_h:
            return "ramp"
        return "peak" if hour < self.fall_start_h else "fall"

    def rate(self, hour: float) -> float:
        """The tide's rate at `hour`, times the burst's factor inside the burst."""
        if self.spike_start_h is not None and (hour - self.spike_start_h) % 24 < self.spike_hours:
            return self.spike_factor * self.tide(hour)
        return self.tide(hour)

    def tide(self, hour: float) -> float:
        """The rate the tide alone gives at `hour` (what a forecast knows)."""
        phase = self.phase(hour)
        if phase == "night":
            return self.night_rps
        if phase == "peak":
            return self.peak_rps
        a, b = (self.ramp_start_h, self.peak_start_h) if phase == "ramp" else (self.night_start_h, self.fall_start_h)
        return self.night_rps + (self.peak_rps - self.night_rps) * (hour - a) / (b - a)

    def hour_at(self, t_s: float) -> float:
        """Virtual hour of the day `t_s` real seconds into the replay."""
        return (t_s / self.day_s * 24.0) % 24.0

    def arrivals(self, seed: int = 0) -> list[float]:
        """Real-second arrival times over one day: Poisson thinning against the peak rate."""
        rng = np.random.default_rng(seed)
        top = max(self.peak_rps, self.night_rps) * (self.spike_factor if self.spike_start_h is not None else 1.0)
        t, out = 0.0, []
        while True:
            t += rng.exponential(1.0 / top)
            if t >= self.day_s:
                return out
            if rng.random() < self.rate(self.hour_at(t)) / top:
                out.append(t)

    def write_trace(self, path: Path, seed: int = 0) -> int:
        """The day as a JSONL trace (prompt, max_tokens, arrival_s); returns the number of requests."""
        rng = np.random.default_rng(seed + 1)
        lines = []
        for t in self.arrivals(seed):
            words = " ".join(VOCABULARY[i] for i in rng.integers(len(VOCABULARY), size=self.prompt_words))
            lines.append(json.dumps({"prompt": words, "max_tokens": self.max_tokens, "arrival_s": round(t, 4)}))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        return len(lines)

    def schedule(self, night: int, ramp: int, peak: int, fall: int, night_floor: int = 0) -> Schedule:
        """Targets per phase (UTC), with the night floor below the bounds' minimum."""
        def at(h: float) -> time:
            return (datetime(2000, 1, 1) + timedelta(hours=h)).time()

        return Schedule(timezone="UTC", entries=[
            ScheduleEntry(at=at(self.night_start_h), groups=night, floor=night_floor),
            ScheduleEntry(at=at(self.ramp_start_h), groups=ramp),
            ScheduleEntry(at=at(self.peak_start_h), groups=peak),
            ScheduleEntry(at=at(self.fall_start_h), groups=fall)])


class CompressedClock:
    """Wall time of the virtual day: midnight UTC at `start`, `day_s` real seconds per day."""

    def __init__(self, day: TidalDay, start_monotonic: float) -> None:
        self.day, self.start = day, start_monotonic
        self.midnight = datetime(2024, 1, 1, tzinfo=timezone.utc)

    def __call__(self, now_monotonic: float | None = None) -> datetime:
        elapsed = (monotonic() if now_monotonic is None else now_monotonic) - self.start
        return self.midnight + timedelta(seconds=elapsed * DAY_S / self.day.day_s)
