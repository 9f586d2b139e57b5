"""The CPU kernels' weight layout: float32, weight-only int8 and W8A8 matmul weights packed for
serving.kernels.cpu_matmul, the matmuls that share an input fused into one weight, float32 weights
in the AMX layout they are exact in. Used by serving.kernels.backend, whose ops read these weights.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp

from serving.kernels import cpu_matmul, library
from serving.models.params import EMBEDDING, MATMUL_WEIGHTS
from serving.models.quantization import QuantizedWeight

log = logging.getLogger(__name__)


# Matmuls that share their input (the model asks for them together, `XlaOps.matmuls`), packed as
# one weight under this name: one kernel call instead of three or two.
FUSED = {("wq", "wk", "wv"): "wqkv", ("w_gate", "w_up"): "w_gate_up"}


def _kernel_operands(value) -> tuple[jax.Array, jax.Array | None, bool] | None:
    """(values [..., in, out], per-output scales or None, whether W8A8) of a matmul weight the
    kernels take: int8 (weight-only or W8A8), and float32 where they run with AVX-512; None for
    any other (bfloat16; float32 on AVX2)."""
    if isinstance(value, QuantizedWeight):
        return value.values, value.scales[..., 0, :], value.activations
    if value.dtype == jnp.float32 and library.status().avx512:
        return value, None, False
    return None


# AMX layouts of float32 weights, fewer bytes first: integers in blocks (cpu_matmul.BLOCK_FORMATS,
# ~2 bytes per weight), or two bfloat16 (4 bytes, as float32)
AMX_F32_LAYOUTS = (*cpu_matmul.BLOCK_FORMATS, "pairs")
_LAYOUT_NAMES = {
    "blocks8": "8-bit blocks",
    "blocks4": "4-bit blocks with an offset",
    "pairs": "bfloat16 pairs",
}


@dataclass(frozen=True)
class AmxFloat32:
    """The float32 matmul weights (key paths; a float32 embedding stands for the tied head) that the
    AMX-BF16 kernels multiply exactly, with the layouts each is exact in (AMX_F32_LAYOUTS:
    "blocks8", "blocks4": cpu_matmul.in_blocks_exactly; "pairs": cpu_matmul.splits_exactly)."""

    layouts: dict[tuple[str, ...], frozenset[str]] = field(default_factory=dict)

    def layout(self, paths: list[tuple[str, ...]]) -> str | None:
        """The layout every path (the parts of one packed weight) is exact in, fewest bytes first;
        None: the AVX-512 float32 loop."""
        for name in AMX_F32_LAYOUTS:
            if all(name in self.layouts.get(p, ()) for p in paths):
                return name
        return None

    def describe(self) -> str:
        """Each weight under the layout it takes alone (fused parts take one they all share)."""
        chosen: dict[str, list[str]] = {}
        for path in sorted(self.layouts):
            if (name := self.layout([path])) is not None:
                chosen.setdefault(_LAYOUT_NAMES[name], []).append("/".join(path))
        return "; ".join(f"{name}: {', '.join(paths)}" for name, paths in chosen.items())


def amx_float32(params: dict) -> AmxFloat32:
    """Which float32 weights are exact in which AMX layout (`AmxFloat32`); none where AMX-BF16 does
    not run.

    Decided on the concrete values, before packing is traced: the layout depends on the answer.
    """
    if not library.status().amx_bf16:
        return AmxFloat32()
    candidates: dict[tuple[str, ...], jax.Array] = {}

    def visit(tree: dict, path: tuple[str, ...]) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                visit(value, (*path, key))
            elif getattr(value, "dtype", None) == jnp.float32 and key in MATMUL_WEIGHTS:
                candidates[(*path, key)] = value
            elif getattr(value, "dtype", None) == jnp.float32 and key == EMBEDDING:
                candidates[(*path, key)] = value.T  # as the head multiplies it: [embed, vocab]

    def check(values: jax.Array) -> dict[str, jax.Array]:
        exact = {fmt: cpu_matmul.in_blocks_exactly(values, fmt) for fmt in cpu_matmul.BLOCK_FORMATS}
        return {**exact, "pairs": cpu_matmul.splits_exactly(values)}

    visit(params, ())
    checks = jax.device_get(jax.jit(lambda c: {p: check(v) for p, v in c.items()})(candidates))
    layouts = {p: frozenset(n for n, ok in exact.items() if ok) for p, exact in checks.items()}
    return AmxFloat32({p: names for p, names in layouts.items() if names})


def pack_for_cpu_kernels(params: dict, amx_f32: AmxFloat32 = AmxFloat32()) -> dict:
    """params with every matmul weight the kernels take (`_kernel_operands`) packed for them,
    the projections that share an input fused (FUSED: q, k, v; gate, up). float32 weights
    take the AMX layout `amx_f32` (see `amx_float32`) gives them.

    A tied embedding is also packed, transposed, as `lm_head`: the embedding stays for the token
    lookup, so the head costs one more copy of the table.
    """

    def pack(operands: tuple[jax.Array, jax.Array | None, bool], paths: list[tuple[str, ...]]):
        values, scales, w8a8 = operands
        if w8a8:
            return cpu_matmul.pack_w8a8(values, scales)
        if scales is not None:
            return cpu_matmul.pack(values, scales)
        layout = amx_f32.layout(paths)
        if layout in cpu_matmul.BLOCK_FORMATS:
            return cpu_matmul.pack_blocks(values, layout)
        return cpu_matmul.pack(values, amx=layout == "pairs")

    def fused(parts: list, paths: list[tuple[str, ...]]):
        """One packed weight for matmuls of the same input: fewer, larger kernel calls."""
        operands = [_kernel_operands(p) for p in parts]
        if any(o is None for o in operands) or len({(o[1] is None, o[2]) for o in operands}) != 1:
            return None
        values = jnp.concatenate([v for v, _, _ in operands], axis=-1)
        scales = None if operands[0][1] is None else jnp.concatenate([s for _, s, _ in operands], axis=-1)
        packed = pack((values, scales, operands[0][2]), paths)
        return replace(packed, parts=tuple(v.shape[-1] for v, _, _ in operands))

    def visit(tree: dict, path: tuple[str, ...]) -> dict:
        out = {}
        for members, name in FUSED.items():
            paths = [(*path, m) for m in members]
            if (
                all(m in tree for m in members)
                and (p := fused([tree[m] for m in members], paths)) is not None
            ):
                out[name] = p
        done = {m for members, name in FUSED.items() if name in out for m in members}
        for key, value in tree.items():
            if key in done:
                continue
            if isinstance(value, dict):
                out[key] = visit(value, (*path, key))
            elif key in MATMUL_WEIGHTS and (operands := _kernel_operands(value)) is not None:
                out[key] = pack(operands, [(*path, key)])
            else:
                out[key] = value
        return out

    result = visit(params, ())
    embed = params.get(EMBEDDING)
    if "lm_head" not in params and embed is not None:
        # The table is [vocab, embed] with one scale per row (token): the head's output columns.
        if isinstance(embed, QuantizedWeight):
            head = pack((embed.values.T, embed.scales[:, 0], embed.activations), [(EMBEDDING,)])
        elif _kernel_operands(embed) is not None:
            head = pack((embed.T, None, False), [(EMBEDDING,)])
        else:
            head = None
        if head is not None:
            result["lm_head"] = head
    return result


def pack_params(params: dict) -> dict:
    """params (already placed) in the kernels' layout, float32 weights in the AMX layout they are
    exact in where AMX-BF16 runs (decided on the concrete values first, then packed under jit)."""
    amx_f32 = amx_float32(params)
    if amx_f32.layouts:
        log.info(
            "float32 weights multiplied exactly on AMX-BF16 (fused parts take a layout they all share): %s",
            amx_f32.describe(),
        )
    return jax.jit(functools.partial(pack_for_cpu_kernels, amx_f32=amx_f32))(params)
