#!/usr/bin/env bash
# Regenerate tests/data/maxtext: golden MaxText checkpoints written by MaxText's own code.
#
#   tools/maxtext_fixtures/build.sh [OUT_DIR]        (default: tests/data/maxtext; `make maxtext-fixtures`)
#
# Three interpreters, none of them imports the other's packages:
#   .venv               the project's venv (make install): the reference HF Llamas, from the test helpers
#   .venv-maxtext       python3.12 + maxtext==0.2.5 (requirements-maxtext.txt): Meta -> scanned bf16,
#                       unscanned bf16 (force_unroll), int8 (layerwise_quantization)
#   .venv-maxtext-linen python3.12 + maxtext==0.1.0 (the last Flax Linen release) + JetStream:
#                       guide-era Linen unscanned bf16 and Linen AQT int8 (load_and_quantize_checkpoint)
# The two MaxText venvs are created here when missing. JetStream is not on PyPI at a version that
# maxtext 0.1.0 imports; JETSTREAM_SRC (a pip requirement: a git URL or a local source tree) names it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$ROOT/tools/maxtext_fixtures"
OUT="$(mkdir -p "${1:-$ROOT/tests/data/maxtext}" && cd "${1:-$ROOT/tests/data/maxtext}" && pwd)"
JETSTREAM_SRC="${JETSTREAM_SRC:-git+https://github.com/AI-Hypercomputer/JetStream@acd4f5ad50ed2fb38e0e5bd7defd81e34a62706c}"
PY="$ROOT/.venv/bin/python"
MT_VENV="$ROOT/.venv-maxtext"
ML_VENV="$ROOT/.venv-maxtext-linen"
MT="$MT_VENV/bin/python"
ML="$ML_VENV/bin/python"
export JAX_PLATFORMS=cpu

find_python312() {
  local p
  for p in "${PYTHON312:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -n "$p" ] || continue
    if "$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then echo "$p"; return; fi
  done
  echo "build.sh: python3.12 not found (set PYTHON312=/path/to/python3.12)" >&2
  exit 1
}

make_venv() {  # make_venv DIR REQUIREMENTS [EXTRA_REQUIREMENT]
  local dir="$1" req="$2" extra="${3:-}"
  if [ -f "$dir/.installed" ] && cmp -s "$req" "$dir/.installed"; then return; fi
  echo "== creating $dir"
  rm -rf "$dir"
  "$(find_python312)" -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --upgrade pip
  "$dir/bin/python" -m pip install --quiet --no-deps -r "$req"
  if [ -n "$extra" ]; then "$dir/bin/python" -m pip install --quiet --no-deps "$extra"; fi
  cp "$req" "$dir/.installed"
}

[ -x "$PY" ] || { echo "build.sh: $PY missing; run make install first" >&2; exit 1; }
make_venv "$MT_VENV" "$HERE/requirements-maxtext.txt"
make_venv "$ML_VENV" "$HERE/requirements-maxtext-linen.txt" "$JETSTREAM_SRC"

MT_CONFIG="$("$MT" -c 'import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml"))')"
ML_CONFIG="$("$ML" -c 'import MaxText, os; print(os.path.join(os.path.dirname(MaxText.__file__), "configs", "base.yml"))')"
# The tiny model, described to MaxText on top of the named llama model config.
TINY=(override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16
      base_mlp_dim=112 base_num_decoder_layers=2 vocab_size=320)
RUN=(hardware=cpu skip_jax_distributed_system=true async_checkpointing=false per_device_batch_size=1
     max_target_length=16 max_prefill_predict_length=8)
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

step() {  # step LOGNAME CMD...: run quietly, show the log's tail on failure
  local log="$WORK/$1.log"; shift
  echo "== $1 ${*:2}" | cut -c1-240
  if ! "$@" >"$log" 2>&1; then tail -40 "$log"; echo "build.sh: step failed (log above)" >&2; exit 1; fi
}

tree_txt() {  # tree_txt CHECKPOINT_ITEMS_DIR TXT
  "$MT" "$HERE/tree.py" "$1" 2>/dev/null >"$2"
}

