"""Exceptions a user can act on; each message names the offending field or file."""


class TideflowError(Exception):
    """Base of every error tideflow raises on purpose."""


class CheckpointError(TideflowError):
    """A checkpoint directory cannot be loaded as the model its config describes."""
