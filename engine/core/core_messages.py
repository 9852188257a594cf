"""What API server processes and the engine-core process say to each other, as msgspec structs sent as msgpack.

Why msgspec: a decode step of 32 streams sends 32 outputs; msgspec encodes and decodes them as plain tuples
(`array_like`) in a few microseconds, with the types checked on the way in, where pydantic would take ten
times that on the core's hot path. Each message names its kind with a tag, so one decoder reads any of them.

API server -> core (over a DEALER socket to the core's ROUTER): `Hello`, `Add`, `Abort`, `Call`, `Beat`.
Core -> API server (PUSH to the PULL socket each API server binds): `Outputs`, `Reply`, `State`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.core.sampling_params import Logprob


class Hello(msgspec.Struct, tag="hello"):
    """An API server introduces itself: where it takes outputs (its PULL socket's address)."""

    output_address: str


class Add(msgspec.Struct, tag="add"):
    """A new request; `params` is engine.core.sampling_params.SamplingParams as a dict, `resume` a Resume as a dict."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    resume: dict[str, Any] | None = None
    client: str = ""  # who asked: the scheduler shares the engine between clients


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Call(msgspec.Struct, tag="call"):
    """A control call (engine.core.core_process.CALLS), answered by a `Reply` with the same id; `call_id` 0 wants
    no answer."""

    call_id: int
    name: str
    args: list[Any] = []


class Beat(msgspec.Struct, tag="beat"):
    """An API server is alive: the core aborts the requests of one silent for CLIENT_TIMEOUT_S. It carries the
    output address again, so one taken for gone (stalled, not dead) is served again from its next beat."""

    output_address: str


class Output(msgspec.Struct, array_like=True):
    """engine.core.outputs.RequestOutput without text: the API server makes the text."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None
    seed: int | None = None
    status: int = 0  # an Add the core refused: the HTTP status to answer (429 queue full, 400 too long)
    logprobs: list[Logprob] | None = None  # one per token id, when the request asked for them
    timeline: list[int] | None = None  # on the last output: engine.telemetry.tracing.Timeline's fields


class Outputs(msgspec.Struct, tag="outputs"):
    """Every output for one API server the core had at hand (a step's, mostly), with the core's load figures."""

    outputs: list[Output]
    stats: dict[str, int]


class Reply(msgspec.Struct, tag="reply"):
    call_id: int
    value: Any = None
    error: str | None = None
    status: int = 0


class State(msgspec.Struct, tag="state"):
    """The core's heartbeat: sent every BEAT_S to each API server, so one can tell a live core from a hung one."""

    ready: bool
    stats: dict[str, int]
    failure: str | None = None


ToCore = Hello | Add | Abort | Call | Beat
FromCore = Outputs | Reply | State

BEAT_S = 0.2  # both ways
CLIENT_TIMEOUT_S = 5.0  # an API server silent this long is gone: its requests are aborted, their KV freed


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def to_core_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToCore)


def from_core_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(FromCore)
