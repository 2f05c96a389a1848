"""`distengine bench soak` on a server it starts itself (TP=1, CPU, the demo's tiny model): a short
run with client disconnects ends without errors or leaked KV blocks, its JSON holds the figures of
each tenth, and the server it started exits 0 and leaves no process behind."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")


def test_soak_against_a_started_server(tmp_path):
    from launch.cli import main
    out = tmp_path / "soak.json"
    status = main(["bench", "soak", "--model-dir", str(tmp_path / "model"), "--tp", "1", "--num-requests", "50",
                   "--max-concurrency", "8", "--input-len", "4", "40", "--output-len", "2", "12",
                   "--shared-prefix-len", "16", "--shared-prefix-fraction", "0.3", "--output-json", str(out)])
    res = json.loads(out.read_text())
    assert res["errors"] == 0, res["error_samples"]
    assert res["leaked_blocks_at_start"] == 0 and res["leaked_blocks"] == 0 and res["max_leaked_blocks"] == 0
    assert res["criteria"]["no_errors"] and res["criteria"]["no_leaked_blocks"]
    # Five requests a tenth: the latency and RSS criteria are noise here, only the exit status follows them.
    assert status == (0 if all(res["criteria"].values()) else 1)
    assert res["disconnects"] > 0 and res["completed"] + res["disconnects"] == 50
    assert res["num_gpu_blocks"] > 1 and res["block_size"] > 0 and "engine" in res["rss_processes"]
    for key in ("rss_baseline_mib", "rss_growth_pct", "p50_drift_pct", "p99_drift_pct", "wall_s"):
        assert isinstance(res[key], float), key
    tenths = res["tenths"]
    assert [t["index"] for t in tenths] == list(range(1, 11)) and tenths[-1]["requests_done"] == 50
    for t in tenths:
        assert t["leaked_blocks"] == 0 and t["running_after"] == 0 and t["waiting_after"] == 0, t
        assert t["rss_start_mib"] > 0 and t["rss_end_mib"] > 0 and 0 < t["p50_ms"] <= t["p99_ms"], t
        assert t["wrong_lengths"] == 0 and set(t["rss_end_by_role_mib"]) >= {"server", "engine"}, t
    assert res["server_exit_status"] == 0 and res["left_behind"] == []
