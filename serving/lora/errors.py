"""The adapters' errors: both name the adapter (and the tensor or key at fault)."""

from serving.errors import UserError


class AdapterError(UserError):
    """An adapter that cannot be read or does not fit the base model (or max_lora_rank)."""


class UnknownAdapterError(UserError):
    """A request or an unload naming an adapter the server does not know (HTTP 404, NOT_FOUND)."""

    def __init__(self, name: str):
        super().__init__(f"The model `{name}` does not exist: no base model or LoRA adapter of that name")
        self.name = name
