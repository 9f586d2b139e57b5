"""Ragged paged attention for TPU (Pallas): the queries of many sequences, each a different number
of tokens (a decode step's 1, a prompt chunk's hundreds), in one call, reading every sequence's
cached keys and values in place through its block table from the lanes page pool
(serving.models.cache), with no copy of the pool.

The layout of a call:

- queries: the step's tokens packed sequence after sequence in units of block_q tokens, each
  sequence's from a unit boundary: q [units * block_q * groups, kv_heads, head_dim], row
  (u, t, g) the query head (h * groups + g) of unit u's token t; a sequence's last unit may hold
  fewer real tokens than block_q (`unit_rows`), the rest is padding whose output is anything.
  A kernel block takes `segments` units (a decode step: units of one token, several sequences a
  block; a chunk: one unit of 16 / gcd(16, groups) tokens a block).
- per unit (scalar-prefetched, int32 [units]): the table row of its sequence (`unit_seq`), the
  position of its first token (`unit_start`), and its real tokens (`unit_rows`, 0: an empty unit,
  skipped). Token t of unit u is at position unit_start[u] + t and attends to the positions
  [0, unit_start[u] + t] (causal within a chunk, the cached history before it).
- the pool, k and v [layers, num_pages, page_size, kv_heads * head_dim] (the lanes layout; int8
  values four to an int32 lane, with their scales), read in place in HBM. Causal, every position
  a token attends to is read from pages, its own included (written there before the call);
  `RaggedPagedOps` calls it history-only instead (every token of a row sees [0, start)), the
  call's own new tokens attended by XLA beside it, since the model writes them into the pool
  after its layer loop.

Per unit the kernel walks the sequence's pages `pages_per_block` at a time (a kv block), copying
each kv block's pages from HBM into VMEM while it computes the one before (two buffers, one DMA
semaphore each), with an online softmax in float32 for every kv head at once (`_kernel`); a
unit's first kv block is copied while the unit before it computes (two more buffers, by the
units' parity), so that a decode step's sequences, one kv block each, do not each wait for their
pages. Only the kv blocks up to the unit's last position are read: a decode step reads each
sequence's live pages once per layer.

Why not JAX's own paged_attention kernel (serving.kernels.tpu_paged): it takes one query token
per sequence and a pool in its own layout [kv_heads, pages, page_size, head_dim], so every layer
of every step copied the layer's whole pool into that layout, and prefill chunks went through
XLA's attention over gathered pages.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from serving.models.cache import SCRATCH_PAGE
from serving.models.ops import TpuXlaOps

log = logging.getLogger(__name__)
NEG_INF = -1e30  # a masked score: finite, so that a row with nothing visible yet gives no NaN


def _unpack(x: jax.Array, k: int) -> jax.Array:
    """Byte k (0: the lowest) of int32 lanes x as float32: the int8 value 4j + k of lane j."""
    return jax.lax.shift_right_arithmetic(jax.lax.shift_left(x, 24 - 8 * k), 24).astype(jnp.float32)


def _kernel(
    # scalar prefetch
    layer_ref, tables_ref, seq_ref, start_ref, rows_ref,
    # inputs (q, k, v, and an int8 pool's k and v scales), outputs (out, lse), scratch (k and v
    # buffers, the scales' buffers, the DMA semaphores, the output's accumulators)
    *refs,
    block_q: int, segments: int, groups: int, kv_heads: int, head_dim: int, pages_per_block: int,
    page_size: int, max_pages: int, sm_scale: float, causal: bool, scale_heads: int,
):
    """One block of queries: `segments` units of block_q tokens, each over its own sequence's
    pages a kv block at a time, every kv head at once.

    A kv block's keys arrive as the pool stores them, [span, lanes] with kv head h in lanes
    [h * width, (h + 1) * width) (int8: `pieces` = 4 values a lane, piece k holding dims 4j + k;
    float: one piece, the head's dims). The block's queries arrive in the same lanes, q [rows_q,
    pieces x lanes] (row (s, t, g): unit s's token t, query head h * groups + g in head h's lanes
    of each piece), and are laid out block-diagonally: [segments x kv_heads x block_q x groups,
    lanes] a piece, rows (s, h, t, g), zero outside head h's lanes (one selection dot). Then one
    dot per piece gives every head's scores for a unit [kv_heads x block_q x groups, span], and
    one dot per piece of the weights with the values every head's output in its own lanes (the
    rest dropped at the end, one more selection dot back to q's rows). Every array stays
    lane-dense (no head's narrow slice of lanes is cut out), the MXU sees a few large dots, and a
    decode step's units (one token each) need no padding to a sublane tile.

    An int8 pool's scales (per position and head, or per position) multiply the scores and the
    weights in float32; its int8 values are exact in bfloat16, so its dots lose nothing to them."""
    quantized = scale_heads > 0
    if quantized:
        q_ref, k_hbm, v_hbm, ks_hbm, vs_hbm, o_ref, lse_ref, k_buf, v_buf, ks_buf, vs_buf, sems, acc_ref = refs
    else:
        q_ref, k_hbm, v_hbm, o_ref, lse_ref, k_buf, v_buf, sems, acc_ref = refs
    b = pl.program_id(0)
    units = pl.num_programs(0) * segments
    layer = layer_ref[0]
    pieces = 4 if quantized else 1
    width = head_dim // pieces  # a head's lanes in a piece
    lanes = kv_heads * width
    span = pages_per_block * page_size  # positions of one kv block
    per_unit = block_q * groups  # q's rows of a unit
    unit_rows = kv_heads * per_unit  # a unit's block-diagonal rows (h, t, g)
    rows = segments * unit_rows
    # the dots' inputs in bfloat16 over a bfloat16 pool or bfloat16 queries (the MXU's own;
    # float32 passes cost several), accumulated in float32
    dot = jnp.bfloat16 if (q_ref if quantized else k_buf).dtype == jnp.bfloat16 else jnp.float32
    exact = jax.lax.Precision.HIGHEST if dot == jnp.float32 else None  # a selection dot must not round

    def iota(shape, axis):
        return jax.lax.broadcasted_iota(jnp.int32, shape, axis)

    def kv_blocks(unit):
        """How many kv blocks unit `unit` reads."""
        kv_len = start_ref[unit] + (rows_ref[unit] if causal else 0)  # not causal: every token sees [0, start)
        return jnp.where((rows_ref[unit] > 0) & (kv_len > 0), jax.lax.div(kv_len + span - 1, span), 0)  # lax: no sign handling

    def copies(unit, kv_block, slot):
        """The DMAs of unit `unit`'s kv block `kv_block` into buffer `slot` (k and v, and their scales)."""
        out = []
        for p in range(pages_per_block):
            column = jnp.minimum(kv_block * pages_per_block + p, max_pages - 1)
            page = tables_ref[seq_ref[unit], column]
            out.append(pltpu.make_async_copy(k_hbm.at[layer, page], k_buf.at[slot, p], sems.at[0, slot]))
            out.append(pltpu.make_async_copy(v_hbm.at[layer, page], v_buf.at[slot, p], sems.at[1, slot]))
            if quantized:
                rows_at = (page, pl.ds(layer, 1))
                out.append(pltpu.make_async_copy(ks_hbm.at[rows_at], ks_buf.at[slot, pl.ds(p, 1)], sems.at[2, slot]))
                out.append(pltpu.make_async_copy(vs_hbm.at[rows_at], vs_buf.at[slot, pl.ds(p, 1)], sems.at[3, slot]))
        return out

    # A unit's first kv block goes into slot 2 + unit % 2, copied while the unit before it computes
    # (its DMAs started at that unit's start), the rest alternate in slots 0 and 1.
    @pl.when((b == 0) & (kv_blocks(0) > 0))
    def _():  # the first unit's first kv block: no unit before it copied it
        for c in copies(0, 0, 2):
            c.start()

    # q's rows spread block-diagonally (one selection dot a piece): row (s, h, t, g) is q's row
    # (s, t, g) within head h's lanes
    r = iota((rows, per_unit * segments), 0)
    pick = (jax.lax.div(r, unit_rows) * per_unit + jax.lax.rem(r, per_unit)) == iota((rows, per_unit * segments), 1)
    pick = pick.astype(dot)  # [rows, rows_q]
    diagonal = jax.lax.div(jax.lax.rem(iota((rows, lanes), 0), unit_rows), per_unit) == jax.lax.div(iota((rows, lanes), 1), width)
    queries = [
        jnp.where(
            diagonal,
            jnp.dot(pick, (q_ref[:, k * lanes : (k + 1) * lanes].astype(jnp.float32) * sm_scale).astype(dot),
                    preferred_element_type=jnp.float32, precision=exact),
            0.0,
        ).astype(dot)
        for k in range(pieces)
    ]
    col = iota((unit_rows, span), 1)
    token = jax.lax.div(jax.lax.rem(iota((unit_rows, span), 0), per_unit), groups)
    # which scale row each of a unit's rows (h, t, g) takes: head h's, or the one row of per-token scales
    expand = (jax.lax.div(iota((unit_rows, scale_heads or 1), 0), per_unit) == iota((unit_rows, scale_heads or 1), 1))

    def by_row(scales: jax.Array) -> jax.Array:
        """A kv block's scales [pages, scale_heads x page_size] (a page's row head-major) as the
        multiplier of a unit's scores [unit_rows, span]: row (h, t, g), column p * page_size + o
        gets page p's scale of head h (or its only one) at offset o. Each head's lanes of each
        page's row go side by side into [scale_heads, span] (lane slices, no transpose), and one
        small dot spreads head h's row over its rows (a broadcast for per-token scales), in the
        dots' precision: bfloat16's over bfloat16 queries, as a dequantized value's was. (It was a
        [span, scale_heads x page_size] spread of the rows and a dot over it, as many MXU weight
        pushes as the scores' own: 930 bundles a kv block of 256 on a v5e where this is 784,
        loadtest.kernel_bundles.)"""
        heads = scale_heads or 1
        rows_of_heads = jnp.concatenate([
            jnp.concatenate([scales[p : p + 1, h * page_size : (h + 1) * page_size] for p in range(pages_per_block)], axis=1)
            for h in range(heads)
        ], axis=0).astype(dot)  # [heads, span]
        if heads == 1:
            return jnp.broadcast_to(rows_of_heads.astype(jnp.float32), (unit_rows, span))
        return jnp.dot(expand.astype(dot), rows_of_heads, preferred_element_type=jnp.float32, precision=exact)

    def piece(x: jax.Array, k: int) -> jax.Array:
        """Piece k of a kv block's keys or values [span, lanes] for the dots."""
        return (_unpack(x, k) if quantized else x).astype(dot)

    lse_parts, inverse_parts = [], []
    for s in range(segments):
        unit = b * segments + s
        start, num_kv = start_ref[unit], kv_blocks(unit)
        entry = 2 + jax.lax.rem(unit, 2)
        following = jnp.minimum(unit + 1, units - 1)

        @pl.when((unit + 1 < units) & (kv_blocks(following) > 0))
        def _(following=following):  # the next unit's first kv block, copied while this one computes
            for c in copies(following, 0, 2 + jax.lax.rem(following, 2)):
                c.start()

        # each row's last visible position: causal, its token's own; not causal, start - 1
        last = start + token if causal else jnp.full((unit_rows, span), start - 1, jnp.int32)
        mine = slice(s * unit_rows, (s + 1) * unit_rows)
        unit_queries = [q[mine] for q in queries]

        def body(i, carry, unit=unit, entry=entry, last=last, mine=mine, unit_queries=unit_queries, num_kv=num_kv):
            m, l = carry
            slot = jnp.where(i == 0, entry, jax.lax.rem(i, 2))

            @pl.when(i + 1 < num_kv)
            def _():
                for c in copies(unit, i + 1, jax.lax.rem(i + 1, 2)):
                    c.start()

            for c in copies(unit, i, slot):
                c.wait()
            keys = k_buf[slot].reshape(span, lanes)
            values = v_buf[slot].reshape(span, lanes)
            scores = sum(
                jax.lax.dot_general(unit_queries[k], piece(keys, k), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                for k in range(pieces)
            )  # [unit_rows, span]
            if quantized:
                scores = scores * by_row(ks_buf[slot])
            scores = jnp.where(i * span + col <= last, scores, NEG_INF)
            m_new = jnp.maximum(m, scores.max(axis=1, keepdims=True))
            weights = jnp.exp(scores - m_new)
            alpha = jnp.exp(m - m_new)
            l_new = alpha * l + weights.sum(axis=1, keepdims=True)
            if quantized:
                weights = weights * by_row(vs_buf[slot])
            weights = weights.astype(dot)
            for k in range(pieces):
                previous = jnp.where(i == 0, 0.0, acc_ref[k, mine])
                acc_ref[k, mine] = alpha * previous + jnp.dot(weights, piece(values, k), preferred_element_type=jnp.float32)
            return m_new, l_new

        init = (jnp.full((unit_rows, 1), NEG_INF, jnp.float32), jnp.zeros((unit_rows, 1), jnp.float32))
        m, l = jax.lax.fori_loop(0, num_kv, body, init)
        lse_parts.append(jnp.where(l > 0, m + jnp.log(jnp.maximum(l, 1e-30)), NEG_INF))  # nothing read: NEG_INF
        inverse_parts.append(jnp.where(l > 0, 1.0 / jnp.maximum(l, 1e-30), 0.0))

    lse = jnp.concatenate(lse_parts, axis=0) if segments > 1 else lse_parts[0]  # [rows, 1]
    inverse = jnp.concatenate(inverse_parts, axis=0) if segments > 1 else inverse_parts[0]
    read = inverse > 0
    for k in range(pieces):
        # a unit that read nothing: zeros (its accumulators were never written)
        out = jnp.where(diagonal & read, acc_ref[k] * inverse, 0.0)
        o_ref[:, k * lanes : (k + 1) * lanes] = jax.lax.dot_general(
            pick, out.astype(dot), (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=exact
        ).astype(o_ref.dtype)
    lse_ref[0] = jnp.transpose(jnp.broadcast_to(lse, (rows, 128)))[:1]


def _lanes_order(kv_heads: int, head_dim: int, pieces: int) -> np.ndarray:
    """The one-hot [kv_heads x head_dim, kv_heads x head_dim] that moves a row's values from
    (head, dim) order into the pool's lanes: piece k's lane h * width + j takes head h's dim
    j * pieces + k (int8: four values a lane, `serving.models.cache.to_lanes`)."""
    width = head_dim // pieces
    h, j, k = np.meshgrid(np.arange(kv_heads), np.arange(width), np.arange(pieces), indexing="ij")
    order = np.zeros((kv_heads * head_dim, kv_heads * head_dim), np.float32)
    order[(h * head_dim + j * pieces + k).ravel(), (k * kv_heads * width + h * width + j).ravel()] = 1.0
    return order


def _permute(x: jax.Array, order: np.ndarray) -> jax.Array:
    """x [rows, n] @ the one-hot `order` [n, n], exactly (one product a value): a lane shuffle on
    the MXU, where XLA's transpose of a minor axis of 4 copies slowly on a TPU."""
    got = jnp.dot(x, jnp.asarray(order, x.dtype), precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return got.astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("block_q", "segments", "pages_per_block", "causal", "interpret"))
def ragged_paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    tables: jax.Array,
    unit_seq: jax.Array,
    unit_start: jax.Array,
    unit_rows: jax.Array,
    *,
    block_q: int,
    segments: int = 1,
    pages_per_block: int = 8,
    causal: bool = True,
    interpret: bool = False,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of the packed queries q [units * block_q * groups, kv_heads, head_dim] (the module
    docstring's layout) over layer `layer` of the lanes pool k_pool, v_pool [layers, num_pages,
    page_size, kv_heads * head_dim] through tables [seqs, max_pages], unit u of block_q tokens
    being sequence unit_seq[u]'s from position unit_start[u], unit_rows[u] of them real; the
    kernel takes `segments` units a block (a decode step: block_q 1, several sequences a block).
    Token t of a unit attends to [0, unit_start[u] + t] (`causal`), or every token to
    [0, unit_start[u]) (not `causal`: the history before a chunk whose own tokens are attended
    elsewhere, merged by the log-sum-exp). Returns (out, lse): the attention output in q's layout
    and dtype, and each query row's log-sum-exp of its scores [rows, kv_heads] float32 (padding
    rows: anything; a unit with nothing to attend: zeros and NEG_INF). `pages_per_block`: pages
    a kv block copies into VMEM at once. An int8 pool (int32 lanes of four values) comes with its
    scales k_scale, v_scale [layers, num_pages, heads x page_size] (serving.models.cache)."""
    total, kv_heads, head_dim = q.shape
    _, _, page_size, width = k_pool.shape
    quantized = k_scale is not None
    if quantized:
        width *= 4  # four int8 values a lane
    if width != kv_heads * head_dim:
        raise ValueError(f"the pool's rows hold {width} values, not kv_heads x head_dim = {kv_heads * head_dim}")
    units = unit_seq.shape[0]
    groups, remainder = divmod(total, units * block_q)
    if remainder or groups < 1:
        raise ValueError(f"q holds {total} rows, not units x block_q x groups ({units} x {block_q} x groups)")
    blocks, left = divmod(units, segments)
    rows_q = segments * block_q * groups
    tile = 16 if q.dtype == jnp.bfloat16 else 8
    if left or (blocks > 1 and rows_q % tile):
        raise ValueError(f"{units} units of {block_q * groups} rows do not make blocks of {segments} units and whole {tile}-row tiles")
    pieces = 4 if quantized else 1
    kernel = functools.partial(
        _kernel, block_q=block_q, segments=segments, groups=groups, kv_heads=kv_heads, head_dim=head_dim,
        pages_per_block=pages_per_block, page_size=page_size, max_pages=tables.shape[1],
        sm_scale=1.0 / math.sqrt(head_dim), causal=causal, scale_heads=k_scale.shape[-1] // page_size if quantized else 0,
    )
    lanes = kv_heads * head_dim
    rows = rows_q * kv_heads  # a block's block-diagonal rows
    spec = pl.BlockSpec((rows_q, lanes), lambda b, *_: (b, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(blocks,),
        in_specs=[spec] + [pl.BlockSpec(memory_space=pl.ANY)] * (4 if quantized else 2),
        out_specs=[spec, pl.BlockSpec((1, 1, rows), lambda b, *_: (b, 0, 0))],
        scratch_shapes=[
            pltpu.VMEM((4, pages_per_block, *k_pool.shape[2:]), k_pool.dtype),
            pltpu.VMEM((4, pages_per_block, *v_pool.shape[2:]), v_pool.dtype),
            *([pltpu.VMEM((4, pages_per_block, k_scale.shape[-1]), jnp.float32)] * 2 if quantized else []),
            pltpu.SemaphoreType.DMA((4 if quantized else 2, 4)),
            pltpu.VMEM((pieces, rows, lanes // pieces), jnp.float32),
        ],
    )
    order = _lanes_order(kv_heads, head_dim, pieces) if quantized else None
    flat = q.reshape(total, lanes)
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((total, lanes), q.dtype), jax.ShapeDtypeStruct((blocks, 1, rows), jnp.float32)],
        # sequential: a unit waits for the copies the unit before it started (a "parallel" grid
        # split over cores would break that)
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        tables.astype(jnp.int32),
        unit_seq.astype(jnp.int32),
        unit_start.astype(jnp.int32),
        unit_rows.astype(jnp.int32),
        _permute(flat, order) if quantized else flat,
        k_pool,
        v_pool,
        # the scales page-major [num_pages, layers, heads x page_size]: how XLA stores the pool's
        # scales on a TPU (its layout {2,0,1}, from their scatter), so that this view is the same
        # bytes and no copy of them is made for the kernel (as [layers, pages, ...] there were two)
        *((jnp.swapaxes(k_scale, 0, 1), jnp.swapaxes(v_scale, 0, 1)) if quantized else ()),
    )
    if quantized:
        out = _permute(out, order.T)
    # lse's rows (s, h, t, g) a block as q's (s, t, g) by head
    lse = lse.reshape(blocks, segments, kv_heads, block_q, groups).transpose(0, 1, 3, 4, 2).reshape(total, kv_heads)
    return out.reshape(total, kv_heads, head_dim), lse


def pack_blocks(q_lens: list[int], starts: list[int], block_q: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The block metadata of sequences with q_lens[s] query tokens from position starts[s]:
    (block_seq, block_start, block_rows, offsets), offsets[s] the first block of sequence s, each
    sequence's tokens from a block boundary (a host-side helper: a step's plan is made on the host)."""
    block_seq, block_start, block_rows, offsets = [], [], [], []
    for s, (n, start) in enumerate(zip(q_lens, starts, strict=True)):
        offsets.append(len(block_seq))
        for first in range(0, n, block_q):
            block_seq.append(s)
            block_start.append(start + first)
            block_rows.append(min(block_q, n - first))
    return block_seq, block_start, block_rows, offsets


def merge(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    """Attention over two disjoint sets of positions as one: outputs [..., head_dim] weighted by
    their log-sum-exps [...] (a set with nothing in it has lse NEG_INF or -inf and weight 0)."""
    top = jnp.maximum(lse_a, lse_b)
    wa, wb = jnp.exp(lse_a - top)[..., None], jnp.exp(lse_b - top)[..., None]
    return (out_a.astype(jnp.float32) * wa + out_b.astype(jnp.float32) * wb) / (wa + wb)


def _rows_block(groups: int) -> int:
    """Tokens a query block holds: block_q x groups rows a multiple of 16 (bfloat16's sublane tile)."""
    return 16 // math.gcd(16, groups)


# What `vmem_bytes` may estimate for the kernel to be used. Calibrated by compiling the kernel for a
# v5e with Mosaic (on a CPU host, libtpu's compiler) against its default scoped VMEM: these compiled,
# estimated 12.9 MiB (kv_heads x head_dim 16 x 128, int8, pages of 32), 19.0 (the same, bfloat16)
# and 25.8 (16 x 128 int8, pages of 64); 32 x 128 int8 (Llama 2 7B's heads), estimated 32.8, ran
# out of VMEM. The estimate counts every buffer as live at once, so it reads above the real peak.
VMEM_BUDGET = 26 << 20


def vmem_bytes(
    kv_heads: int, head_dim: int, groups: int, page_size: int, pages_per_block: int, position_bytes: int, quantized: bool
) -> int:
    """An upper estimate of the kernel's VMEM at these shapes (a pool of `position_bytes` a
    position, all kv heads): the k and v buffers and their scales' (4 kv blocks each), a block's
    accumulators and block-diagonal queries (kv_heads x rows_q rows), q's and the output's blocks
    (two each), and a kv block's temporaries (scores and weights, the scales' spread, the unpacked
    keys and values)."""
    rows_q = _rows_block(groups) * groups
    rows = kv_heads * rows_q
    values = kv_heads * head_dim
    span = pages_per_block * page_size
    per_page = kv_heads * page_size  # a page's scales (at most)
    pieces = 4 if quantized else 1
    buffers = 2 * 4 * pages_per_block * page_size * position_bytes
    if quantized:
        buffers += 2 * 4 * pages_per_block * per_page * 4
    block = rows * values * (4 + 2) + 2 * 2 * rows_q * values * 4
    temporaries = 6 * rows * span * 4 + 2 * span * (values // pieces) * 6
    if quantized:
        temporaries += 2 * (span * per_page * 7 + rows * per_page * 2)
    return buffers + block + temporaries


class RaggedPagedOps(TpuXlaOps):
    """XLA's ops on TPUs over the lanes pool, except attention: each row's cached positions read in
    place by the ragged paged kernel, float or int8 pages (no window of pages gathered, so one
    window is all the engine compiles), its own new tokens attended by XLA, the two merged by
    their log-sum-exps. MaxText's `use_ragged_attention=true` selects it on TPUs
    (serving.kernels.backend)."""

    name = "ragged-tpu"
    chunks_in_place = True  # a chunk's history through the kernel: one history window
    # Prefill lengths from 16 (XLA's attention on a TPU: from 128; the kernel packs a chunk's
    # queries in units of 16 / gcd(16, groups) tokens, whole in 16). With one history window a
    # length costs a few programs (one a rows bucket), not one per window; and a burst's prefix hits
    # leave rests of a dozen tokens or so (64 rests of ~13 padded to 128 were 0.62 s of a 2.2 s
    # batch on a v5e, 8,192 padded tokens for ~830). 64 rows x 16 is still 1,024 rows for the MXU's
    # dots. On a v5e (2026-12-07, the 1B shape, HTTP at 64 with 64 rests of 14 tokens a wave,
    # alternating): 32 -> 16 took each wave's prefill from 54 to 35 ms of the device and HTTP from
    # 0.846x / 0.849x to 0.864x / 0.863x of the engine alone; 4 more programs before ready.
    min_prefill_bucket = 16
    # Prompt lengths 16, 32, 64, 128, ... (the rows' counts still grow by 4: 1, 4, 16, 64): a burst
    # of 64 prompts of ~45-60 tokens padded to 128 took one prefill call of 8,192 padded tokens for ~3,600
    # (153 ms on a v5e, 0.18 of the batch's time at 128 tokens each; the offline driver then ran at
    # 0.74x the engine alone). Seven more programs than growth by 4, compiled in parallel before ready.
    length_growth = 2

    def __init__(self, pages_per_block: int = 8, interpret: bool = False, int8_matmul=None):
        """`interpret`: the kernel in Pallas' interpret mode (a CPU's tests, from any thread);
        `int8_matmul`: TpuXlaOps'."""
        super().__init__(int8_matmul)
        if pages_per_block < 1:
            raise ValueError(f"pages_per_block must be at least 1, got {pages_per_block}")
        self.pages_per_block = pages_per_block
        self.interpret = interpret

    def reads_cache_in_place(self, cfg, cache_dtype, dtype) -> bool:
        return True

    def serves(self, cfg, quantized_kv: bool, cache_dtype, page_size: int) -> bool:
        """Whether the kernel's VMEM at `cfg`'s shapes (`vmem_bytes`) fits `VMEM_BUDGET`; if not
        (logged), the engine selects its backend without the kernel: a model of many kv heads
        (multi-head attention, Llama 2's) stays served, by XLA's attention."""
        position = cfg.num_kv_heads * cfg.head_dim * (1 if quantized_kv else jnp.dtype(cache_dtype).itemsize)
        need = vmem_bytes(cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads, page_size,
                          self.pages_per_block, position, quantized_kv)
        if need <= VMEM_BUDGET:
            return True
        log.warning(
            "use_ragged_attention: the ragged paged kernel would need ~%.1f MiB of VMEM for %d kv heads of %d "
            "(%d pages a kv block; at most %.1f MiB); the backend is selected without it",
            need / 2**20, cfg.num_kv_heads, cfg.head_dim, self.pages_per_block, VMEM_BUDGET / 2**20,
        )
        return False

    def _history(self, q: jax.Array, cache, layer, pages: jax.Array, starts: jax.Array, lengths: jax.Array):
        """Attention of q [batch, seq, kv_heads, groups, head_dim] over each row's positions
        [0, starts[b]), its first lengths[b] tokens: (out [batch, seq, kv_heads, groups, head_dim]
        in q's dtype, lse [batch, seq, kv_heads, groups] float32). A decode step's rows (seq 1) go several to
        a kernel block, a unit each; a chunk's rows in units of a block's tokens."""
        batch, seq, kv_heads, groups, head_dim = q.shape
        tile = _rows_block(groups)
        block_q, segments = (1, tile) if seq == 1 else (tile, 1)
        per_row = -(-seq // block_q)
        units = batch * per_row
        padded_units = -(-units // segments) * segments
        padded = jnp.pad(q, ((0, 0), (0, per_row * block_q - seq), (0, 0), (0, 0), (0, 0)))
        packed = padded.transpose(0, 1, 3, 2, 4).reshape(units * block_q * groups, kv_heads, head_dim)  # rows (b, t, g)
        packed = jnp.pad(packed, ((0, (padded_units - units) * block_q * groups), (0, 0), (0, 0)))
        parked = pages[:, 0] == SCRATCH_PAGE
        rows = jnp.clip(lengths[:, None] - jnp.arange(per_row)[None, :] * block_q, 0, block_q)
        rows = jnp.where(parked[:, None], 0, rows).reshape(-1)

        def units_of(x: jax.Array) -> jax.Array:  # a unit's value, the padding units' 0
            return jnp.pad(x, (0, padded_units - units))

        out, lse = ragged_paged_attention(
            packed, cache.k, cache.v, layer, pages, units_of(jnp.repeat(jnp.arange(batch), per_row)),
            units_of(jnp.repeat(starts, per_row)), units_of(rows), block_q=block_q, segments=segments,
            pages_per_block=self.pages_per_block, causal=False, interpret=self.interpret, k_scale=cache.k_scale,
            v_scale=cache.v_scale,
        )
        real = units * block_q * groups
        out = out[:real].reshape(batch, per_row * block_q, groups, kv_heads, head_dim)[:, :seq].transpose(0, 1, 3, 2, 4)
        lse = lse[:real].reshape(batch, per_row * block_q, groups, kv_heads)[:, :seq].transpose(0, 1, 3, 2)
        return out, lse

    def decode_attention(self, q, cache, layer, positions, k_new, v_new, window, pages):
        if not cache.lanes:
            return super().decode_attention(q, cache, layer, positions, k_new, v_new, window, pages)
        out, lse = self._history(q, cache, layer, pages, positions, jnp.ones_like(positions))
        own = jnp.einsum("bhgd,bhd->bhg", q[:, 0].astype(jnp.float32), k_new.astype(jnp.float32))
        own = own / math.sqrt(q.shape[-1])
        values = jnp.broadcast_to(v_new[:, :, None, :], q[:, 0].shape)
        return merge(out[:, 0], lse[:, 0], values, own)[:, None].astype(q.dtype)

    def chunk_attention(self, q, cache, layer, starts, k_new, v_new, mask, window, pages, lengths):
        if not cache.lanes:
            return super().chunk_attention(q, cache, layer, starts, k_new, v_new, mask, window, pages, lengths)
        # A call of fresh prompts only (every start 0: a burst's first chunks) has no history to
        # read: the kernel's walk over its units is skipped (on a v5e, 6.6 of a 64-prompt call's
        # 80.6 ms).
        out, lse = jax.lax.cond(
            jnp.any(starts > 0),
            lambda: self._history(q, cache, layer, pages, starts, lengths),
            lambda: (jnp.zeros_like(q), jnp.full(q.shape[:-1], NEG_INF, jnp.float32)),
        )
        # The chunk's own tokens as XLA's attention takes them (serving.models.layers.attend): the
        # dots in the activations' dtype, accumulated in float32, the probabilities in v's dtype
        # (not float32 copies of q, k and v: on a TPU the MXU rounds a float32 dot's inputs to
        # bfloat16 at the default precision anyway).
        scores = jnp.einsum("bshgd,bthd->bshgt", q, k_new, preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(q.shape[-1])
        own_mask = mask[:, :, None, None, window:]  # [batch, seq, 1, 1, seq]: causal up to the row's length
        scores = jnp.where(own_mask, scores, -jnp.inf)
        own_lse = jax.nn.logsumexp(scores, axis=-1)
        weights = jnp.exp(scores - jnp.where(jnp.isfinite(own_lse), own_lse, 0.0)[..., None])
        own = jnp.einsum("bshgt,bthd->bshgd", weights.astype(v_new.dtype), v_new, preferred_element_type=jnp.float32)
        return merge(out, lse, own, own_lse).astype(q.dtype)

    def describe(self) -> str:
        dots = "XLA's dots" if self.int8_matmul is None else "int8w matmuls through pathserve's Pallas kernel"
        return f"pathserve's ragged paged attention kernel over a lanes-layout page pool (TPU), {dots}"
