"""Compiled programs kept on disk and loaded back without tracing: an engine's ahead-of-time
compiles (the memory plan's and warmup's: generate, chunked prefill, a scored chunk)
go through an `ExecutableStore` beside JAX's persistent compilation cache.

Why: on a warm start JAX's own cache still traces and lowers every program to find its key, and
tracing holds Python's lock: the 1B shape's 38 programs took 15.7 s of a v5e's 35.5 s warm
start-up that way (13 compile threads, one tracing at a time). A program stored under a key made
of everything that determines it loads in milliseconds.

The key: the code (every source file of the `serving` package), JAX's and jaxlib's versions, the
backend's (a TPU's names libtpu's), the XLA flags of the environment, the engine's devices (their
kind, this process's index), its config and its model's, the decodable vocabulary, the backend
ops, the program's name and static arguments, and its arguments' tree, shapes, dtypes and
placements. Anything a program reads that is not in it would load a stale executable: so the store is used only where every input is an argument or one of
those (Engine's compile sites), and the whole code is in the key rather than a version string.

A program XLA compiled in this call is stored; one JAX's own cache handed back only where such an
executable serializes whole again (`RESAVES_CACHE_HITS`: a TPU's; XLA:CPU's misses its functions
at the first run, which is why the store is for accelerators only, `PLATFORMS`), and never one
this process compiled before. A TPU's hits matter after an upgrade: the code is in the key, so
every program misses the store, and those whose HLO did not change are JAX cache hits; unstored,
each later start traced them again (on a v5e the 1B shape's warm start took 52.7 s, not 26, its
memory plan 26 programs traced one at a time).
The directory is trusted as JAX's own cache is: loading an executable runs what it holds.
A failure to load or save (a backend that cannot serialize, Pathways' proxy say, or a file cut
short) is never the caller's problem: the program compiles as it would have, each failure logged;
a directory that cannot be written stops the saving.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import shutil
import threading
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)

SUBDIR = "pathserve-executables"
KEEP = 2  # code versions (directories) kept: this one and the one before
CACHE_HIT = "/jax/compilation_cache/cache_hits"  # JAX's event for a program its cache handed back

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # ...and for one XLA compiled
PLATFORMS = ("tpu", "gpu")  # where the store is used (XLA:CPU's reloaded executables are not whole)
RESAVES_CACHE_HITS = ("tpu",)  # where an executable JAX's cache handed back is stored too (checked on a v5e)

_seen = threading.local()  # this thread's counts of those events


def _count(event: str, *_args, **_kwargs) -> None:
    if event in (CACHE_HIT, BACKEND_COMPILE):
        setattr(_seen, event, getattr(_seen, event, 0) + 1)


def _counts() -> tuple[int, int]:
    return getattr(_seen, CACHE_HIT, 0), getattr(_seen, BACKEND_COMPILE, 0)


jax.monitoring.register_event_listener(_count)
jax.monitoring.register_event_duration_secs_listener(_count)


@cache
def code_digest() -> str:
    """sha256 of every source file of the `serving` package (path and bytes), read once."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _leaf(x: Any) -> str:
    """What of an argument leaf a compiled program depends on: shape, dtype, placement."""
    if x is None:
        return "None"
    sharding = getattr(x, "sharding", None)
    return f"{tuple(np.shape(x))}:{np.dtype(getattr(x, 'dtype', type(x)))}:{sharding!r}"


def _stable(values: tuple) -> str:
    """`values` as the same text in every process: an element whose repr is an object's address
    (JAX's axis environment in its trace context) by its type's name and its attributes instead
    (an axis environment's names and sizes), or its type's name alone where those hold addresses."""

    def text(v) -> str:
        if " object at 0x" not in repr(v):
            return repr(v)
        names = [n for c in type(v).__mro__ for n in getattr(c, "__slots__", ()) if not n.startswith("__")]
        fields = repr(sorted({**{n: getattr(v, n, None) for n in names}, **getattr(v, "__dict__", {})}.items()))
        return type(v).__qualname__ + ("" if " at 0x" in fields else fields)

    return "(" + ", ".join(text(v) for v in values) + ")"


def describe(args: Any) -> str:
    """An argument tree as the key sees it: its structure and each leaf's shape, dtype, placement."""
    leaves, tree = jax.tree.flatten(args, is_leaf=lambda x: x is None)
    return f"{tree}|" + "|".join(_leaf(x) for x in leaves)


