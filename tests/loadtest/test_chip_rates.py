"""loadtest.tpu_bench.chip_rates on whatever device is here, small: every probe measured, the
bandwidth the best of them (on a v5e the weight-streaming matrix product reads faster than a sum)."""

from loadtest.tpu_bench import chip_rates


def test_chip_rates_report_every_bandwidth_probe_and_take_the_best():
    rates = chip_rates(64, stream_bytes=1 << 20)
    probes = rates["hbm_by_probe"]
    assert set(probes) == {"sum", "add", "matvec"} and all(v > 0 for v in probes.values())
    assert rates["hbm_bytes_per_s"] == max(probes.values())
    assert rates["bf16_flop_per_s"] > 0 and rates["int8_op_per_s"] > 0 and rates["matmul_size"] == 64
