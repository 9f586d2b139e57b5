"""serving.checkpoints.layout.ParamsBuilder: a checkpoint's [out, in] weights, handed over as
transposed views, are stacked as stored and transposed by XLA at the end; the params equal those
built from contiguous copies, whatever mix of views and copies a key's layers come in."""

from __future__ import annotations

import numpy as np
import pytest

from serving.checkpoints.layout import ParamKey, ParamsBuilder
from serving.config import load_model_config


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transposed_views_build_the_same_params_as_copies(dtype):
    cfg = load_model_config("tiny-random")
    rng = np.random.default_rng(0)
    from serving.models.params import LAYER_KEYS, param_shapes

    shapes = param_shapes(cfg)
    tensors = []  # (key, [in, out] contiguous, its [out, in] storage)
    for name, shape in shapes.items():
        layers = range(cfg.num_layers) if name in LAYER_KEYS else [None]
        for layer in layers:
            value = rng.standard_normal(shape).astype(np.float32)
            tensors.append((ParamKey(name, layer), value, np.ascontiguousarray(value.T)))
    plain, viewed, mixed = ParamsBuilder(cfg, dtype), ParamsBuilder(cfg, dtype), ParamsBuilder(cfg, dtype)
    for i, (key, value, stored) in enumerate(tensors):
        plain.add(key, value, key.name)
        view = stored.T if value.ndim == 2 else value
        viewed.add(key, view, key.name)
        mixed.add(key, view if i % 2 else np.ascontiguousarray(view), key.name)  # layers alternate
    want, got, got_mixed = plain.build(), viewed.build(), mixed.build()
    assert viewed._stored_transposed and not plain._stored_transposed
    for name in want["layers"]:
        assert got["layers"][name].shape == want["layers"][name].shape
        np.testing.assert_array_equal(np.asarray(got["layers"][name]), np.asarray(want["layers"][name]))
        np.testing.assert_array_equal(np.asarray(got_mixed["layers"][name]), np.asarray(want["layers"][name]))
    for name in (k for k in want if k != "layers"):
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))


def test_int8_entries_quantized_as_they_come_equal_quantizing_the_built_params():
    """int8 entries quantized tensor by tensor on the host while loading (the float model never
    whole on the device) hold the same values and scales as quantizing the whole float params."""
    from serving.models.params import LAYER_KEYS, param_shapes
    from serving.models.quantization import QUANTIZED, QuantizedWeight, quantize_params

    cfg = load_model_config("tiny-random")
    rng = np.random.default_rng(1)
    tensors = []
    for name, shape in param_shapes(cfg).items():
        for layer in (range(cfg.num_layers) if name in LAYER_KEYS else [None]):
            stored = np.ascontiguousarray(rng.standard_normal(shape).astype(np.float32).T)
            tensors.append((ParamKey(name, layer), stored.T))  # a [out, in] checkpoint read as [in, out]
    plain, streamed = ParamsBuilder(cfg, "float32"), ParamsBuilder(cfg, "float32", int8=QUANTIZED)
    for key, view in tensors:
        plain.add(key, view, key.name)
        streamed.add(key, view, key.name)
    want, got = quantize_params(plain.build(), QUANTIZED), streamed.build()
    layers = [(want["layers"][n], got["layers"][n]) for n in want["layers"]]
    quantized = 0
    for w, g in [*layers, *((want[n], got[n]) for n in want if n != "layers")]:
        assert type(w) is type(g)
        if isinstance(w, QuantizedWeight):
            quantized += 1
            np.testing.assert_array_equal(np.asarray(g.values), np.asarray(w.values))
            np.testing.assert_array_equal(np.asarray(g.scales), np.asarray(w.scales))
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert quantized == len([n for n in QUANTIZED if n in param_shapes(cfg)])
