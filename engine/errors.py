"""Exceptions a user can act on; each message names the offending field or file."""


# Exit statuses of a member process that say why it ended, so the group manager can count failures by reason.
EXIT_WEIGHTS = 3  # its weights could not be pulled or failed verification
EXIT_PEER_LOST = 70  # a DEP rank whose instance can no longer step together


class TideflowError(Exception):
    """Base of every error tideflow raises on purpose."""


class CheckpointError(TideflowError):
    """A checkpoint directory cannot be loaded as the model its config describes."""
