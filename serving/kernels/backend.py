"""The CPU-kernel backend: the model's ops (serving.models.ops) on x86 CPUs through the kernels of
this package, with the weight layout those kernels read (serving.kernels.packing).

`select` is the one place a backend is chosen; the engine calls it once and hands the result to
every compiled step. Where the kernels cannot run, it returns XLA's ops and logs why.
"""

from __future__ import annotations

import copy
import logging

import jax
import jax.numpy as jnp

from serving.errors import ConfigError
from serving.kernels import cpu_attention, cpu_matmul, library, packing
from serving.kernels.support import weights_unsupported
from serving.models.cache import KVCache
from serving.models.config import ModelConfig
from serving.models.ops import TPU_XLA, XLA, TpuXlaOps, XlaOps

log = logging.getLogger(__name__)


class CpuKernelOps(XlaOps):
    """XLA's ops, except: matmuls of packed weights, and attention over a float32 or int8 cache
    (decode steps, chunks and verify calls), run as XLA FFI calls into the kernels, which read
    weights and cache in place."""

    name = "cpu-kernels"
    # Set by `counting` on a copy made inside a traced forward pass: int32 [groups] and the span.
    _counts: jax.Array | None = None
    _span: int = 0

    def matmul(self, x: jax.Array, w) -> jax.Array:
        if isinstance(w, cpu_matmul.PackedWeight):
            return cpu_matmul.matmul(x, w, counts=self._counts_for(x)).astype(x.dtype)
        return super().matmul(x, w)

    def counting(self, counts: jax.Array, span: int) -> CpuKernelOps:
        """A copy whose matmuls compute only the rows that count (cpu_matmul.matmul's `counts`):
        a prompt's padding and a decode call's inactive rows cost nothing (the mixed benchmark's
        prefill padded 19% of its tokens to length buckets; a decode bucket ~12% of its rows)."""
        out = copy.copy(self)
        out._counts, out._span = counts.astype(jnp.int32), span
        return out

    def _counts_for(self, x: jax.Array) -> jax.Array | None:
        """`counting`'s counts where x [groups, span, in] (or [groups, in] with span 1) is shaped
        as they describe: not for the head on each row's last position, say."""
        if self._counts is None:
            return None
        lead, groups = x.shape[:-1], self._counts.shape[0]
        return self._counts if lead == (groups, self._span) or (self._span == 1 and lead == (groups,)) else None

    def matmuls(self, x: jax.Array, layer: dict, names: tuple[str, ...]) -> tuple[jax.Array, ...]:
        fused = packing.FUSED.get(names)
        if fused is None or fused not in layer:
            return super().matmuls(x, layer, names)
        weight = layer[fused]  # one kernel call for the matmuls that share x
        out = self.matmul(x, weight)
        return tuple(jnp.split(out, _running_sums(list(weight.parts[:-1])), axis=-1))

    def decode_attention(self, q, cache: KVCache, layer, positions, k_new, v_new, window, pages):
        if not self.reads_cache_in_place_for(cache.k.dtype, q):
            return super().decode_attention(q, cache, layer, positions, k_new, v_new, window, pages)
        out = cpu_attention.paged_attention(q[:, 0], *cache, layer, positions, k_new, v_new, pages)
        return out[:, None].astype(q.dtype)

    def chunk_attention(self, q, cache: KVCache, layer, starts, k_new, v_new, mask, window, pages, lengths):
        if not self.reads_cache_in_place_for(cache.k.dtype, q):
            return super().chunk_attention(q, cache, layer, starts, k_new, v_new, mask, window, pages, lengths)
        return cpu_attention.paged_attention(q, *cache, layer, starts, k_new, v_new, pages, lengths).astype(q.dtype)

    def reads_cache_in_place(self, cfg: ModelConfig, cache_dtype: jnp.dtype, dtype: jnp.dtype) -> bool:
        return jnp.dtype(dtype) == jnp.float32 and cpu_attention.supports(
            cache_dtype, cfg.head_dim, cfg.num_groups
        )

    def reads_cache_in_place_for(self, cache_dtype: jnp.dtype, q: jax.Array) -> bool:
        """`reads_cache_in_place` from a traced query [batch, seq, kv_heads, groups, head_dim]."""
        return q.dtype == jnp.float32 and cpu_attention.supports(cache_dtype, q.shape[-1], q.shape[-2])

    def split_layers(self, layers: dict) -> tuple[dict, dict]:
        in_place = {name: w for name, w in layers.items() if isinstance(w, cpu_matmul.PackedWeight)}
        return {name: w for name, w in layers.items() if name not in in_place}, in_place

    def at_layer(self, in_place: dict, index) -> dict:
        return {name: w.at_layer(index) for name, w in in_place.items()}

    def prepare(self, params: dict) -> dict:
        return packing.pack_params(params)

    def describe(self) -> str:
        status = library.status()
        return f"the CPU kernels ({status.isa}: {status.detail})"


