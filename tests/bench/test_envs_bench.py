"""`posttrain bench envs`: its option parsing, and (slow) a short run whose figures are the named ones."""

from __future__ import annotations

import pytest

from posttrain.bench import BenchUsageError
from posttrain.bench.envs import parse_domain_levels


def test_base_domains_parse_to_names_and_levels():
    assert parse_domain_levels("cad.modeling, docs.financial:0+1") == [
        ("cad.modeling", None),
        ("docs.financial", [0, 1]),
    ]
    with pytest.raises(BenchUsageError, match="docs.financial:x"):
        parse_domain_levels("docs.financial:x")
    with pytest.raises(BenchUsageError, match="empty"):
        parse_domain_levels(" , ")


@pytest.mark.slow
def test_a_short_run_reports_cad_rates_verifier_rates_and_base_rates(capsys):
    from posttrain.cli.bench import run_bench
    from posttrain.envs.domains.cad_modeling import INSTALL_HINT, cadquery_available

    if not cadquery_available():
        pytest.skip(INSTALL_HINT)
    out = run_bench(
        "envs",
        ["--seconds", "3", "--episodes", "2", "--baseline-scripts", "2", "--samples", "1", "--tasks", "1"]
        + ["--base-domains", "cad.modeling:0", "--max-new-tokens", "64"],
    )
    assert out["cad_scripts_per_s"] > out["cad_import_per_script_per_s"] > 0
    assert out["cad_errors"] == 0 and out["cad_import_per_script_errors"] == 0
    assert out["cad_speedup"] == pytest.approx(out["cad_scripts_per_s"] / out["cad_import_per_script_per_s"])
    assert out["verifier"]["cad.modeling"]["reference_full_marks"] == 2
    assert out["verifier_skipped"]["dataset"].startswith("needs options")
    assert set(out["base_rate"]) == {"cad.modeling"} and 0.0 <= out["base_rate"]["cad.modeling"]["0"] <= 1.0
