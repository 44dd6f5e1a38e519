"""A short soak against the real server on the embedded model: mixed traffic with
feedback, malformed bodies, wrong keys and disconnects gets no error, the activation
cache drains to zero, and SIGTERM saves the final adapter version."""

import pytest

from bench.soak import SoakConfig, run_soak_bench


@pytest.mark.slow
def test_short_soak_has_no_errors_and_drains(tmp_path):
    # a label follows its reply by one round trip; 15 s leaves room for a loaded machine
    report = run_soak_bench(SoakConfig(seconds=25, rate=0.5, label_timeout_s=15, drain_timeout_s=300,
                                       sample_every_s=2), json_path=str(tmp_path / "soak.json"),
                            plot_path=str(tmp_path / "soak.png"))
    assert report["errors"] == 0, report["error_samples"]
    assert report["server_5xx"] == 0 and report["server_failed_train_jobs"] == 0
    assert report["cache_drained"] and report["final_version_saved"]
    assert sum(k["ok"] for k in report["by_kind"].values()) >= 5
    assert (tmp_path / "soak.png").stat().st_size > 0
