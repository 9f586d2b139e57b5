"""The one error type of checkpoint reading and writing."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match its config; the message names the file
    or tensor."""
