"""pathserve: LLM inference serving in JAX, in the style of JetStream on Pathways."""

__version__ = "0.1.0"
