"""Ragged paged attention for TPU (Pallas): the queries of many sequences, each a different number
of tokens (a decode step's 1, a prompt chunk's hundreds), in one call, reading every sequence's
cached keys and values in place through its block table from the lanes page pool
(serving.models.cache), with no copy of the pool.

The layout of a call:

- queries: the step's tokens packed sequence after sequence, each sequence's from a block
  boundary: q [kv_heads, blocks * block_q * groups, head_dim], row (t * groups + g) of a block
  the query head (h * groups + g) of its token t; a sequence's last block may hold fewer real
  tokens than block_q (`block_rows`), the rest is padding whose output is anything.
- per block (scalar-prefetched, int32 [blocks]): the table row of its sequence (`block_seq`),
  the position of its first token (`block_start`), and its real tokens (`block_rows`, 0: an
  empty block, skipped). Token t of block b is at position block_start[b] + t and attends to the
  positions [0, block_start[b] + t] (causal within a chunk, the cached history before it).
- the pool, k and v [layers, num_pages, page_size, kv_heads * head_dim] (the lanes layout; int8
  values four to an int32 lane, with their scales), read in place in HBM. Causal, every position
  a token attends to is read from pages, its own included (written there before the call);
  `RaggedPagedOps` calls it history-only instead (every token of a row sees [0, start)), the
  call's own new tokens attended by XLA beside it, since the model writes them into the pool
  after its layer loop.

Per block the kernel walks the sequence's pages `pages_per_block` at a time (a kv block), copying
each kv block's pages from HBM into VMEM while it computes the one before (two buffers, one DMA
semaphore each), with an online softmax per kv head in float32; a block's first kv block is
copied while the block before it computes (two more buffers, by the blocks' parity), so that a
decode step's sequences, one kv block each, do not each wait for their pages. Only the kv blocks up to the
block's last position are read: a decode step reads each sequence's live pages once per layer.

Why not JAX's own paged_attention kernel (serving.kernels.tpu_paged): it takes one query token
per sequence and a pool in its own layout [kv_heads, pages, page_size, head_dim], so every layer
of every step copied the layer's whole pool into that layout, and prefill chunks went through
XLA's attention over gathered pages.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from serving.models.cache import SCRATCH_PAGE
from serving.models.ops import TpuXlaOps

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
    block_q: int, groups: int, kv_heads: int, head_dim: int, pages_per_block: int, page_size: int,
    max_pages: int, sm_scale: float, causal: bool, scale_heads: int,
):
    """One block of queries over its sequence's pages, a kv block at a time, every kv head at once.

    A kv block's keys arrive as the pool stores them, [span, lanes] with kv head h in lanes
    [h * width, (h + 1) * width) (int8: `pieces` = 4 int8 values a lane, piece k the values of
    dims 4j + k; float: one piece, the head's dims). The block's queries arrive in the same lanes,
    q [pieces, rows, lanes] (row t * groups + g: token t, query head h * groups + g in head h's
    lanes), and are laid out block-diagonally, [kv_heads * rows, lanes] with the rows of head h
    zero outside its lanes: one dot per piece then gives every head's scores [kv_heads * rows,
    span], and one dot per piece of the weights with the values every head's output in its own
    lanes (the rest discarded at the end). Every array stays lane-dense (no head's narrow slice of
    lanes is ever cut out), the MXU sees a few large dots instead of many tiny ones.

    An int8 pool's scales (per position and head, or per position) multiply the scores and the
    weights in float32; its int8 values are exact in bfloat16, so its dots lose nothing to them."""
    quantized = scale_heads > 0
    if quantized:
        q_ref, k_hbm, v_hbm, ks_hbm, vs_hbm, o_ref, lse_ref, k_buf, v_buf, ks_buf, vs_buf, sems, acc_ref = refs
    else:
        q_ref, k_hbm, v_hbm, o_ref, lse_ref, k_buf, v_buf, sems, acc_ref = refs
    b = pl.program_id(0)
    seq, start = seq_ref[b], start_ref[b]
    layer = layer_ref[0]
    pieces = 4 if quantized else 1
    width = head_dim // pieces  # a head's lanes in a piece
    lanes = kv_heads * width
    span = pages_per_block * page_size  # positions of one kv block
    rows_q = block_q * groups
    rows = kv_heads * rows_q  # the block-diagonal rows: head h's at [h * rows_q, (h + 1) * rows_q)

    def kv_blocks(block):
        """How many kv blocks block `block` reads."""
        kv_len = start_ref[block] + (rows_ref[block] if causal else 0)  # not causal: every token sees [0, start)
        return jnp.where((rows_ref[block] > 0) & (kv_len > 0), jax.lax.div(kv_len + span - 1, span), 0)  # lax: no sign handling

    num_kv = kv_blocks(b)
    # Buffers: a block's first kv block goes into slot 2 + b % 2, copied while the block before it
    # computes (its DMAs started there, at that block's start), the rest alternate in slots 0 and 1.
    entry = 2 + jax.lax.rem(b, 2)

    def copies(kv_block, slot, seq=seq):
        """The DMAs of sequence `seq`'s kv block `kv_block` into buffer `slot` (k and v, and their scales)."""
        out = []
        for p in range(pages_per_block):
            column = jnp.minimum(kv_block * pages_per_block + p, max_pages - 1)
            page = tables_ref[seq, column]
            out.append(pltpu.make_async_copy(k_hbm.at[layer, page], k_buf.at[slot, p], sems.at[0, slot]))
            out.append(pltpu.make_async_copy(v_hbm.at[layer, page], v_buf.at[slot, p], sems.at[1, slot]))
            if quantized:
                rows_at = (page, pl.ds(layer, 1))
                out.append(pltpu.make_async_copy(ks_hbm.at[rows_at], ks_buf.at[slot, pl.ds(p, 1)], sems.at[2, slot]))
                out.append(pltpu.make_async_copy(vs_hbm.at[rows_at], vs_buf.at[slot, pl.ds(p, 1)], sems.at[3, slot]))
        return out

    def head_of(shape, axis, size):
        return jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, shape, axis), size)

    @pl.when((b == 0) & (num_kv > 0))
    def _():  # the first block's first kv block: no block before it copied it
        for c in copies(0, entry):
            c.start()

    @pl.when((b + 1 < pl.num_programs(0)) & (kv_blocks(jnp.minimum(b + 1, pl.num_programs(0) - 1)) > 0))
    def _():  # the next block's first kv block, copied while this one computes
        following = jnp.minimum(b + 1, pl.num_programs(0) - 1)
        for c in copies(0, 3 - jax.lax.rem(b, 2), seq_ref[following]):
            c.start()

    @pl.when(num_kv == 0)
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)
        lse_ref[...] = jnp.full_like(lse_ref, NEG_INF)

    @pl.when(num_kv > 0)
    def _():
        col = jax.lax.broadcasted_iota(jnp.int32, (rows, span), 1)
        token = jax.lax.div(jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, (rows, span), 0), rows_q), groups)
        # each row's last visible position: causal, its token's own; not causal, start - 1
        last = start + token if causal else jnp.full((rows, span), start - 1, jnp.int32)
        # the dots' inputs in bfloat16 over a bfloat16 pool or bfloat16 queries (the MXU's own;
        # float32 passes cost several), accumulated in float32
        dot = jnp.bfloat16 if (q_ref if quantized else k_buf).dtype == jnp.bfloat16 else jnp.float32
        diagonal = head_of((rows, lanes), 0, rows_q) == head_of((rows, lanes), 1, width)
        queries = [
            jnp.where(diagonal, jnp.concatenate([q_ref[k].astype(jnp.float32) * sm_scale] * kv_heads, axis=0), 0.0).astype(dot)
            for k in range(pieces)
        ]

        def by_row(scales: jax.Array) -> jax.Array:
            """A kv block's scales [pages, scale_heads x page_size] (a page's row head-major) as
            the multiplier of its scores [rows, span]: row r of head h, column p * page_size + o
            gets page p's scale of head h (or its only one) at offset o. Made by one dot of a
            selection: each page's row spread over its page_size columns, a head's lanes summed
            into its row; in two bfloat16 parts (their sum 16 bits of the scale's 24)."""
            per_page = scales.shape[1]
            spread = jnp.concatenate(
                [jnp.broadcast_to(scales[p : p + 1], (page_size, per_page)) for p in range(pages_per_block)], axis=0
            )  # [span, per_page]: row p * page_size + o holds page p's row
            offset = jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, (span, per_page), 0), page_size)
            spread = jnp.where(offset == jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, (span, per_page), 1), page_size), spread, 0.0)
            high = spread.astype(jnp.bfloat16)
            low = (spread - high.astype(jnp.float32)).astype(jnp.bfloat16)
            select = head_of((scale_heads, per_page), 1, page_size) == head_of((scale_heads, per_page), 0, 1)
            select = select.astype(jnp.bfloat16)  # [scale_heads, per_page]: head h's lanes
            by_head = sum(
                jax.lax.dot_general(select, part, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                for part in (high, low)
            )  # [scale_heads, span]
            return jnp.concatenate(
                [jnp.broadcast_to(by_head[min(h, scale_heads - 1) : min(h, scale_heads - 1) + 1], (rows_q, span)) for h in range(kv_heads)], axis=0
            )

        def piece(x: jax.Array, k: int) -> jax.Array:
            """Piece k of a kv block's keys or values [span, lanes] for the dots."""
            return (_unpack(x, k) if quantized else x).astype(dot)

        def body(i, carry):
            m, l = carry
            slot = jnp.where(i == 0, entry, jax.lax.rem(i, 2))

            @pl.when(i + 1 < num_kv)
            def _():
                for c in copies(i + 1, jax.lax.rem(i + 1, 2)):
                    c.start()

            for c in copies(i, slot):
                c.wait()
            keys = k_buf[slot].reshape(span, lanes)
            values = v_buf[slot].reshape(span, lanes)
            s = sum(
                jax.lax.dot_general(queries[k], piece(keys, k), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                for k in range(pieces)
            )  # [rows, span]
            if quantized:
                s = s * by_row(ks_buf[slot])
            s = jnp.where(i * span + col <= last, s, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
            weights = jnp.exp(s - m_new)
            alpha = jnp.exp(m - m_new)
            l_new = alpha * l + weights.sum(axis=1, keepdims=True)
            if quantized:
                weights = weights * by_row(vs_buf[slot])
            weights = weights.astype(dot)
            for k in range(pieces):
                previous = jnp.where(i == 0, 0.0, acc_ref[k])
                acc_ref[k] = alpha * previous + jnp.dot(weights, piece(values, k), preferred_element_type=jnp.float32)
            return m_new, l_new

        init = (jnp.full((rows, 1), NEG_INF, jnp.float32), jnp.zeros((rows, 1), jnp.float32))
        m, l = jax.lax.fori_loop(0, num_kv, body, init)
        inverse = 1.0 / l
        for k in range(pieces):
            out = jnp.where(diagonal, acc_ref[k] * inverse, 0.0)
            o_ref[k] = sum(out[h * rows_q : (h + 1) * rows_q] for h in range(kv_heads)).astype(o_ref.dtype)
        lse = m + jnp.log(l)
        for h in range(kv_heads):
            lse_ref[h] = lse[h * rows_q : (h + 1) * rows_q]


def _to_lanes(q: jax.Array, pieces: int) -> jax.Array:
    """q [kv_heads, rows, head_dim] in the pool's lanes: [pieces, rows, kv_heads x head_dim / pieces],
    piece k's lane h * width + j holding head h's dim j * pieces + k (int8: four values a lane)."""
    kv_heads, rows, head_dim = q.shape
    split = q.reshape(kv_heads, rows, head_dim // pieces, pieces)
    return split.transpose(3, 1, 0, 2).reshape(pieces, rows, -1)


def _from_lanes(out: jax.Array, kv_heads: int) -> jax.Array:
    """`_to_lanes`' inverse: [pieces, rows, lanes] as [kv_heads, rows, head_dim]."""
    pieces, rows, lanes = out.shape
    split = out.reshape(pieces, rows, kv_heads, lanes // kv_heads)
    return split.transpose(2, 1, 3, 0).reshape(kv_heads, rows, -1)


@functools.partial(jax.jit, static_argnames=("block_q", "pages_per_block", "causal", "interpret"))
def ragged_paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: jax.Array | int,
    tables: jax.Array,
    block_seq: jax.Array,
    block_start: jax.Array,
    block_rows: jax.Array,
    *,
    block_q: int,
    pages_per_block: int = 8,
    causal: bool = True,
    interpret: bool = False,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of the packed queries q [kv_heads, blocks * block_q * groups, head_dim] (the
    module docstring's layout) over layer `layer` of the lanes pool k_pool, v_pool [layers,
    num_pages, page_size, kv_heads * head_dim] through tables [seqs, max_pages], block b of
    block_q tokens being sequence block_seq[b]'s from position block_start[b], block_rows[b] of
    them real. Token t of a block attends to [0, block_start[b] + t] (`causal`), or every token
    to [0, block_start[b]) (not `causal`: the history before a chunk whose own tokens are attended
    elsewhere, merged by the log-sum-exp). Returns (out, lse): the attention output in q's layout
    and dtype, and each query row's log-sum-exp of its scores [kv_heads, rows, 1] float32 (padding
    rows: anything; a block with nothing to attend: zeros and NEG_INF). `pages_per_block`: pages
    a kv block copies into VMEM at once. An int8 pool (int32 lanes of four values) comes with its
    scales k_scale, v_scale [layers, num_pages, heads x page_size] (serving.models.cache)."""
    kv_heads, total, head_dim = q.shape
    _, _, page_size, width = k_pool.shape
    quantized = k_scale is not None
    if quantized:
        width *= 4  # four int8 values a lane
    if width != kv_heads * head_dim:
        raise ValueError(f"the pool's rows hold {width} values, not kv_heads x head_dim = {kv_heads * head_dim}")
    blocks = block_seq.shape[0]
    groups, remainder = divmod(total, blocks * block_q)
    if remainder or groups < 1:
        raise ValueError(f"q holds {total} rows a head, not blocks x block_q x groups ({blocks} x {block_q} x groups)")
    max_pages = tables.shape[1]
    shape = dict(
        block_q=block_q, groups=groups, kv_heads=kv_heads, head_dim=head_dim,
        pages_per_block=pages_per_block, page_size=page_size, max_pages=max_pages,
        sm_scale=1.0 / math.sqrt(head_dim), causal=causal,
    )
    kernel = functools.partial(_kernel, scale_heads=k_scale.shape[-1] // page_size if quantized else 0, **shape)
    rows_q = block_q * groups
    pieces = 4 if quantized else 1
    lanes = kv_heads * head_dim // pieces
    spec = pl.BlockSpec((pieces, rows_q, lanes), lambda b, *_: (0, b, 0))
    lse_spec = pl.BlockSpec((kv_heads, rows_q, 1), lambda b, *_: (0, b, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(blocks,),
        in_specs=[spec] + [pl.BlockSpec(memory_space=pl.ANY)] * (4 if quantized else 2),
        out_specs=[spec, lse_spec],
        scratch_shapes=[
            pltpu.VMEM((4, pages_per_block, *k_pool.shape[2:]), k_pool.dtype),
            pltpu.VMEM((4, pages_per_block, *v_pool.shape[2:]), v_pool.dtype),
            *([pltpu.VMEM((4, pages_per_block, k_scale.shape[-1]), jnp.float32)] * 2 if quantized else []),
            pltpu.SemaphoreType.DMA((4 if quantized else 2, 4)),
            pltpu.VMEM((pieces, kv_heads * rows_q, lanes), jnp.float32),
        ],
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((pieces, total, lanes), q.dtype), jax.ShapeDtypeStruct((kv_heads, total, 1), jnp.float32)],
        # sequential: a block waits for the copies the block before it started (a "parallel" grid
        # split over cores would break that)
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        tables.astype(jnp.int32),
        block_seq.astype(jnp.int32),
        block_start.astype(jnp.int32),
        block_rows.astype(jnp.int32),
        _to_lanes(q, pieces),
        k_pool,
        v_pool,
        # the scales page-major [num_pages, layers, heads x page_size]: how XLA stores the pool's
        # scales on a TPU (its layout {2,0,1}, from their scatter), so that this view is the same
        # bytes and no copy of them is made for the kernel (as [layers, pages, ...] there were two)
        *((jnp.swapaxes(k_scale, 0, 1), jnp.swapaxes(v_scale, 0, 1)) if quantized else ()),
    )
    return _from_lanes(out, kv_heads), lse


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


class RaggedPagedOps(TpuXlaOps):
    """XLA's ops on TPUs over the lanes pool, except attention: each row's cached positions read in
    place by the ragged paged kernel, float or int8 pages (no window of pages gathered, so one
    window is all the engine compiles), its own new tokens attended by XLA, the two merged by
    their log-sum-exps. MaxText's `use_ragged_attention=true` selects it on TPUs
    (serving.kernels.backend)."""

    name = "ragged-tpu"
    chunks_in_place = True  # a chunk's history through the kernel: one history window

    def __init__(self, pages_per_block: int = 8):
        if pages_per_block < 1:
            raise ValueError(f"pages_per_block must be at least 1, got {pages_per_block}")
        self.pages_per_block = pages_per_block

    def reads_cache_in_place(self, cfg, cache_dtype, dtype) -> bool:
        return True

    def _history(self, q: jax.Array, cache, layer, pages: jax.Array, starts: jax.Array, lengths: jax.Array):
        """Attention of q [batch, seq, kv_heads, groups, head_dim] over each row's positions
        [0, starts[b]), its first lengths[b] tokens: (out [batch, seq, kv_heads, groups, head_dim]
        float32, lse [batch, seq, kv_heads, groups])."""
        batch, seq, kv_heads, groups, head_dim = q.shape
        block_q = _rows_block(groups)
        per_row = -(-seq // block_q)
        padded = jnp.pad(q, ((0, 0), (0, per_row * block_q - seq), (0, 0), (0, 0), (0, 0)))
        packed = padded.transpose(2, 0, 1, 3, 4).reshape(kv_heads, -1, head_dim)
        parked = pages[:, 0] == SCRATCH_PAGE
        rows = jnp.clip(lengths[:, None] - jnp.arange(per_row)[None, :] * block_q, 0, block_q)
        rows = jnp.where(parked[:, None], 0, rows).reshape(-1)
        out, lse = ragged_paged_attention(
            packed, cache.k, cache.v, layer, pages, jnp.repeat(jnp.arange(batch), per_row),
            jnp.repeat(starts, per_row), rows, block_q=block_q, pages_per_block=self.pages_per_block, causal=False,
            k_scale=cache.k_scale, v_scale=cache.v_scale,
        )
        out = out.reshape(kv_heads, batch, per_row * block_q, groups, head_dim)[:, :, :seq].transpose(1, 2, 0, 3, 4)
        lse = lse.reshape(kv_heads, batch, per_row * block_q, groups)[:, :, :seq].transpose(1, 2, 0, 3)
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
        out, lse = self._history(q, cache, layer, pages, starts, lengths)
        scores = jnp.einsum("bshgd,bthd->bshgt", q.astype(jnp.float32), k_new.astype(jnp.float32))
        scores = scores / math.sqrt(q.shape[-1])
        own_mask = mask[:, :, None, None, window:]  # [batch, seq, 1, 1, seq]: causal up to the row's length
        scores = jnp.where(own_mask, scores, -jnp.inf)
        own_lse = jax.nn.logsumexp(scores, axis=-1)
        weights = jnp.exp(scores - jnp.where(jnp.isfinite(own_lse), own_lse, 0.0)[..., None])
        own = jnp.einsum("bshgt,bthd->bshgd", weights, v_new.astype(jnp.float32))
        return merge(out, lse, own, own_lse).astype(q.dtype)

    def describe(self) -> str:
        return "pathserve's ragged paged attention kernel over a lanes-layout page pool (TPU), XLA's dots"
