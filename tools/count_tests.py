"""Count the suite's tests and assertions, so that a change to the suite can show it tests no less.

    python tools/count_tests.py [tests]      # prints: tests N, assertions M (and per-kind counts)

Tests are what pytest collects (each parametrized case counts once). Assertions are counted in the
source, statically: every `assert` statement, every `pytest.raises` / `pytest.warns` call (a check
that the code raises or warns), and every `self.assert*` call. A helper's assertions count once,
where they are written, however many tests call it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path


def count_assertions(root: Path) -> dict[str, int]:
    """Per kind: `assert` statements, `pytest.raises`/`warns` uses, `self.assert*` calls."""
    counts = {"assert": 0, "raises": 0, "unittest": 0}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assert):
                counts["assert"] += 1
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if isinstance(owner, ast.Name) and owner.id == "pytest" and node.func.attr in ("raises", "warns"):
                    counts["raises"] += 1
                elif isinstance(owner, ast.Name) and owner.id == "self" and node.func.attr.startswith("assert"):
                    counts["unittest"] += 1
    return counts


def count_tests(root: Path) -> int:
    """The number of test items pytest collects under `root` (no test runs)."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(root)],
        capture_output=True, text=True,
    )
    match = re.search(r"^(\d+) tests? collected", run.stdout, re.M)
    if match is None:
        raise SystemExit(f"pytest collected nothing:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    return int(match.group(1))


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "tests")
    asserts = count_assertions(root)
    print(f"tests {count_tests(root)}, assertions {sum(asserts.values())} "
          f"({asserts['assert']} assert, {asserts['raises']} pytest.raises/warns, {asserts['unittest']} self.assert*)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
