"""The one error type of the deploy package."""


class DeployError(ValueError):
    """A deployment that cannot be rendered, planned or applied; the message names the field or object."""
