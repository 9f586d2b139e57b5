"""The engine: JetStream's contract (prefill, insert, generate over decode slots) on a device mesh."""

from serving.engine.engine import DecodeState, Engine, Prefix, ResultTokens

__all__ = ["DecodeState", "Engine", "Prefix", "ResultTokens"]
