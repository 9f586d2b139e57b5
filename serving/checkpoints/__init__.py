"""Offline checkpoint tooling: read Hugging Face safetensors and GGUF files into the params pytree.

Uses the model's params layout, never the server.
"""

from serving.checkpoints.errors import CheckpointError

__all__ = ["CheckpointError"]
