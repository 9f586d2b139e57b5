"""loadtest.kernel_bundles reads libtpu's final-bundles dump (its format, as a v5e compile on a CPU
host wrote it; libtpu itself is not in CI): loop bodies by their LB marks and nesting, delay
slots kept in their loop, each loop's opcodes, and a kv block's bundles against its DMA cycles."""

from __future__ import annotations

import pytest

from loadtest.kernel_bundles import (
    V5E_CLOCK_HZ,
    V5E_HBM_BYTES_PER_S,
    longest_chain,
    loops,
    opcodes,
    parse_bundles,
    summarize,
)

DUMP = """\
LH: loop header
LB: loop body
     0x0   :  { %s1_s0 = smov 0 }
    0x10   :  { %s24316_s2 = smov 0 /* copy for cssa */ } /* Start region 843 :: End region 843 */
    0x11 LB: > { %38904 = sst [smem:[#allocation297_spill]] %s23894_s2  ;;  %s24322_s3 = sadd.s32 4294967295, %s23894_s2 }
    0x12   : > { %v5 = vld [vmem:[#allocation7] sm:$0xff] }
    0x13 LB: >> { %v6 = vshra.s32 %v5, 24  ;;  %v7 = vcvt.s32.f32 %v6  ;;  %v8 = vshra.s32 %v5, 16 }
    0x14   : >> { %9 = vmatpush.bf16.msra.mxu0 %v7 }
    0x15   :  {}
    0x16   : >> { %v10 = vpack.c.bf16 %v7, %v7  ;;  %11 = sbr.rel (!%p1) target = $region9 }
    0x17 PF: > { %v12 = vadd.f32 %v10, %v10 }
    0x18   : > { %13 = sbr.rel (!%p2) target = $region3 }
    0x19   :  { %14 = vst [vmem:[#allocation8] sm:$0xff] %v12 }
"""


def test_the_loops_of_a_final_bundles_dump():
    bundles = parse_bundles(DUMP)
    assert [b.address for b in bundles] == [0x0, *range(0x10, 0x1A)]  # the legend lines are no bundles
    assert bundles[6].body.strip() == "" and bundles[6].depth == 2  # a delay slot stays in its loop
    outer, inner = loops(bundles)
    assert (outer.depth, outer.bundles) == (1, 8) and (inner.depth, inner.bundles) == (2, 4)
    ops = opcodes(bundles, inner)
    assert ops == {"vshra": 2, "vcvt": 1, "vmatpush": 1, "vpack": 1, "sbr": 1}


def test_a_kv_blocks_bundles_against_its_dma_cycles():
    block_bytes = 256 * 1040
    got = summarize(DUMP, block_bytes, 256)
    assert got["inner_loops"] == [4] and got["block_bundles"] == 4 and got["bundles_per_position"] == 4 / 256
    dma = block_bytes / V5E_HBM_BYTES_PER_S * V5E_CLOCK_HZ
    assert got["block_dma_cycles"] == round(dma) and got["compute_over_dma"] == pytest.approx(4 / dma)
    assert summarize("no bundles here", 1, 1) == {"error": "no loop body (LB) in the dump"}


def test_the_longest_chain_of_the_largest_block():
    text = """\
New basic block in region: region23 {members=14 hlo=ragged_paged_attention.1 parent=848}
  Length to end: 17, %s197 = sld [smem:[#allocation12]]
  Length to end: 11, %s203 = sadd.s32 255, %s197
New basic block in region: region804 {members=1677 hlo=ragged_paged_attention.1 parent=797}
  Length to end: 8, %s15168 = smov %s15167 /* phi copy */
  Length to end: 620, %v492 = vlaneseq
  Length to end: 3, %v493 = vshrl.u32 %v492, 7
New basic block in region: region9 {members=2 hlo=ragged_paged_attention.1 parent=0}
  Length to end: 1, %s1 = smov 0
"""
    assert longest_chain(text) == (1677, 620)
    assert longest_chain("") == (0, 0)
