"""A job's custom_ids are unique across its input, as OpenAI's batch API requires: a reader matches
each record to its request by custom_id, and two lines under one id make that ambiguous.

Checked while the plan reads the input, before any row runs: one json.loads per line (5.5 s for
a million 300-byte lines on one core, where reading them took 0.4 s; serving them takes hours)
and 8 bytes per line for the id's hash. Only when a hash comes up twice is the input read again,
to find those lines and compare their ids whole (two ids may share a hash).
"""

from __future__ import annotations

from array import array
from collections import defaultdict

import numpy as np

from serving.batch import files, rows
from serving.batch.errors import BatchError

SHOWN = 5  # duplicate ids named in the error


class CustomIds:
    """The hashes of the custom_ids of an input's lines (lines without one of their own skipped)."""

    def __init__(self) -> None:
        self.hashes = array("q")  # hash() of str: stable within this process, which both reads are in

    def add(self, line: bytes) -> None:
        if (custom_id := rows.custom_id_of(line)) is not None:
            self.hashes.append(hash(custom_id))

    def check(self, urls: list[str]) -> None:
        """Raise BatchError naming the custom_ids on more than one line of the files at `urls` (the
        files these hashes were taken from, in order) and their lines."""
        ordered = np.sort(np.frombuffer(self.hashes, dtype=np.int64))
        repeated = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())
        if not repeated:
            return
        where: dict[str, list[str]] = defaultdict(list)
        for url in urls:
            for number, line in enumerate(files.lines(url), 1):
                custom_id = rows.custom_id_of(line)
                if custom_id is not None and hash(custom_id) in repeated:
                    where[custom_id].append(f"{url} line {number}")
        duplicates = {custom_id: lines for custom_id, lines in where.items() if len(lines) > 1}
        if not duplicates:
            return
        named = "; ".join(
            f"{custom_id[:100]!r} on {', '.join(lines[:3])}"
            + (f" and {len(lines) - 3} more" if len(lines) > 3 else "")
            for custom_id, lines in list(duplicates.items())[:SHOWN]
        )
        more = f" (and {len(duplicates) - SHOWN} more ids)" if len(duplicates) > SHOWN else ""
        raise BatchError(
            f"--input: each custom_id must be on one line only (a record is matched to its request by it): {named}{more}"
        )
