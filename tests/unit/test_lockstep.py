"""The multi-controller pieces that need no second process: where jax.distributed's arguments come
from (config, JAX_* variables, an LWS pod's variables), and the plan channel's framing."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from serving.config import ConfigError, load_config
from serving.engine.mock import MockEngine
from serving.lora.peft import LoraWeights
from serving.lora.registry import AdapterLoad
from serving.orchestrator import lockstep
from serving.orchestrator.executor import Executor
from serving.orchestrator.scheduler import StepPlan
from serving.runtime import DEFAULT_COORDINATOR_PORT, distributed_args


def devices(*overrides: str):
    return load_config(None, ["runtime=multicontroller", *overrides]).devices


def test_config_keys_win_over_the_environment():
    env = {"JAX_COORDINATOR_ADDRESS": "env:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    cfg = devices("coordinator_address=leader:1234", "num_processes=2", "process_id=1")
    assert distributed_args(cfg, env) == {"coordinator_address": "leader:1234", "num_processes": 2, "process_id": 1}


def test_jax_variables_then_an_lws_pods_variables():
    jax_env = {"JAX_COORDINATOR_ADDRESS": "h:9", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
    assert distributed_args(devices(), jax_env) == {"coordinator_address": "h:9", "num_processes": 4, "process_id": 2}
    lws_env = {"LWS_LEADER_ADDRESS": "g-0.g", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "3"}
    assert distributed_args(devices(), lws_env) == {
        "coordinator_address": f"g-0.g:{DEFAULT_COORDINATOR_PORT}", "num_processes": 4, "process_id": 3,
    }


def test_nothing_set_leaves_it_to_jax_detection():
    assert distributed_args(devices(), {}) == {}


def test_bad_values_name_the_key():
    with pytest.raises(ConfigError, match="LWS_WORKER_INDEX='x'"):
        distributed_args(devices(), {"LWS_WORKER_INDEX": "x"})
    with pytest.raises(ConfigError, match="process_id=2 is not below num_processes=2"):
        distributed_args(devices("num_processes=2", "process_id=2"), {})


class Wire:
    """broadcast_one_to_all as the leader and a follower see it: frames the leader sends are the
    frames the follower receives, in order, with the same shapes."""

    def __init__(self, monkeypatch):
        self.frames: list[np.ndarray] = []
        self.sending = True
        monkeypatch.setattr(lockstep, "_broadcast", self.broadcast)

    def broadcast(self, frame: np.ndarray) -> np.ndarray:
        if self.sending:
            self.frames.append(frame.copy())
            return frame
        sent = self.frames.pop(0)
        assert sent.shape == frame.shape and sent.dtype == frame.dtype  # one compiled shape each
        return sent


def channel(is_leader: bool) -> lockstep.PlanChannel:
    ch = lockstep.PlanChannel.__new__(lockstep.PlanChannel)
    ch.is_leader = is_leader
    return ch


@pytest.mark.parametrize("frees", [1, 2000], ids=["one-frame", "two-frames"])
def test_a_plan_arrives_whole_in_fixed_shape_frames(monkeypatch, frees):
    wire = Wire(monkeypatch)
    plan = StepPlan(frees=tuple(range(frees)), decode_steps=4, running=1, max_position=21)
    channel(True).send(plan)
    assert wire.frames[0].shape == (lockstep.FRAME_BYTES,)
    assert len(wire.frames) == (1 if frees == 1 else 2)
    if len(wire.frames) == 2:
        size = wire.frames[1].size
        assert size & (size - 1) == 0  # padded to a power of two: few shapes to compile
    channel(True).send(lockstep.STOP)
    wire.sending = False
    follower = channel(False)
    assert follower.receive() == plan
    assert isinstance(follower.receive(), type(lockstep.STOP))
    assert wire.frames == []


def test_only_process_0_sends(monkeypatch):
    Wire(monkeypatch)
    with pytest.raises(RuntimeError, match="only process 0"):
        channel(False).send(lockstep.KEEPALIVE)


@pytest.fixture
def exits(monkeypatch) -> list[int]:
    codes: list[int] = []
    monkeypatch.setattr(lockstep, "EXIT_GRACE_S", 0.0)
    monkeypatch.setattr(lockstep, "WATCH_S", 0.01)
    monkeypatch.setattr(lockstep.os, "_exit", codes.append)
    return codes


def test_a_failed_loop_exits_1_and_a_stopped_one_does_not(exits):
    lockstep.exit_when_loop_dies(lambda: False, lambda: True).join(5)
    assert exits == []
    lockstep.exit_when_loop_dies(lambda: False, lambda: False).join(5)
    assert exits == [1]


def test_a_stalled_loop_exits_1(exits):
    stalls = iter([0.0, 5.0, 61.0])
    lockstep.exit_when_loop_dies(lambda: True, lambda: False, lambda: next(stalls), max_stall_s=60).join(5)
    assert exits == [1]


class _Warmup:
    def __init__(self):
        self.told: list[str] = []

    def idle(self) -> None:
        self.told.append("idle")

    def busy(self) -> None:
        self.told.append("busy")

    def stop(self) -> None:
        self.told.append("stop")


def test_a_followers_background_warmup_compiles_on_keepalives_holds_on_plans_and_stops(monkeypatch):
    """The follower's loop tells the warmup nothing itself: its Executor does (run: busy, idle on a
    keepalive, close on STOP), as for every other device loop."""
    warmup, ran = _Warmup(), []

    class Engine:
        background_warmup = warmup

        def init_decode_state(self):
            return "state"

        def free_resource(self, state, slot):
            ran.append((slot, list(warmup.told)))
            return state

    messages = iter([StepPlan(frees=(1,)), lockstep.KEEPALIVE, StepPlan(frees=(2,)), lockstep.STOP])
    channel = type("Channel", (), {"receive": lambda self: next(messages)})()
    monkeypatch.setattr(lockstep, "meet_at_exit", lambda: warmup.told.append("met"))
    assert lockstep.follow(Executor(Engine(), params=None), channel) == 2
    assert ran == [(1, ["busy"]), (2, ["busy", "idle", "busy"])]
    assert warmup.told == ["busy", "idle", "busy", "stop", "met"]


def test_an_adapter_load_in_a_plan_is_written_by_every_process_between_the_same_plans(monkeypatch):
    """The plan carries the adapter's load (slot, name, version, path) and no other message is
    sent: process 0's executor writes its registry's host copy, a follower's reads the path, both
    at the same point of the same plan (after its frees, before anything else of it)."""
    weights = LoraWeights(2, {"wq": (np.zeros((1, 2, 2)), np.zeros((1, 2, 2)))}, 1.0)
    load = AdapterLoad(2, "sql", 7, "gs://b/sql")
    plans = [StepPlan(frees=(1,)), StepPlan(frees=(3,), adapter_loads=(load,)), StepPlan(frees=(0,))]
    assert pickle.loads(pickle.dumps(plans[1])) == plans[1]  # what PlanChannel sends

    reads: list[str] = []

    def from_storage(read: AdapterLoad) -> LoraWeights:  # serving.lora.serving.storage_reader's part
        reads.append(read.path)
        return weights

    follower = MockEngine(slots=4)
    messages = iter([*plans, lockstep.STOP])
    channel = type("Channel", (), {"receive": lambda self: next(messages)})()
    monkeypatch.setattr(lockstep, "meet_at_exit", lambda: None)
    assert lockstep.follow(Executor(follower, {}, from_storage), channel) == 3
    calls = [c for c in follower.calls if c[0] != "init_decode_state"]
    assert calls == [("free_resource", 1), ("free_resource", 3), ("write_adapter", 2, 2), ("free_resource", 0)]
    assert reads == ["gs://b/sql"]

    sent: list = []
    leader_engine, host_copies = MockEngine(slots=4), {("sql", 7): weights}
    executor = Executor(leader_engine, {}, lambda read: host_copies[read.name, read.version])
    leader = lockstep.LockstepExecutor(executor, type("Channel", (), {"send": lambda self, m: sent.append(m)})())
    for plan in plans:
        leader.run(plan)
    assert sent == plans and [c for c in leader_engine.calls if c[0] != "init_decode_state"] == calls
    assert executor.params["lora"] == {2: weights} and reads == ["gs://b/sql"]


def test_the_leaders_executor_answers_for_the_warmup_as_its_executor_does():
    """The orchestrator's loop reads the warmup through whichever executor it has (a lockstep
    leader's too) and tells it idle / close through it."""
    warmup = _Warmup()
    engine = type("Engine", (), {"background_warmup": warmup, "init_decode_state": lambda self: "state"})()
    sent: list = []
    leader = lockstep.LockstepExecutor(
        Executor(engine, params=None), type("Channel", (), {"send": lambda self, m: sent.append(m)})()
    )
    assert leader.background_warmup is warmup
    leader.idle()
    assert warmup.told == ["idle"]