class ExecutableStore:
    """Compiled programs under `directory`/`fingerprint`/, by a key of their name and arguments."""

    def __init__(self, directory: Path, fingerprint: str, context: str, devices: list):
        """Programs under `directory`/`fingerprint` (the code, the versions, the devices: one
        directory each, the newest KEEP of them kept), keyed by `context` (the engine's configs)
        and each program's name and arguments."""
        self.directory = Path(directory) / fingerprint[:32]
        self.context = context
        self.devices = devices
        self.loaded = self.saved = self.skipped = 0
        self._saving = True
        self._lock = threading.Lock()
        _prune(Path(directory), self.directory)

    @classmethod
    def for_engine(cls, engine) -> ExecutableStore | None:
        """The store of `engine`'s programs, under JAX's persistent compilation cache directory;
        None where that cache is off."""
        cache_dir = jax.config.jax_compilation_cache_dir
        devices = list(engine.mesh.devices.flat)
        client = devices[0].client
        if not cache_dir or "://" in cache_dir or client.platform not in PLATFORMS:
            return None
        versions = (
            code_digest(), jax.__version__, jax.lib.__version__, client.platform, client.platform_version,
            devices[0].device_kind,
        )
        context = (
            str(jax.process_index()), repr([(d.id, getattr(d, "coords", None)) for d in devices]),
            repr(engine.mesh), repr(engine.config), repr(engine.model.config), str(engine.sampler.num_decodable),
            engine.ops.name, os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
            _stable(jax._src.config.trace_context()),
        )
        fingerprint = hashlib.sha256("\n".join(versions).encode()).hexdigest()
        return cls(Path(cache_dir) / SUBDIR, fingerprint, "\n".join(context), devices)

    def summary(self) -> str:
        """What the store did so far, for the log: programs loaded and saved, and where."""
        return f"executable store: {self.loaded} loaded, {self.saved} saved, {self.skipped} compiled but not saved ({self.directory})"

    def compile(self, name: str, args: Any, lower: Callable[[], Any]):
        """The program `name` of `args` (any tree of arrays, specs and host values): loaded from the
        store, else `lower()`'s compile, then stored. `name` carries the static arguments."""
        key = f"{self.context}\n{name}\n{describe(args)}"
        path = self.directory / (hashlib.sha256(key.encode()).hexdigest() + ".bin")
        compiled = self._load(path, name)
        if compiled is not None:
            return compiled
        hits, compiles = _counts()
        compiled = lower().compile()
        after = _counts()
        # stored when XLA compiled it here, or JAX's cache handed it back where that reserializes
        # whole; not one this process had already (neither event)
        hit, compiled_here = after[0] > hits, after[1] > compiles
        if (compiled_here and not hit) or (hit and self.devices[0].client.platform in RESAVES_CACHE_HITS):
            self._save(path, name, compiled)
        else:
            with self._lock:
                self.skipped += 1
            log.debug("executable store: %s not saved (%d cache hits, %d compiles in the call)", name,
                      after[0] - hits, after[1] - compiles)
        return compiled

    def _load(self, path: Path, name: str):
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            serialized, in_tree, out_tree = pickle.loads(blob)
            compiled = deserialize_and_load(
                serialized, in_tree, out_tree, backend=self.devices[0].client, execution_devices=self.devices
            )
        except Exception as exc:  # a file cut short, a backend that cannot load it: compile instead
            log.warning("executable store: %s did not load (%s: %s); compiling it", name, type(exc).__name__, exc)
            return None
        with self._lock:
            self.loaded += 1
        return compiled

    def _save(self, path: Path, name: str, compiled) -> None:
        from jax.experimental.serialize_executable import serialize

        if not self._saving:
            return
        try:
            blob = pickle.dumps(serialize(compiled))
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            partial.write_bytes(blob)
            partial.replace(path)  # whole or not at all, whoever writes it at the same time
        except OSError as exc:  # the directory: nothing more will save
            self._saving = False
            log.warning("executable store: %s could not be saved (%s); saving no more", name, exc)
            return
        except Exception as exc:  # this program (one that cannot be serialized): the next may
            log.warning("executable store: %s could not be saved (%s: %s)", name, type(exc).__name__, exc)
            return
        with self._lock:
            self.saved += 1


def _prune(parent: Path, current: Path) -> None:
    """Mark `current` as used now and remove all but the KEEP most recently used directories of
    `parent` (an upgrade's or a code change's programs never load again)."""
    try:
        current.mkdir(parents=True, exist_ok=True)
        os.utime(current)
        dirs = sorted((d for d in parent.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime, reverse=True)
    except OSError:
        return
    for old in dirs[KEEP:]:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)


class InFlight:
    """The programs being compiled now, by key, from any thread: a compile thread asked for a
    program another one is compiling waits for it instead of compiling it too. (The memory plan
    and warmup compile in one pool of the host's cores, and the plan's largest programs are
    warmup's too: on a v5e host's 13 threads each would start twice at once.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[Any, threading.Event] = {}

    def claim(self, key: Any) -> threading.Event | None:
        """None: the caller now compiles `key` and must `release` it (in a finally). Otherwise the
        event of the thread compiling it: wait for it, then look for the program again (it is
        absent where that compile failed: then claim it again)."""
        with self._lock:
            event = self._events.get(key)
            if event is None:
                self._events[key] = threading.Event()
            return event

    def release(self, key: Any) -> None:
        """`key` compiled (or failed): its waiters go on."""
        with self._lock:
            event = self._events.pop(key)
        event.set()

    def once(self, key: Any, found: Callable[[], tuple[bool, Any]], make: Callable[[], Any]) -> Any:
        """What `found()` gives as (True, value) once `key`'s program is there; else `make()`'s, run
        by one thread at a time for `key` (one that came while another compiled it waits, then looks
        again; the claimer looks once more, in case it was stored between its look and its claim)."""
        while True:
            there, value = found()
            if there:
                return value
            if (other := self.claim(key)) is None:
                break
            other.wait()
        try:
            there, value = found()
            return value if there else make()
        finally:
            self.release(key)
