"""Holds vLLM to AVX2 on a CPU that has more: Python imports this module at start-up in every process
whose PYTHONPATH names this directory (`python -m loadtest.peers --isa avx2` gives it to vLLM's
server, its engine process and the matmul probe). torch then reports no AVX-512 and no AMX, so vLLM
loads its AVX2 kernels (vllm._C_AVX2) and takes its AVX2 paths, as on a CPU without them; oneDNN's
and ATen's own code are capped by ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY beside it."""

import torch.cpu

for _name in (
    "_is_avx512_supported",
    "_is_avx512_vnni_supported",
    "_is_avx512_bf16_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
