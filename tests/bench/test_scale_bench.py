"""`posttrain bench scale`: the JSON contract, rates computed from the same run's seconds and bytes."""

import pytest

from posttrain.cli.bench import run_bench


def test_bench_scale_reports_every_transport_against_memcpy():
    # the broadcast's two processes are tested in tests/rl/test_weight_sync.py; here only its absence
    out = run_bench(
        "scale", ["--model", "tiny:llama", "--repeats", "1", "--lora-rank", "2", "--skip-broadcast"]
    )
    assert set(out["weight_sync_s"]) == {"in_process", "shared_file", "shared_file_transport", "lora"}
    for name, seconds in out["weight_sync_s"].items():
        moved = out["lora_bytes"] if name == "lora" else out["weight_bytes"]
        assert out["bytes_per_s"][name] == pytest.approx(moved / seconds)
    assert out["shared_file_frac_of_memcpy"] == pytest.approx(
        out["bytes_per_s"]["shared_file"] / out["memcpy_bytes_per_s"]
    )
    assert out["shared_file_transport_frac_of_memcpy"] == pytest.approx(
        out["bytes_per_s"]["shared_file_transport"] / out["memcpy_bytes_per_s"]
    )
    assert 0 < out["lora_bytes"] < out["weight_bytes"] and out["ray_overhead_frac"] is None


def test_bench_scale_refuses_an_unknown_dtype():
    with pytest.raises(SystemExit) as err:
        run_bench("scale", ["--dtype", "float16"])
    assert err.value.code == 2


@pytest.mark.slow
def test_bench_scale_ray_overhead_from_runs_of_the_same_recipe():
    pytest.importorskip("ray")
    out = run_bench(
        "scale", ["--model", "tiny:llama", "--repeats", "1", "--skip-broadcast", "--ray-steps", "1"]
    )
    assert out["ray_overhead_frac"] == pytest.approx(out["ray_step_s"] / out["local_step_s"] - 1.0)
    assert out["ray_async_vs_local"] == pytest.approx(out["ray_async_step_s"] / out["local_step_s"])
    assert out["ray_steps"] == 1
