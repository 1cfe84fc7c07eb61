"""The benchmark's JSON contract: named figures, ratios computed from the same run, no errors."""

import os

import pytest

from posttrain.bench import sandbox as bench
from posttrain.cli.bench import run_bench
from posttrain.sandbox import isolation as iso_mod


def test_bench_reports_the_contract_keys():
    out = run_bench(
        "sandbox", ["--seconds", "0.2", "--repeats", "1", "--skip-numpy", "--service-clients", "8"]
    )
    for key in (
        "trivial_per_s",
        "trivial_p99_ms",
        "bwrap_per_s",
        "subprocess_per_s",
        "ratio_vs_bwrap",
        "isolation",
        "asserts_per_s",
        "asserts_bwrap_per_s",
    ):
        assert key in out, key
    assert out["ratio_vs_bwrap"] == pytest.approx(out["trivial_per_s"] / out["bwrap_per_s"])
    assert out["ratio_vs_subprocess"] == pytest.approx(out["trivial_per_s"] / out["subprocess_per_s"])
    assert out["trivial_errors"] == 0 and out["asserts_errors"] == 0 and out["sandbox_errors"] == 0
    assert "seccomp" in out["isolation"] and out["trivial_p50_ms"] <= out["trivial_p99_ms"]
    assert "numpy_per_s" not in out
    assert out["service_clients"] == 8 and out["service_errors"] == 0 and out["fleet_errors"] == 0
    assert out["fleet_ratio_vs_pool"] == pytest.approx(out["fleet_per_s"] / out["service_pool_per_s"])
    if "trivial_cpu_ms_per_exec" in out:  # cpuacct available: per-execution CPU and the capacity from it
        assert out["trivial_capacity_per_s"] == pytest.approx(
            out["cpu_count"] * 1000 / out["trivial_cpu_ms_per_exec"]
        )
        assert out["bwrap_cpu_ms_per_exec"] > out["trivial_cpu_ms_per_exec"]
    assert not list(iso_mod.own_cgroup_dir("cpuacct").glob(f"posttrain-bench-{os.getpid()}"))


def test_percentile_and_median_summary():
    assert bench._percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert bench._percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.99) == 5.0
    runs = [
        {"per_s": 10.0, "p50_ms": 1.0, "p99_ms": 9.0, "n": 5, "errors": 0},
        {"per_s": 30.0, "p50_ms": 3.0, "p99_ms": 7.0, "n": 6, "errors": 1},
        {"per_s": 20.0, "p50_ms": 2.0, "p99_ms": 8.0, "n": 7, "errors": 0},
    ]
    assert bench._median_summary(runs) == {"per_s": 20.0, "p50_ms": 2.0, "p99_ms": 8.0, "n": 18, "errors": 1}
