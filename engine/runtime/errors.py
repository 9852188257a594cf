"""Exceptions a user can act on; each message names the offending field or file. Also how a member process
says why it ended: its exit status."""

import logging
import os
from typing import NoReturn


# Exit statuses of a member process that say why it ended, so the group manager can count failures by reason.
EXIT_WEIGHTS = 3  # its weights could not be pulled or failed verification
EXIT_PEER_LOST = 70  # a DEP rank whose instance can no longer step together
EXIT_ENGINE_FAILED = 1  # the engine thread ended on an error (counted as "failed")


def exit_member(status: int, why: str, exc_info: bool = False) -> NoReturn:
    """Leave now, with nothing that could hang on the way out, so the group manager sees the member gone and
    rebuilds its group whole; `status` tells it why."""
    logging.getLogger("engine.member").critical("%s; exiting so the group is rebuilt", why, exc_info=exc_info)
    logging.shutdown()
    os._exit(status)


class TideflowError(Exception):
    """Base of every error tideflow raises on purpose."""


class CheckpointError(TideflowError):
    """A checkpoint directory cannot be loaded as the model its config describes."""
