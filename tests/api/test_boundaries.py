"""The HTTP layer talks to the orchestrator only: importing it (and the server) loads no JAX."""

from __future__ import annotations

import subprocess
import sys


def test_the_api_and_server_modules_import_no_jax():
    code = (
        "import sys, serving.api.app, serving.api.gate, serving.api.prometheus, serving.api.server;"
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"
