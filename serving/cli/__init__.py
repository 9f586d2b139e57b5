"""The `pathserve` command line."""

from serving.cli.main import main

__all__ = ["main"]
