"""serve's memory plan counts the compiled programs' footprints (serving.engine.compiled_memory),
read from XLA before any weight is placed: a plan whose params, KV cache (as the chip lays them out)
and temporaries exceed the devices' bytes_limit is refused naming the figures and what to lower,
with nothing loaded; each engine is charged for the programs it runs."""

from __future__ import annotations

import pytest

from serving import launch
from serving.config import ConfigError, ServingConfig
from serving.engine.compiled_memory import compiled_plan
from serving.engine.engine import Engine
from serving.request import SamplingParams


def _config(**keys) -> ServingConfig:
    return ServingConfig(
        **{"per_device_batch_size": 4, "max_prefill_predict_length": 64, "max_target_length": 128, "cpu_kernels": "off", **keys}
    )


def test_the_largest_programs_come_from_the_compiler(tiny_model_dir):
    from serving.checkpoints.model_source import load_model

    cfg = _config()
    engine = Engine(load_model(str(tiny_model_dir), cfg), cfg.engine)
    plan = compiled_plan(engine)
    assert set(plan.programs) == {
        "generate of 4 slots over 128 positions", "prefill of 1 x 64 tokens after 64 positions",
        "prefill of 4 x 16 tokens after 112 positions", "a scored chunk of 64 tokens after 64 positions",
    }
    assert all(v > 0 for v in plan.programs.values())
    where = engine.placement  # the arguments: the params and the whole decode state at least
    assert plan.resident >= where.params_bytes_per_chip() + where.cache_bytes_per_chip()
    assert plan.total == plan.resident + max(plan.programs.values())
    generate_only = compiled_plan(engine, prefill=False)  # a disaggregated generate engine's
    assert list(generate_only.programs) == ["generate of 4 slots over 128 positions"]
    assert not any("generate" in name for name in compiled_plan(engine, generate=False).programs)


def test_serve_refuses_a_plan_that_does_not_fit_before_loading(tiny_model_dir, monkeypatch):
    """A bytes_limit a byte short of the compiled plan: refused naming its figures, and load_params
    never runs."""
    from serving.checkpoints.model_source import load_model

    cfg = _config()
    engine = Engine(load_model(str(tiny_model_dir), cfg), cfg.engine)
    limit = compiled_plan(engine).total - 1
    monkeypatch.setattr(launch, "device_limit", lambda devices: limit)

    def never(self):
        raise AssertionError("weights placed before the memory plan was checked")

    monkeypatch.setattr(Engine, "load_params", never)
    with pytest.raises(ConfigError) as refused:
        launch.bring_up(cfg, str(tiny_model_dir))
    message = str(refused.value)
    assert "compiled programs' temporaries" in message and "the largest: " in message and "by 0.00 GB" in message
    assert "per_device_batch_size" in message and "prefill_chunk_size" in message


def test_a_plan_that_cannot_be_compiled_ahead_falls_back_to_the_estimate(tiny_model_dir, monkeypatch, caplog):
    from serving.engine import compiled_memory

    def fails(*args, **kwargs):
        raise RuntimeError("no memory analysis here")

    monkeypatch.setattr(compiled_memory, "compiled_plan", fails)
    monkeypatch.setattr(launch, "device_limit", lambda devices: 1 << 40)
    up = launch.bring_up(_config(), str(tiny_model_dir))
    assert up.engine.max_concurrent_decodes == 4
    assert "could not be compiled ahead" in caplog.text


