"""`pathserve ARGS` for tests, two ways: a real subprocess, or `serving.cli.main(argv)` in this process.

A subprocess is what a user runs: a fresh interpreter, JAX imported and initialised again (seconds
each), signals, exit codes as the shell sees them. Use it where the process itself is under test
(a model's run, a server, the environment a command starts with). A test that checks only how
arguments are parsed, which error names which field, or what a command that needs no model prints,
calls `call_cli`: the same `main(argv)`, its stdout, stderr and exit code, in milliseconds.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping

__all__ = ["call_cli", "run_cli"]


def run_cli(
    *args: str,
    stdin: str | None = None,
    env: Mapping[str, str | None] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """`python -m serving.cli ARGS` in a subprocess; `env` over this process's environment (a value
    None removes the variable)."""
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-m", "serving.cli", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=timeout,
        env=_environment(env),
    )


def call_cli(
    *args: str, stdin: str | None = None, env: Mapping[str, str | None] | None = None
) -> subprocess.CompletedProcess:
    """`serving.cli.main(ARGS)` in this process, as `run_cli` reports it: the exit code (argparse's
    SystemExit included), and what it wrote to stdout and stderr. `env` applies for the call only."""
    from serving.cli import main

    out, err = io.StringIO(), io.StringIO()
    with _patched_environ(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        saved_stdin = sys.stdin
        sys.stdin = io.StringIO(stdin or "")
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, int | None):
                print(exc.code, file=sys.stderr)
        finally:
            sys.stdin = saved_stdin
    return subprocess.CompletedProcess(["pathserve", *args], code, out.getvalue(), err.getvalue())


def _environment(env: Mapping[str, str | None] | None) -> dict[str, str]:
    return {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}


@contextlib.contextmanager
def _patched_environ(env: Mapping[str, str | None] | None) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(_environment(env))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
