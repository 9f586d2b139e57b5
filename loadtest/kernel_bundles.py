"""The ragged paged kernel's static cost on a v5e without the chip: the kernel compiled for a v5e on
any host with libtpu installed (jax.experimental.topologies, as loadtest.tpu_plan), libtpu's final
VLIW bundles dumped (LIBTPU_INIT_ARGS=--xla_jf_dump_to), and each loop body's bundles counted: the
inner loop is one kv block of one unit, so its bundles against the block's DMA time say whether the
kernel is compute- or HBM-bound at a configuration, before a chip runs it.

    python -m loadtest.kernel_bundles OUT_DIR [--kv int8|int8-per-token|bfloat16] [--batch 64]
        [--pages-per-block 4] [--groups 4] [--kv-heads 8] [--head-dim 64]

Prints one JSON object (also OUT_DIR/kernel-bundles.json): the inner loop's bundles per kv block and
per position, its busiest ops, and the block's bytes over the chip's published HBM rate in the
same cycles. A bundle is one cycle when nothing stalls (a lower bound of the kernel's time);
set beside the chip on 2026-12-07 (Llama 3.2 1B's decode at batch 64 over ~1,024 positions, kv
blocks of 256, 16 layers): int8 pages with scales per token and head 962 bundles a block against
480 cycles of DMA (the kernel measured 0.29 ms a layer-step, ~230 GB/s: compute-bound), bfloat16
pages 496 against 960 (0.25 ms, ~535 GB/s: HBM-bound). Since then the scales' multiplier is built
from lane slices (serving.kernels.ragged_paged): this tool's int8 block 930 -> 784 bundles,
per-token scales 671 -> 616; not yet timed on a chip. The same dump's `*-critical-path.txt` gives
the int8 block's longest dependency chain (`largest_block_chain`) as 620 of its 784 bundles; yet
a decode block's four units walked together in one loop (tried, not kept) took 2,919 bundles for
four blocks, 730 each: the vector units are nearly full too, most of it the unpacking of four int8
values an int32 lane (~880 shifts, converts and packs a block). Not a test: libtpu's compiler is
not in CI.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

V5E_HBM_BYTES_PER_S = 819e9  # published
V5E_CLOCK_HZ = 197e12 / (4 * 128 * 128 * 2)  # from the published bf16 peak: 4 MXUs of 128 x 128, ~1.5 GHz
BUNDLE = re.compile(r"\s*(0x[0-9a-f]+)\s+([A-Z]{2})?:?\s*(>*)\s*\{(.*)\}")
OPCODE = re.compile(r"=\s*([a-z][\w]*)")


@dataclass(frozen=True)
class Bundle:
    address: int
    tag: str  # "LB" a loop body's first bundle, "PF" a predicated region's fallthrough, ...
    depth: int  # loop nesting (the dump's '>' marks)
    body: str


@dataclass(frozen=True)
class Loop:
    first: int  # index into the bundles
    last: int
    depth: int

    @property
    def bundles(self) -> int:
        return self.last - self.first + 1


def parse_bundles(text: str) -> list[Bundle]:
    """The bundles of a `*-final_bundles.txt` dump, in order; an empty bundle (a delay slot) keeps
    the depth of the one before it."""
    out: list[Bundle] = []
    for line in text.splitlines():
        m = BUNDLE.match(line)
        if not m:
            continue
        depth = len(m.group(3))
        if not m.group(4).strip() and out:
            depth = out[-1].depth
        out.append(Bundle(int(m.group(1), 16), m.group(2) or "", depth, m.group(4)))
    return out


def loops(bundles: list[Bundle]) -> list[Loop]:
    """Each loop body: from a bundle tagged LB to the last bundle before the depth drops below it."""
    found = []
    for i, b in enumerate(bundles):
        if b.tag != "LB":
            continue
        j = i
        while j + 1 < len(bundles) and bundles[j + 1].depth >= b.depth:
            j += 1
        found.append(Loop(i, j, b.depth))
    return found


def opcodes(bundles: list[Bundle], loop: Loop) -> collections.Counter:
    """How many times each opcode (vmatpush, vcvt, ...) appears in the loop's body."""
    counts: collections.Counter = collections.Counter()
    for b in bundles[loop.first : loop.last + 1]:
        for op in b.body.split(";;"):
            m = OPCODE.search(op)
            if m:
                counts[m.group(1)] += 1
    return counts


