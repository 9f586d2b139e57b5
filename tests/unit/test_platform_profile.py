"""The serving profile per platform: serving.startup.platform decides (before JAX), and on a TPU
configs/serving/tpu.yml's keys lie over default.yml's; a user's keys still win."""

from __future__ import annotations

import pytest

from serving.config import ConfigError
from serving.startup import platform
from serving.startup.profile import FROM_OVERRIDE, FROM_PROFILE, given_config, serving_profile


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for name in ("PATHSERVE_PLATFORM", "JAX_PLATFORMS", *(n for n in os.environ if n.startswith("TPU_"))):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(platform.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(platform, "_has_libtpu", lambda: False)
    return monkeypatch


@pytest.mark.parametrize(
    ("env", "expected"),
    [({}, "cpu"), ({"JAX_PLATFORMS": "tpu,cpu"}, "tpu"), ({"JAX_PLATFORMS": "proxy"}, "tpu"),
     ({"JAX_PLATFORMS": "cpu"}, "cpu"), ({"JAX_PLATFORMS": "cuda"}, "gpu"),
     ({"PATHSERVE_PLATFORM": "tpu", "JAX_PLATFORMS": "cpu"}, "tpu")],
)
def test_platform_from_the_environment(clean_env, env, expected):
    for name, value in env.items():
        clean_env.setenv(name, value)
    assert platform.detect_platform() == expected


def test_a_tpu_hosts_device_files_make_it_a_tpu(clean_env):
    clean_env.setattr(platform.glob, "glob", lambda pattern: ["/dev/accel0"] if "accel" in pattern else [])
    assert platform.detect_platform() == "tpu"


def test_vfio_devices_or_tpu_variables_count_only_beside_libtpu(clean_env):
    """VFIO also binds GPUs passed through and DPDK NICs: a TPU only where libtpu is installed."""
    clean_env.setattr(platform.glob, "glob", lambda pattern: ["/dev/vfio/0"] if "vfio" in pattern else [])
    clean_env.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    assert platform.detect_platform() == "cpu"
    clean_env.setattr(platform, "_has_libtpu", lambda: True)
    assert platform.detect_platform() == "tpu"


def test_the_tpu_profile_lies_over_the_default_one(clean_env, tmp_path):
    cpu, tpu = serving_profile(False, "cpu"), serving_profile(False, "tpu")
    assert (cpu.get("dtype", "float32"), tpu["dtype"]) == ("float32", "bfloat16")
    assert tpu["quantize_kvcache"] is False and tpu["max_target_length"] == 2048 and tpu["per_device_batch_size"] == 128
    assert tpu["prefix_cache"] == cpu["prefix_cache"]  # what the TPU file leaves alone stays default.yml's
    clean_env.setenv("PATHSERVE_PLATFORM", "tpu")
    given = given_config(None, ["decode_steps_per_call=4"], str(tmp_path))
    assert given.config.dtype == "bfloat16" and given.origin("dtype") == FROM_PROFILE
    assert given.config.decode_steps_per_call == 4 and given.origin("decode_steps_per_call") == FROM_OVERRIDE


def test_an_unknown_platform_is_a_config_error(clean_env, tmp_path):
    clean_env.setenv("PATHSERVE_PLATFORM", "abacus")
    with pytest.raises(ConfigError, match="PATHSERVE_PLATFORM='abacus'"):
        given_config(None, [], str(tmp_path))


def test_the_tpu_profile_attends_through_the_ragged_kernel_unless_paged_attention_is_given(clean_env, tmp_path):
    clean_env.setenv("PATHSERVE_PLATFORM", "tpu")
    profiled = given_config(None, [], str(tmp_path))
    assert profiled.config.use_ragged_attention is True and profiled.origin("use_ragged_attention") == FROM_PROFILE
    paged = given_config(None, ["attention=paged", "pagedattn_num_pages=1024"], str(tmp_path))
    assert paged.config.use_ragged_attention is False and paged.config.attention == "paged"
    both = given_config(None, ["attention=paged", "pagedattn_num_pages=1024", "use_ragged_attention=true"], str(tmp_path))
    assert both.config.use_ragged_attention is True  # the user's own: the ragged kernel wins, as MaxText's keys say
    clean_env.setenv("PATHSERVE_PLATFORM", "cpu")
    assert given_config(None, [], str(tmp_path)).config.use_ragged_attention is False
