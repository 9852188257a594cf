"""Heartbeats on the answers a member sends the router: what lets the router tell a member at work (a long prompt
being computed) from one that stopped (a hung step, a stopped process, a lost network), within its stall timeout
(`tideflow router --stall-timeout-s`, 1.5 s) and without a timeout long enough for the slowest prompt.

Each HEARTBEAT_S without anything to send, an answer to the router carries a heartbeat if the engine is live
(between steps, or in one within its budget: engine/core/step_clock.py): an SSE comment on a stream, a space
before a JSON body (JSON allows leading whitespace). A stopped member sends nothing, a stuck engine stops the
heartbeats, and the router moves the request on.
"""

from __future__ import annotations

from typing import AsyncIterator

from engine.core.outputs import RequestOutput, RequestStream

HEARTBEAT_S = 0.5
SSE_HEARTBEAT = ": live\n\n"
JSON_HEARTBEAT = b" "
# An answer that carries heartbeats says so in this response header (its value: HEARTBEAT_S): the router holds
# only those to its stall timeout, so a member of an older version in a rolling upgrade is not taken for stopped
# whenever it computes a prompt for longer than the timeout.
HEARTBEAT_HEADER = "x-tideflow-heartbeat"
HEARTBEAT_HEADERS = {HEARTBEAT_HEADER: str(HEARTBEAT_S)}


async def paced(stream: RequestStream, heartbeats: bool) -> AsyncIterator[RequestOutput | None]:
    """The stream's outputs; with `heartbeats`, also None each HEARTBEAT_S that brought none."""
    if not heartbeats:
        async for out in stream:
            yield out
        return
    while True:
        out = await stream.next(HEARTBEAT_S)
        yield out
        if out is not None and out.finished:
            return
