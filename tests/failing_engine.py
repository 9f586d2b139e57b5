"""The mock engine that loses its device: its generate calls raise once `calls` of them ran (the
device loop then fails under whatever it serves). Shared by the tests of what each surface answers
for a request the engine could not finish."""

from __future__ import annotations

from serving.engine.mock import MockEngine


class FailsAfter(MockEngine):
    def __init__(self, calls: int, **kwargs):
        super().__init__(**kwargs)
        self.left = calls

    def generate(self, *args, **kwargs):
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("device lost (a test's failure)")
        return super().generate(*args, **kwargs)