def _running_sums(sizes: list[int]) -> list[int]:
    out, total = [], 0
    for size in sizes:
        total += size
        out.append(total)
    return out


def _said_int8(kernel) -> None:
    """The int8 matmul kernel, where it is handed to the ops, logged."""
    if kernel is not None:
        from serving.kernels.int8_matmul import MAX_ROWS

        log.info("int8w matmuls of up to %d rows run through the Pallas int8 matmul kernel", MAX_ROWS)


def select(
    cpu_kernels: str,
    quantization: str,
    weight_dtype: str,
    devices: list,
    pages_per_compute_block: int = 4,
    attention: str = "autoselected",
    ragged_pages: int = 0,
    int8_matmul_kernel: bool = False,
) -> XlaOps:
    """The ops the engine runs with (`cpu_kernels`: auto, on or off); logs which and why.

    On TPUs (every device a TPU) decode attention runs JAX's Pallas paged-attention kernel
    (serving.kernels.tpu_paged) with MaxText's `attention=paged` (or XLA's where that does not
    import), else XLA's, which gathers only the pages of each call's attention window: the kernel
    copies the layer's whole pool into its layout in every layer of every step, so with a pool
    sized for every slot's max_target_length it read ~22 ms a token of the 1B shape at batch 1
    on a v5e (loadtest.tpu_probe), where the gather reads what the live rows hold. `cpu_kernels`
    names the CPU kernels, so only `on` changes that (it raises there, as on any device but one CPU).
    `on` raises ConfigError where the kernels cannot run; `auto` falls back to XLA's ops.
    `ragged_pages` (MaxText's use_ragged_attention, its ragged_block_size in pages; 0: off): on
    one TPU, attention through pathserve's ragged paged kernel, that many pages a block
    (serving.kernels.ragged_paged), before `attention=paged`; its calls are not sharded yet, so
    on several TPUs attention stays XLA's (logged). `int8_matmul_kernel`: on one TPU with int8w
    weights, their matmuls in calls of up to 256 rows through pathserve's Pallas kernel
    (serving.kernels.int8_matmul); elsewhere logged as without effect."""
    on_tpus = cpu_kernels != "on" and devices and all(device.platform == "tpu" for device in devices)
    int8_matmul = None
    if int8_matmul_kernel and not (on_tpus and len(devices) == 1 and quantization == "int8w"):
        log.warning(  # its calls are not sharded: on several chips XLA would gather each weight whole
            "int8_matmul_kernel: the int8 matmul kernel runs int8w weights on one TPU; here XLA's matmuls run"
        )
    elif int8_matmul_kernel:
        from serving.kernels.int8_matmul import Int8MatmulKernel

        int8_matmul = Int8MatmulKernel()
    if on_tpus:
        if ragged_pages and len(devices) > 1:
            log.warning(
                "use_ragged_attention: the ragged paged kernel runs on one TPU (its calls are not sharded yet); "
                "attention on these %d TPUs stays XLA's", len(devices),
            )
        elif ragged_pages:
            from serving.kernels.ragged_paged import RaggedPagedOps

            log.info("attention reads the pages in place through the ragged paged kernel on %d TPUs", len(devices))
            _said_int8(int8_matmul)
            return RaggedPagedOps(pages_per_block=ragged_pages, int8_matmul=int8_matmul)
        if attention != "paged":
            log.info("decode attention gathers each call's window of pages with XLA on %d TPUs", len(devices))
            _said_int8(int8_matmul)
            return TPU_XLA if int8_matmul is None else TpuXlaOps(int8_matmul)
        if int8_matmul is not None:
            log.warning("int8_matmul_kernel: not beside attention=paged (JAX's paged kernel); XLA's matmuls run")
        try:
            from serving.kernels.tpu_paged import PallasPagedOps
        except ImportError as error:
            log.info("decode attention uses XLA's; the Pallas kernel did not import (%s)", error)
            return XLA
        log.info("decode attention runs JAX's Pallas paged-attention kernel on %d TPUs", len(devices))
        return PallasPagedOps(pages_per_compute_block=pages_per_compute_block)
    if ragged_pages:
        log.warning("use_ragged_attention: the ragged paged kernel runs on TPUs; attention here is the backend's own")
    if cpu_kernels == "off":
        return XLA
    reason = weights_unsupported(quantization, weight_dtype)
    if reason is None and (len(devices) != 1 or devices[0].platform != "cpu"):
        reason = f"they run on one CPU device, not {len(devices)} {devices[0].platform} device(s)"
    if reason is None:
        status = library.status()
        reason = status.detail if not status.available else weights_unsupported(quantization, weight_dtype, status.isa)
        if reason is None:
            log.info("matmuls run through the CPU kernels (%s, %s)", status.isa, status.detail)
            return CpuKernelOps()
    if cpu_kernels == "on":
        raise ConfigError(f"cpu_kernels=on, but the CPU kernels cannot be used: {reason}")
    log.info("matmuls use XLA's dot; the CPU kernels are not used: %s", reason)
    return XLA
