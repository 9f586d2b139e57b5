"""What the CPU kernels can multiply, in plain Python (no JAX): the one statement of the rule that
decides what runs where in the kernels' room, read by the config's check of `cpu_kernels=on` and by
the backend's choice at run time (serving.kernels.backend.select)."""

from __future__ import annotations

INT8_MODES = ("int8", "int8w")


def weights_unsupported(quantization: str, weight_dtype: str, isa: str | None = None) -> str | None:
    """Why the CPU kernels cannot multiply these weights, or None when they can.

    `isa`: the instruction set the kernels run with (serving.kernels.library.ISA_FLAGS); None asks
    only what holds on every CPU. AVX-512 takes float32, int8w and int8 (W8A8); AVX2 the two int8."""
    if quantization not in INT8_MODES and weight_dtype != "float32":
        return f"they take float32 or int8 weights, not weight_dtype={weight_dtype}"
    if isa == "avx2" and quantization not in INT8_MODES:
        return "on AVX2 (no AVX-512 VNNI) they take int8 weights (quantization=int8w or int8), not float32"
    return None
