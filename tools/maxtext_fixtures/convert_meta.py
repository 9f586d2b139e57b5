"""Run MaxText's own Meta -> MaxText conversion for a model size it does not know.

Run with ``.venv-maxtext/bin/python``. This wraps
``maxtext.checkpoint_conversion.standalone_scripts.llama_or_mistral_ckpt`` (maxtext 0.2.5) without
copying or editing it: the module is imported, the tiny sizes are added to its ``MODEL_PARAMS_DICT``
size table, and then the same two calls its ``__main__`` block makes are made
(``convert_to_jax_weights`` then ``save_weights_to_checkpoint`` with the script's own
``SIMULATED_CPU_DEVICES_COUNT``, OCDBT and zarr3 on, as the script's defaults).

    python tools/maxtext_fixtures/convert_meta.py --base-model-path META_DIR \
        --maxtext-model-path OUT_DIR --model-size llama3-tiny|llama3.1-tiny

The size names matter to the script: ``model_size[:6] == "llama3"`` selects Llama 3's
vocab-parallel embedding concatenation, and ``model_size[:8] == "llama3.1"`` skips
``permute_to_match_maxtext_rope`` (Meta's interleaved q/k layout is kept for llama3.1).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The same entry for both: only the name differs (it selects the rope layout in the script).
TINY = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "dims_per_head": 16, "vocab": 320}
TINY_SIZES = {"llama3-tiny": dict(TINY), "llama3.1-tiny": dict(TINY)}


def main() -> None:
    from maxtext.checkpoint_conversion.standalone_scripts import llama_or_mistral_ckpt as script
    from maxtext.checkpoint_conversion.utils.utils import save_weights_to_checkpoint
    from maxtext.inference.inference_utils import str2bool

    script.MODEL_PARAMS_DICT.update(TINY_SIZES)

    parser = argparse.ArgumentParser()
    parser.add_argument("--base-model-path", type=str, required=True)
    parser.add_argument("--maxtext-model-path", type=str, required=True)
    parser.add_argument("--model-size", type=str, required=True)
    parser.add_argument("--use-ocdbt", type=str2bool, required=False, default=True)
    parser.add_argument("--use-zarr3", type=str2bool, required=False, default=True)
    args = parser.parse_args()
    if args.model_size not in script.MODEL_PARAMS_DICT:
        raise NotImplementedError(args.model_size)

    # As in the script's __main__ (set before the first JAX computation initialises the backend).
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={script.SIMULATED_CPU_DEVICES_COUNT}"
    save_weights_to_checkpoint(
        args.maxtext_model_path,
        script.convert_to_jax_weights(args.base_model_path, args.model_size, False),
        script.SIMULATED_CPU_DEVICES_COUNT,
        args.use_ocdbt,
        args.use_zarr3,
    )
    print(f"Successfully saved base_weights to {args.maxtext_model_path}.")


if __name__ == "__main__":
    main()