for variant in llama3 llama3.1; do
  case "$variant" in
    llama3) dir=llama3 size=llama3-tiny model=llama3-8b ;;
    llama3.1) dir=llama31 size=llama3.1-tiny model=llama3.1-8b ;;
  esac
  base="$OUT/$dir"
  rm -rf "$base"
  mkdir -p "$base"

  # 1. The reference: transformers LlamaForCausalLM (bf16-exact float32 weights) + its Meta .pth twin.
  step "$dir-reference" "$PY" "$HERE/make_reference.py" "$variant" "$base/hf" "$WORK/$dir/meta"

  # 2. Meta -> scanned bf16 Linen TrainState (llama_or_mistral_ckpt.py, tiny size added by the wrapper).
  step "$dir-scanned" "$MT" "$HERE/convert_meta.py" --base-model-path "$WORK/$dir/meta" \
    --maxtext-model-path "$base/bf16/scanned" --model-size "$size"
  tree_txt "$base/bf16/scanned/0/items" "$base/bf16/scanned/tree.txt"

  # 3. Scanned -> unscanned bf16 (generate_param_only_checkpoint force_unroll=true; NNX dict in 0.2.5).
  step "$dir-unscanned" "$MT" -m maxtext.utils.generate_param_only_checkpoint "$MT_CONFIG" \
    base_output_directory="$base/bf16" run_name=unscanned load_parameters_path="$base/bf16/scanned/0/items" \
    model_name="$model" "${TINY[@]}" force_unroll=true scan_layers=true "${RUN[@]}"
  tree_txt "$base/bf16/unscanned/checkpoints/0/items" "$base/bf16/unscanned/tree.txt"

  # 4. Unscanned -> int8 (layerwise_quantization quantization=int8 save_quantized_params_path=...), as
  #    the guide runs it (weight_dtype=bfloat16).
  step "$dir-int8" "$MT" -m maxtext.utils.layerwise_quantization "$MT_CONFIG" \
    load_parameters_path="$base/bf16/unscanned/checkpoints/0/items" model_name="$model" "${TINY[@]}" \
    scan_layers=false weight_dtype=bfloat16 attention=dot_product quantization=int8 \
    save_quantized_params_path="$base/int8" "${RUN[@]}"
  tree_txt "$base/int8" "$base/int8.tree.txt"

  if [ "$variant" = llama3.1 ]; then
    # 4b. The same with MaxText's default weight_dtype=float32: unquantized leaves and scales are float32.
    step "$dir-int8-wf32" "$MT" -m maxtext.utils.layerwise_quantization "$MT_CONFIG" \
      load_parameters_path="$base/bf16/unscanned/checkpoints/0/items" model_name="$model" "${TINY[@]}" \
      scan_layers=false attention=dot_product quantization=int8 \
      save_quantized_params_path="$base/int8_weight_dtype_float32" "${RUN[@]}"
    tree_txt "$base/int8_weight_dtype_float32" "$base/int8_weight_dtype_float32.tree.txt"

    # 4c. The same quantized on a 2-device mesh (ici_tensor_parallelism=2), as a slice saves it: every
    #     array written in its shards (heads, mlp and vocab in halves), so that a sharded restore
    #     reads only the chunks of its shards (tests/multihost/test_maxtext_restore.py).
    step "$dir-int8-tensor2" env XLA_FLAGS=--xla_force_host_platform_device_count=2 \
      "$MT" -m maxtext.utils.layerwise_quantization "$MT_CONFIG" \
      load_parameters_path="$base/bf16/unscanned/checkpoints/0/items" model_name="$model" "${TINY[@]}" \
      scan_layers=false weight_dtype=bfloat16 attention=dot_product quantization=int8 \
      ici_fsdp_parallelism=1 ici_tensor_parallelism=2 \
      save_quantized_params_path="$base/int8_tensor2" "${RUN[@]}"
    tree_txt "$base/int8_tensor2" "$base/int8_tensor2.tree.txt"

    # 5. Guide-era Flax Linen layouts from maxtext 0.1.0, starting from the same scanned checkpoint:
    #    unscanned bf16 (params/params/decoder/layers_{i}/...) and the AQT int8 {params: {aqt, params}}.
    step "$dir-linen-unscanned" "$ML" -m MaxText.generate_param_only_checkpoint "$ML_CONFIG" \
      base_output_directory="$base/linen_bf16" run_name=unscanned load_parameters_path="$base/bf16/scanned/0/items" \
      model_name="$model" "${TINY[@]}" force_unroll=true scan_layers=true "${RUN[@]}"
    tree_txt "$base/linen_bf16/unscanned/checkpoints/0/items" "$base/linen_bf16/unscanned/tree.txt"
    step "$dir-linen-int8" "$ML" -m MaxText.load_and_quantize_checkpoint "$ML_CONFIG" \
      load_parameters_path="$base/linen_bf16/unscanned/checkpoints/0/items" model_name="$model" "${TINY[@]}" \
      scan_layers=false weight_dtype=bfloat16 attention=dot_product quantization=int8 \
      ici_fsdp_parallelism=1 ici_autoregressive_parallelism=1 ici_tensor_parallelism=-1 \
      save_quantized_params_path="$base/linen_aqt_int8" "${RUN[@]}"
    tree_txt "$base/linen_aqt_int8" "$base/linen_aqt_int8.tree.txt"
  fi
done

# Every leaf against the HF reference (exact for bf16; AQT's rule for int8), then MaxText's own
# forward pass on each checkpoint against transformers on the HF weights.
"$MT" "$HERE/verify.py" "$OUT" 2>/dev/null
"$MT" "$HERE/check_forward.py" "$OUT" --write 2>/dev/null
for python in "$PY" "$MT" "$ML"; do "$python" "$HERE/versions.py"; done >"$OUT/versions.txt"
du -sh "$OUT"
