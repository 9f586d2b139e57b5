"""The one error type of the deploy package."""


from serving.errors import UserError


class DeployError(UserError):
    """A deployment that cannot be rendered, planned or applied; the message names the field or object."""
