"""`make loadtest`: start the default server, run a headless locust session against it, write the
CSVs and plots to results/ (locust_stats.csv, locust_stats_history.csv, locust.png).

    python -m loadtest.run_locust [--users 8] [--spawn-rate 4] [--time 30s] [--url URL] [-- key=value ...]

With --url it drives that server (a port-forwarded or in-cluster Service) and starts none.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

from loadtest.server import Server

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def run_locust(url: str, out: Path, users: int, spawn_rate: float, run_time: str, extra: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", url, "--headless",
        "-u", str(users), "-r", str(spawn_rate), "-t", run_time, "--csv", str(out / "locust"),
        "--csv-full-history", "--only-summary", *extra,
    ]  # fmt: skip
    return subprocess.run(command).returncode


def plot(out: Path) -> Path:
    """Throughput and latency over time, and TTFT per route, from locust's CSVs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with (out / "locust_stats_history.csv").open() as f:
        history = [row for row in csv.DictReader(f) if row["Name"] == "Aggregated"]
    with (out / "locust_stats.csv").open() as f:
        stats = list(csv.DictReader(f))
    t0 = int(history[0]["Timestamp"]) if history else 0
    xs = [int(r["Timestamp"]) - t0 for r in history]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    axes[0].plot(xs, [float(r["Requests/s"]) for r in history], label="requests/s")
    axes[0].plot(xs, [float(r["Failures/s"]) for r in history], label="failures/s")
    axes[0].set_title("throughput")
    for key in ("50%", "95%", "99%"):
        axes[1].plot(xs, [_number(r[key]) for r in history], label=f"p{key[:-1]}")
    axes[1].set_title("response time (ms)")
    ttft = [r for r in stats if r["Type"] == "TTFT"]
    axes[2].barh([r["Name"] for r in ttft], [float(r["Median Response Time"]) for r in ttft])
    axes[2].set_title("TTFT median (ms)")
    for ax in axes[:2]:
        ax.set_xlabel("seconds")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = out / "locust.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="drive this server instead of starting the default one")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--spawn-rate", type=float, default=4)
    parser.add_argument("--time", default="30s")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--locust-arg", action="append", default=[], help="passed to locust (repeatable)")
    parser.add_argument("serve_args", nargs="*", help="key=value for the server this starts")
    ns = parser.parse_args(argv)
    if ns.url:
        status = run_locust(ns.url, ns.out, ns.users, ns.spawn_rate, ns.time, ns.locust_arg)
    else:
        with Server(ns.serve_args, ns.out / "loadtest-server.log") as server:
            print(f"waiting for the server at {server.url} (log: {server.log_path}) ...", flush=True)
            server.wait_ready()
            status = run_locust(server.url, ns.out, ns.users, ns.spawn_rate, ns.time, ns.locust_arg)
    print(f"wrote {ns.out}/locust_*.csv and {plot(ns.out)}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
