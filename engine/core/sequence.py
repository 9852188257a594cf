"""One request's life inside the engine: its tokens, its blocks, how far its KV is computed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.core.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens are prompt + generated; `num_computed` of them have K/V in `block_table`.

    A sequence with every token but the last computed is decoding; fewer means it is
    (re)filling — a new prompt, a chunked prefill in progress, or a recompute after preemption.
    """

    request_id: str
    prompt_tokens: list[int]
    params: SamplingParams
    seed: int | None = None  # engine.core.sampling_params.resolve_seed: None for greedy requests
    arrival: float = field(default_factory=time.monotonic)
    departed_at: float | None = None  # left the shuttle window (monotonic s): the times a trace shows
    imported_at: float | None = None  # its KV came in from prefill (a decode worker)
    scheduled_at: float | None = None  # its first step began
    output_tokens: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_prompt: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted: bool = False
    finish_reason: str | None = None
    handoff: object | None = None  # engine.core.pd.Handoff: a decode worker continues after the first token
    block_extras: dict[int, bytes] = field(default_factory=dict)  # block index -> image hashes folded into its hash
    client: str = ""  # who asked (a digest of the API key): the scheduler shares steps, slots and blocks by client

    @property
    def tokens(self) -> list[int]:
        return self.prompt_tokens + self.output_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_tokens) + len(self.output_tokens)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def reset_computed(self) -> None:
        """Forget the KV state (after its blocks were freed): everything is recomputed as prompt."""
        self.block_table = []
        self.block_hashes = []
        self.num_computed = 0
