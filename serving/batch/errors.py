"""Errors of a batch job the user can fix (bad URL, changed arguments); the CLI prints them."""


from serving.errors import UserError


class BatchError(UserError):
    """The job cannot run as asked; the message names the input, output or argument."""


class IncompleteError(BatchError):
    """The run ended with shards not done (claims lost, renewals failing): the message names them."""
