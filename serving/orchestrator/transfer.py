"""Moves between the two process groups of a multi-controller disaggregated server.

With `runtime=multicontroller` and a disaggregated `inference_server` (serving.disaggregation),
every process's devices are on one side: the prefill group's processes drive the prefill engine
(process 0 among them: JetStream's order puts prefill first), the generate group's the generate
engine. Each compiled call is entered by its own group only; the plan reaches every process
(serving.orchestrator.lockstep), and what crosses between the groups goes through a `Link`:

- arrays (a prompt's pages of KV and its slot's state, a whole prompt's prefix, a preempted slot's
  state going back) by `jax.experimental.transfer`: each process runs a transfer server on its
  first device, the sender schedules its copy (`await_pull`) and the receiver pulls it onto its own
  first device (process to process over sockets, no host pickle of the arrays; on TPU hosts the
  same DCN transfer a multi-slice deployment uses). The sender's tree is gathered whole onto each
  of its devices first (`Engine.gathered`), and receiver j of its group pulls from sender
  j mod (senders): every receiving process has the whole tree and places its own shards.
- small host values (the generate call's tokens for process 0, the shapes of a tree to pull) by
  the key-value store of JAX's distributed runtime (its coordination service).

Every process calls every move of a plan, in the same order (a move it takes no part in only
counts), so each move's id is the same counter everywhere and no message names it.
"""

from __future__ import annotations

import datetime
import pickle
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from serving.errors import ConfigError

_IDS_PER_MOVE = 1 << 16  # a move's pull ids: move * this + the receiving process's index
_KEY = "pathserve/disaggregated"


@dataclass(frozen=True)
class ProcessGroups:
    """Which processes prefill and which generate, and which this one is."""

    prefill: tuple[int, ...]
    generate: tuple[int, ...]
    me: int

    @property
    def on_prefill(self) -> bool:
        return self.me in self.prefill

    @property
    def generate_lead(self) -> int:
        """The generate process that reports the generate call's tokens to process 0."""
        return self.generate[0]

    @classmethod
    def of(cls, prefill_devices: Sequence[Any], generate_devices: Sequence[Any], me: int) -> ProcessGroups:
        """The groups of a device split; every process's devices must be on one side, and process
        0 (which serves requests) on the prefill side."""
        prefill = sorted({d.process_index for d in prefill_devices})
        generate = sorted({d.process_index for d in generate_devices})
        if both := sorted(set(prefill) & set(generate)):
            raise ConfigError(
                f"runtime=multicontroller with a disaggregated inference_server: process {both[0]} has devices "
                "on both sides; prefill_slice and generate_slice must each name whole processes' devices "
                "(prefill: the first processes' devices, generate: the rest)"
            )
        if 0 not in prefill:
            raise ConfigError(
                "runtime=multicontroller with a disaggregated inference_server: process 0 serves requests and "
                "must be on the prefill side (JetStream's order: prefill's devices first)"
            )
        return cls(tuple(prefill), tuple(generate), me)

    @staticmethod
    def source_for(receiver: int, senders: Sequence[int], receivers: Sequence[int]) -> int:
        """The sender `receiver` (one of `receivers`) pulls from: its rank in its group, modulo
        the senders."""
        return senders[list(receivers).index(receiver) % len(senders)]


def meet_after_warmup(groups: ProcessGroups, limits: Any, timeout_s: float) -> None:
    """Every process, once its side is warmed up: the two sides compile different calls (the
    prefill group's take longer), and the first plan's broadcast is a collective whose peers wait
    only about 30 s for one another (gloo's context), so all meet here first, at the distributed
    runtime's barrier, which waits `timeout_s`. The generate lead publishes its engine's `limits`
    there and each prefill process checks its mirror against them (one plan's slot and page ids
    must name the same on both sides); a mismatch raises RuntimeError."""
    from jax._src import distributed

    store = distributed.global_state.client
    key = f"{_KEY}/generate-limits"
    if groups.me == groups.generate_lead:
        store.key_value_set_bytes(key, pickle.dumps(limits))
    store.wait_at_barrier(f"{_KEY}/warmed-up", int(timeout_s * 1000))
    if groups.on_prefill:
        theirs = pickle.loads(store.blocking_key_value_get_bytes(key, int(timeout_s * 1000)))
        if theirs != limits:
            raise RuntimeError(f"the prefill engine's mirrored limits {limits} differ from the generate engine's {theirs}")


class _Spec:
    """A leaf's shape and dtype (the receiver's pull needs them); deliberately not a pytree."""

    def __init__(self, shape: tuple[int, ...], dtype: str):
        self.shape, self.dtype = shape, dtype