def longest_chain(text: str) -> tuple[int, int]:
    """From a `*-critical-path.txt` dump: (ops, longest dependency chain in cycles) of its largest
    basic block (an inner loop's body, in the kernels measured here); (0, 0) if it has none."""
    best = (0, 0)
    members, chain = 0, 0
    for line in text.splitlines():
        block = re.match(r"New basic block in region: \S+ \{members=(\d+)", line)
        if block:
            best = max(best, (members, chain))
            members, chain = int(block.group(1)), 0
            continue
        length = re.match(r"\s*Length to end: (\d+),", line)
        if length:
            chain = max(chain, int(length.group(1)))
    return max(best, (members, chain))


def summarize(text: str, block_bytes: int, block_positions: int) -> dict:
    """The inner loops' bundles (the deepest; the first of them in detail) against a kv block's DMA
    cycles at the published HBM rate."""
    bundles = parse_bundles(text)
    found = loops(bundles)
    if not found:
        return {"error": "no loop body (LB) in the dump"}
    deepest = max(loop.depth for loop in found)
    inner = [loop for loop in found if loop.depth == deepest]
    dma_cycles = block_bytes / V5E_HBM_BYTES_PER_S * V5E_CLOCK_HZ
    first = inner[0]
    return {
        "kernel_bundles": len(bundles),
        "inner_loops": [loop.bundles for loop in inner],
        "block_bundles": first.bundles,
        "bundles_per_position": first.bundles / block_positions,
        "block_bytes": block_bytes,
        "block_dma_cycles": round(dma_cycles),
        "compute_over_dma": first.bundles / dma_cycles,
        "top_ops": opcodes(bundles, first).most_common(16),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--kv", choices=("int8", "int8-per-token", "bfloat16"), default="int8")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--pages-per-block", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    ns = parser.parse_args(argv)
    dump = ns.out / f"dump-{ns.kv}-{ns.pages_per_block}"
    dump.mkdir(parents=True, exist_ok=True)
    for old in dump.glob("*"):
        old.unlink()
    # before libtpu starts: the compiler reads its flags once
    os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} --xla_jf_dump_to={dump}".strip()
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from serving.kernels.ragged_paged import _rows_block, ragged_paged_attention

    topology = topologies.get_topology_desc(
        platform="tpu", topology_name="v5e:1x1", chip_config_name="default", chips_per_host_bounds=(1, 1, 1),
        num_slices=1,
    )
    sharding = SingleDeviceSharding(topology.devices[0])
    layers, pages_per_seq = 2, 2048 // ns.page_size

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    lanes = ns.kv_heads * ns.head_dim
    num_pages = ns.batch * pages_per_seq + 1
    scales: list = []
    if ns.kv == "bfloat16":
        pool = spec((layers, num_pages, ns.page_size, lanes), jnp.bfloat16)
        position_bytes = 2 * lanes * 2
    else:
        pool = spec((layers, num_pages, ns.page_size, lanes // 4), jnp.int32)
        heads = ns.kv_heads if ns.kv == "int8" else 1
        scales = [spec((layers, num_pages, heads * ns.page_size), jnp.float32)] * 2
        position_bytes = 2 * (lanes + 4 * heads)
    q = spec((ns.batch * ns.groups, ns.kv_heads, ns.head_dim), jnp.bfloat16)
    per_seq = spec((ns.batch,), jnp.int32)

    def decode(q, k, v, tables, seq, start, rows, *scales):
        k_scale, v_scale = scales or (None, None)
        return ragged_paged_attention(
            q, k, v, 1, tables, seq, start, rows, block_q=1, segments=_rows_block(ns.groups),  # a decode step's, as RaggedPagedOps
            pages_per_block=ns.pages_per_block, causal=False, k_scale=k_scale, v_scale=v_scale,
        )

    tables = spec((ns.batch, pages_per_seq), jnp.int32)
    jax.jit(decode).lower(q, pool, pool, tables, per_seq, per_seq, per_seq, *scales).compile()
    found = [p for p in sorted(dump.glob("*ragged_paged_attention*-final_bundles.txt")) if "schedule-analysis" not in p.name]
    if not found:
        print(f"kernel_bundles: no final bundles under {dump} (is this libtpu's compiler?)", file=sys.stderr)
        return 1
    span = ns.pages_per_block * ns.page_size
    report = {
        "kv": ns.kv, "batch": ns.batch, "pages_per_block": ns.pages_per_block, "page_size": ns.page_size,
        "groups": ns.groups, "kv_heads": ns.kv_heads, "head_dim": ns.head_dim,
        **summarize(found[0].read_text(), span * position_bytes, span),
    }
    chains = sorted(dump.glob("*ragged_paged_attention*-critical-path.txt"))
    if chains:  # the inner loop's longest dependency chain: how latency-bound its bundles are
        report["largest_block_ops"], report["largest_block_chain"] = longest_chain(chains[0].read_text())
    (ns.out / "kernel-bundles.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