def test_serve_starts_when_the_plan_fits(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(launch, "device_limit", lambda devices: 1 << 40)
    settled = []
    monkeypatch.setattr(launch.heap, "settle", lambda: settled.append(True))
    up = launch.bring_up(_config(), str(tiny_model_dir))
    assert settled == [True]  # start-up's heap frozen out of the collector's scans, once
    assert isinstance(up, launch.BroughtUp) and up.engine.max_concurrent_decodes == 4 and up.params
    assert up.model.params == {} and up.prefill is None  # the placed params are the only copy
    # each phase timed, in order, so that a slow start names its phase in the ready line
    assert list(up.phases) == ["runtime", "plan", "load", "memory plan", "placement", "warmup"]
    assert all(seconds >= 0 for seconds in up.phases.values())


def test_the_slots_a_decode_call_computes_are_uploaded_once(tiny_model_dir):
    """Nothing that did not change is uploaded per call: the same slots give the same device array."""
    from serving.checkpoints.model_source import load_model

    cfg = _config()
    engine = Engine(load_model(str(tiny_model_dir), cfg), cfg.engine)
    first = engine.call_rows(None, [0, 2])
    assert engine.call_rows(None, [0, 2]) is first and engine.call_rows(None, [0, 1]) is not first
    assert first.tolist() == [0, 2]


def test_the_plan_compiles_warmups_programs_once_for_warmup_to_run(tiny_model_dir):
    """With `warm` (a TPU's serve: warmup compiles on the host's cores), the memory plan compiles
    every program warmup runs in its one batch, before any weight is placed, and the engine keeps
    them: warmup and the requests after it compile nothing of their own."""
    from serving.checkpoints.model_source import load_model
    from serving.engine import warmup

    cfg = _config()
    engine = Engine(load_model(str(tiny_model_dir), cfg), cfg.engine)
    plan = compiled_plan(engine, warm=True)
    assert "generate of 4 slots over 128 positions" in plan.programs
    probe = SamplingParams(max_tokens=1)
    chunks = {engine.chunks._slot_inputs(warmup._rows(r, n, at, probe))[1] for r, n, at in warmup.chunk_shapes(engine)}
    assert chunks <= set(engine.chunks._precompiled)
    generates = {(b, w, engine.decode_steps_per_call) for b in engine.limits.decode_buckets for w in engine.windows}
    assert generates == set(engine._generate_compiled)
    kept = dict(engine._generate_compiled)
    params = engine.load_params()
    engine.warmup(params)
    assert engine.chunks._jit_shapes == set() and engine._generate_fn._cache_size() == 0
    assert all(engine._generate_compiled[k] is v for k, v in kept.items())  # not compiled twice
    # the small programs beside them too: each rows bucket's first tokens (serially at warmup's
    # first runs, they and the whole prefills no request takes now were 19 s of a v5e's 25)
    assert set(engine.chunks._start_compiled) == {rows for rows, _, _ in engine.chunks._precompiled}
    assert all(engine.chunks._start_compiled.values())
    functions = (engine.chunks._start_rows_fn, engine._prefill_fn, engine._insert_fn)
    assert [f._cache_size() for f in functions] == [0, 0, 0]
    from serving.orchestrator.offline import run_to_completion

    requests = [(list(range(4, 4 + n)), SamplingParams(max_tokens=6, seed=n)) for n in (3, 40, 64)]
    scored = [(list(range(4, 20)), SamplingParams(max_tokens=0, prompt_logprobs=2))]  # the prompt scored alone
    scored.append((list(range(4, 20)), SamplingParams(max_tokens=6, prompt_logprobs=2)))  # and generating
    warmed = [r.token_ids for r in run_to_completion(engine, params, requests + scored)]
    assert [f._cache_size() for f in functions] == [0, 0, 0]  # neither a whole prefill nor an insert
    assert engine.chunks._score_chunk_fn._cache_size() == 1  # the scored chunk's model call at this shape (first use)
    cold = Engine(engine.model, cfg.engine)
    assert [r.token_ids for r in run_to_completion(cold, cold.load_params(), requests + scored)] == warmed


def test_the_profiles_slots_are_sized_down_to_what_the_compiled_plan_fits(tiny_model_dir, monkeypatch):
    """Slots the serving profile proposed (sized from a share of the memory before any program was
    compiled) that do not fit beside the programs' temporaries: start-up sizes them down from the
    compiled footprint and serves; the ready line says why. Slots the user gave are refused (above)."""
    from serving.checkpoints.model_source import load_model
    from serving.startup.profile import FROM_PROFILE

    cfg = _config(per_device_batch_size=16)
    engine = Engine(load_model(str(tiny_model_dir), cfg), cfg.engine)
    plan = compiled_plan(engine)
    kv = engine.placement.cache_bytes_per_chip()
    # room for about 8 of the 16 slots' KV cache beside the params and the largest temporaries
    limit = int((plan.total - kv // 2) / (1 - launch.REFIT_MARGIN))
    monkeypatch.setattr(launch, "device_limit", lambda devices: limit)
    up = launch.bring_up(cfg, str(tiny_model_dir), {"per_device_batch_size": FROM_PROFILE})
    assert 4 <= up.engine.max_concurrent_decodes < 16
    why = up.plan.origins["per_device_batch_size"]
    assert why.startswith(FROM_PROFILE) and "sized to the compiled programs: 16 slots needed" in why
    assert up.params  # the second plan, of fewer slots, was checked and fit before the weights were placed


def test_a_program_the_chip_cannot_hold_is_refused_naming_what_to_lower(tiny_model_dir, monkeypatch):
    """XLA refusing to compile a program for the chip (RESOURCE_EXHAUSTED: its temporaries alone
    exceed the memory) is a config error naming it, not a fall back to the estimate."""
    from serving.engine import compiled_memory

    def exhausted(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (19.43G) exceeds available HBM (15.75G).")

    monkeypatch.setattr(compiled_memory, "compiled_plan", exhausted)
    monkeypatch.setattr(launch, "device_limit", lambda devices: 1 << 40)
    with pytest.raises(ConfigError) as refused:
        launch.bring_up(_config(), str(tiny_model_dir))
    assert "HLO temporaries (19.43G)" in str(refused.value) and "history_batch_tokens" in str(refused.value)


def test_a_second_engine_loads_the_plans_programs_without_tracing_them(tiny_model_dir, tmp_path, monkeypatch):
    """The plan's and warmup's programs go to the executable store beside JAX's persistent cache
    (serving.engine.executables): an engine of the same code, devices, config and model loads them
    back without tracing (on a v5e, tracing was 15.7 s of a 35.5 s warm start), and runs them to the
    same tokens; a different config is a different key."""
    import jax

    # JAX's own cache off (a program it hands back is not stored), the store under tmp_path
    from jax._src import compilation_cache  # JAX decides once per process whether its cache is on

    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    jax.clear_caches()  # nor an executable this process compiled (or loaded) for an earlier test
    try:
        _second_engine_loads(tiny_model_dir, monkeypatch)
    finally:
        jax.config.update("jax_compilation_cache_dir", saved[0])
        jax.config.update("jax_enable_compilation_cache", saved[1])
        compilation_cache.reset_cache()


def _second_engine_loads(tiny_model_dir, monkeypatch) -> None:
    from serving.checkpoints.model_source import load_model
    from serving.engine import executables
    from serving.orchestrator.offline import run_to_completion

    monkeypatch.setattr(executables, "PLATFORMS", ("cpu",))  # XLA:CPU's fresh compiles reload whole
    described: list[str] = []
    describe = executables.describe
    monkeypatch.setattr(executables, "describe", lambda args: described.append(describe(args)) or described[-1])
    cfg = _config()
    model = load_model(str(tiny_model_dir), cfg)
    first = Engine(model, cfg.engine)
    compiled_plan(first, warm=True)
    # the keys are the same in the next process: no object's address in them (the trace context's
    # axis environment was, and on the chip no program stored by one start loaded in the next)
    assert described and not [key for key in [first.executables.context, *described] if " at 0x" in key]
    stored = len(list(first.executables.directory.glob("*.bin")))  # a program two jobs compiled at once: one file
    assert stored > 0 and first.executables.saved >= stored and first.executables.loaded == 0
    requests = [(list(range(4, 4 + n)), SamplingParams(max_tokens=6, seed=n)) for n in (3, 40)]
    expected = [r.token_ids for r in run_to_completion(first, first.load_params(), requests)]

    second = Engine(model, cfg.engine)
    for fn in (second._generate_fn, second.chunks._prefill_slots_fn, second.chunks._start_rows_fn, second.chunks._score_chunk_fn):
        monkeypatch.setattr(fn, "lower", lambda *a, **k: (_ for _ in ()).throw(AssertionError("traced")))
    plan = compiled_plan(second, warm=True)
    assert second.executables.loaded >= stored and second.executables.saved == 0
    assert plan.programs and all(v > 0 for v in plan.programs.values())  # the loaded ones' memory analysis
    assert [r.token_ids for r in run_to_completion(second, second.load_params(), requests)] == expected

    other = Engine(model, _config(per_device_batch_size=2).engine)  # the same code: one directory, another key
    assert other.executables.directory == second.executables.directory
    assert other.executables.context != second.executables.context
    assert executables.describe((1, None)) != executables.describe((None, 1))


def test_the_executable_store_keeps_the_two_newest_code_versions(tmp_path):
    import os

    from serving.engine.executables import ExecutableStore

    for age, name in enumerate("abc"):
        ExecutableStore(tmp_path, name * 64, "", [])
        os.utime(tmp_path / (name * 32), (age, age))  # a, b, c: oldest first
    ExecutableStore(tmp_path, "d" * 64, "", [])
    assert sorted(d.name[0] for d in tmp_path.iterdir()) == ["c", "d"]


def test_a_program_two_compile_threads_ask_for_compiles_once(tiny_model_dir, monkeypatch):
    """The memory plan's largest programs are warmup's too, and both lists compile in one pool: a
    thread asked for a program another is compiling waits for that one (generate and prefill
    alike) instead of compiling it a second time beside it."""
    import threading
    import time

    from serving.checkpoints.model_source import load_model
    from serving.engine.compiled_memory import abstract_params, abstract_state
    from serving.engine.warmup import _rows, run_jobs

    cfg = _config()
    engine = Engine(load_model(str(tiny_model_dir), cfg), cfg.engine)
    params, state = abstract_params(engine), abstract_state(engine)
    compiled_names, real = [], engine.compile_ahead
    both_asked = threading.Barrier(2)

    def slow(name, args, lower):  # the first compile is still running when the second thread asks
        compiled_names.append(name)
        time.sleep(0.3)
        return real(name, args, lower)

    monkeypatch.setattr(engine, "compile_ahead", slow)
    monkeypatch.setattr(engine.chunks, "compile_ahead", slow)

    def asked(fn, *args):
        both_asked.wait()
        return fn(*args)

    rows = _rows(2, 16, 0, SamplingParams(max_tokens=1))
    for fn, args in [
        (engine.precompile_generate, (params, state, 4, 128)),
        (engine.compile_prefill_slots, (params, state, rows)),
    ]:
        compiled_names.clear()
        (_, first), (_, second) = run_jobs([(asked, (fn, *args)), (asked, (fn, *args))], 2)
        programs = [n for n in compiled_names if n != "start_rows"]
        assert len(programs) == 1, compiled_names
        if fn == engine.compile_prefill_slots:  # (executable, compiled by this call)
            assert first[0] is second[0] and sorted([first[1], second[1]]) == [False, True]
        else:
            assert first is second


def test_the_store_keeps_what_jaxs_cache_hands_back_where_that_reserializes(tmp_path, monkeypatch):
    """After an upgrade every program misses the store (the code is in its key) and those whose HLO
    did not change come back from JAX's persistent cache: stored where such an executable
    serializes whole (a TPU's), else (XLA:CPU's) not; unstored on the chip, every later warm start
    traced them again (52.7 s where the store's loads took 25.5)."""
    import jax
    import jax.numpy as jnp
    from jax._src import compilation_cache

    from serving.engine import executables

    names = ("jax_compilation_cache_dir", "jax_enable_compilation_cache",
             "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")
    saved = [getattr(jax.config, name) for name in names]
    for name, value in zip(names, (str(tmp_path / "jax"), True, 0, 0), strict=True):
        jax.config.update(name, value)
    compilation_cache.reset_cache()
    jax.clear_caches()
    try:
        f = jax.jit(lambda x: jnp.sin(x) * 3)
        x = jnp.ones(8)
        f.lower(x).compile()  # XLA compiles it, into JAX's cache
        for platforms, stored in (((), 0), (("cpu",), 1)):
            monkeypatch.setattr(executables, "RESAVES_CACHE_HITS", platforms)
            store = executables.ExecutableStore(tmp_path / "store", "e" * 64, "", jax.devices())
            jax.clear_caches()  # not this process's: JAX's persistent cache hands it back
            store.compile("f", (x,), lambda: f.lower(x))
            assert (store.saved, store.skipped) == (stored, 1 - stored)
        assert len(list(store.directory.glob("*.bin"))) == 1
    finally:
        for name, value in zip(names, saved, strict=True):
            jax.config.update(name, value)
        compilation_cache.reset_cache()
