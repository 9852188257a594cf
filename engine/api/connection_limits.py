"""The bounds on reads every tideflow server applies (engine.api.connections, engine.api.limits.BodyLimit),
modelled once and taken as the same flags by every server's command. Light on purpose (no uvicorn): each
command's parser is built on every `tideflow` call."""

from __future__ import annotations

import argparse

from pydantic import BaseModel, Field, ValidationError

from engine.api.limits import DEFAULT_BODY_TIMEOUT_S


class ConnectionLimits(BaseModel):
    """One server's bounded reads; each field is also its flag (`--header-timeout-s`...)."""

    header_timeout_s: float = Field(10.0, gt=0, description="a request's line and headers arrive within this many "
                                                            "seconds (408, then closed)")
    body_timeout_s: float = Field(DEFAULT_BODY_TIMEOUT_S, gt=0, description="a request body's next bytes arrive "
                                                                            "within this many seconds (408)")
    max_connections_per_address: int = Field(256, ge=1, description="open connections one client address may hold "
                                                                     "(503 at connect beyond)")


def _checked_as(name: str):
    """An argparse type that checks a flag as the model checks its field, so a bad value is a usage error."""

    def parse(text: str):
        try:
            return getattr(ConnectionLimits.model_validate({name: text}), name)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc.errors()[0]['msg']}") from None

    return parse


def add_arguments(parser: argparse.ArgumentParser, **default_notes: str) -> None:
    """ConnectionLimits' fields as flags, with the model's descriptions and defaults; `default_notes` names a
    server's own default where it is not the model's (a member's connection cap)."""
    for name, field in ConnectionLimits.model_fields.items():
        parser.add_argument("--" + name.replace("_", "-"), type=_checked_as(name), default=None,
                            help=f"{field.description}; default {default_notes.get(name, field.default)}")


def from_args(args: argparse.Namespace, **defaults: float) -> ConnectionLimits:
    """ConnectionLimits from the flags that were given; the others take `defaults`, else the model's."""
    given = {name: getattr(args, name) for name in ConnectionLimits.model_fields if getattr(args, name) is not None}
    return ConnectionLimits(**{**defaults, **given})