class Link:
    """This process's end of the moves between the groups (see the module's docstring)."""

    def __init__(self, groups: ProcessGroups, timeout_s: float):
        import jax
        from jax._src import distributed
        from jax.experimental import transfer

        self.groups = groups
        self.timeout_s = timeout_s
        self.moves = 0  # moves so far: every process counts the same
        self.plans = 0  # plans met at their end (meet)
        self.bytes_received = 0
        self._store = distributed.global_state.client
        if self._store is None:
            raise RuntimeError("a Link needs JAX's distributed runtime (runtime=multicontroller)")
        self.device = jax.local_devices()[0]
        host = _reachable_ip(distributed.global_state.coordinator_address or "127.0.0.1:0")
        self._server = transfer.start_transfer_server(self.device.client, f"{host}:0", [f"{host}:0"])
        self._store.key_value_set(f"{_KEY}/address/{groups.me}", self._server.address())
        self._connections: dict[int, Any] = {}

    def move(self, tree: Any, senders: Sequence[int], receivers: Sequence[int]) -> Any:
        """One move of `tree` (jax arrays, each whole on every device of the sender's mesh) from
        the `senders` group to the `receivers` group. Senders pass their tree and get None back;
        receivers pass None and get the tree, each leaf on this process's first device; others
        pass None and get None."""
        import jax

        move, me = self.moves, self.groups.me
        self.moves += 1
        if me in senders:
            local = [x.addressable_shards[0].data for x in jax.tree.leaves(tree)]
            shapes = pickle.dumps(jax.tree.map(lambda x: _Spec(tuple(x.shape), x.dtype.name), tree))
            for receiver in receivers:
                if self.groups.source_for(receiver, senders, receivers) == me:
                    pull = move * _IDS_PER_MOVE + receiver
                    self._server.await_pull(pull, local)
                    self._store.key_value_set_bytes(f"{_KEY}/shapes/{pull}", shapes)
            return None
        if me not in receivers:
            return None
        pull = move * _IDS_PER_MOVE + me
        key = f"{_KEY}/shapes/{pull}"
        specs = pickle.loads(self._store.blocking_key_value_get_bytes(key, self._timeout_ms))
        self._store.key_value_delete(key)
        leaves, structure = jax.tree.flatten(specs)
        if not leaves:
            return specs
        where = jax.sharding.SingleDeviceSharding(self.device)
        wanted = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where) for s in leaves]
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.timeout_s)
        got = self._connection(self.groups.source_for(me, senders, receivers)).pull(pull, wanted, timeout=deadline)
        self.bytes_received += sum(x.nbytes for x in got)
        return structure.unflatten(got)

    def tell(self, value: Any, sender: int, receiver: int) -> Any:
        """A small host value (picklable) from process `sender` to process `receiver`: the sender
        passes it and gets None; the receiver gets it; others get None."""
        move, me = self.moves, self.groups.me
        self.moves += 1
        key = f"{_KEY}/value/{move}"
        if me == sender:
            self._store.key_value_set_bytes(key, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        elif me == receiver:
            value = pickle.loads(self._store.blocking_key_value_get_bytes(key, self._timeout_ms))
            self._store.key_value_delete(key)
            return value
        return None

    def meet(self) -> None:
        """Every process at the end of a plan, at the distributed runtime's barrier: the sides
        compile different calls at first use (a shape the warmup left to the background, a
        prefix's insert), and the next plan's broadcast is a collective whose peers wait only
        about 30 s for one another, so no side enters it while the other still compiles."""
        self.plans += 1
        self._store.wait_at_barrier(f"{_KEY}/plan/{self.plans}", self._timeout_ms)

    @property
    def _timeout_ms(self) -> int:
        return int(self.timeout_s * 1000)

    def _connection(self, process: int):
        if process not in self._connections:
            address = self._store.blocking_key_value_get(f"{_KEY}/address/{process}", self._timeout_ms)
            self._connections[process] = self._server.connect(address)
        return self._connections[process]


def _reachable_ip(coordinator: str) -> str:
    """The local address this host reaches the coordinator from (so the other processes reach
    this one's transfer server there): loopback for a loopback coordinator."""
    host = coordinator.rsplit(":", 1)[0].strip("[]") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), 9))  # UDP: nothing is sent
            return probe.getsockname()[0]
    except OSError as exc:
        raise ConfigError(
            f"disaggregated serving over processes: no local address reaches the coordinator {coordinator} "
            f"for the KV transfer server ({exc})"
        ) from None
