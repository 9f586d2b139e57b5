"""The one error type of checkpoint reading and writing."""


from serving.errors import UserError


class CheckpointError(UserError):
    """A checkpoint that cannot be read or does not match its config; the message names the file
    or tensor."""
