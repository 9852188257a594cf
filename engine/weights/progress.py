"""Progress of a transfer: a terminal bar (tqdm) and an optional callback (the Prefect task's hook)."""

from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm


class Progress(BaseModel):
    """A snapshot sent after each part is done (in file order)."""

    model_config = ConfigDict(frozen=True)

    action: Literal["publish", "verify", "pull"] = Field(..., description="what is running")
    path: str = Field(..., description="file the last part belonged to")
    bytes_done: int = Field(..., ge=0, description="bytes processed so far, all files")
    bytes_total: int = Field(..., ge=0, description="bytes to process, all files")
    parts_sent: int = Field(0, ge=0, description="parts uploaded or downloaded so far")
    parts_reused: int = Field(0, ge=0, description="parts found already stored / cached and kept")


ProgressCallback = Callable[[Progress], None]


class ProgressReporter:
    """Accumulates counts, feeds the bar and calls the callback."""

    def __init__(
        self, action: str, bytes_total: int, callback: ProgressCallback | None, show_bar: bool
    ):
        self.action = action
        self.bytes_total = bytes_total
        self.callback = callback
        self.bytes_done = 0
        self.parts_sent = 0
        self.parts_reused = 0
        # disable=None hides the bar when stderr is not a terminal.
        self.bar = tqdm(
            total=bytes_total, unit="B", unit_scale=True, unit_divisor=1024,
            desc=action, disable=None if show_bar else True, leave=False,
        )

    def part(self, path: str, nbytes: int, *, sent: bool) -> None:
        self.bytes_done += nbytes
        if sent:
            self.parts_sent += 1
        else:
            self.parts_reused += 1
        self.bar.update(nbytes)
        if self.callback is not None:
            self.callback(Progress(
                action=self.action, path=path, bytes_done=self.bytes_done,
                bytes_total=self.bytes_total, parts_sent=self.parts_sent,
                parts_reused=self.parts_reused,
            ))

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "ProgressReporter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
