"""What a step of this engine costs per token, learned from its own steps, and the prefill budget that keeps a step
within its target while sequences decode.

Why: every decoding stream waits for the step to end before it gets its next token, so a step's length is the
inter-token latency of all of them. A fixed token budget (max_batch_tokens) is a second on two CPU cores and a few
milliseconds on a GPU: no one constant fits every host. The budget here comes from a time target and the time per
token this engine measured (Sarathi-Serve's stall-free batching derives its token budget from the TBT target the
same way, from profiling). It matters most when many prompts land at once on a member that is decoding: the
streams a failed member's requests moved from (each re-prefills its prompt and answer so far), a burst, a long
prompt; their prefill is spread over several short steps instead of one long one that stalls every stream.

Only steps of at least LEARN_TOKENS tokens teach (a step of a few decodes is mostly fixed overhead, which would make
a token look dear); the estimate follows the host's speed (a rebuild loading beside it, thermal limits) as a
moving average. A prompt always advances by MIN_CHUNK tokens a step, so none starves however slow the host.
"""

from __future__ import annotations

LEARN_TOKENS = 64
MIN_CHUNK = 64
ALPHA = 0.2  # weight of the newest step in the moving average


class StepCost:
    """Written and read by the engine thread only."""

    def __init__(self, target_s: float | None) -> None:
        self.target_s = target_s
        self.s_per_token: float | None = None  # None until a step of LEARN_TOKENS taught it

    def learn(self, tokens: int, took_s: float) -> None:
        if tokens < LEARN_TOKENS or took_s <= 0:
            return
        per_token = took_s / tokens
        self.s_per_token = per_token if self.s_per_token is None else (1 - ALPHA) * self.s_per_token + ALPHA * per_token

    def budget(self, max_tokens: int, decoding: int) -> int:
        """Tokens the next step may hold: all of `max_tokens` when nothing decodes (nobody waits on the step) or
        before the cost is known; else what fits the target, never less than every decode plus MIN_CHUNK."""
        if self.target_s is None or self.s_per_token is None or decoding == 0:
            return max_tokens
        fits = int(self.target_s / self.s_per_token)
        return min(max_tokens, max(fits, decoding + MIN_CHUNK))
