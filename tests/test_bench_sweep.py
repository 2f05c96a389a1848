"""`distengine bench sweep` on CPU: a 2 x 2 grid on a tiny random model on a local Ray cluster with
CPU bundles gives four result lines, a table and a valid PNG; a failing point is recorded and the
sweep goes on; `--resume` runs nothing twice; a point asking for more devices than the cluster has
is skipped with a clear message; unknown parameters are refused before anything starts; on a
two-node Ray cluster (`ray start --head` + `ray start --address`) points run on both nodes."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from launch.cli import main

ray = pytest.importorskip("ray")
pytest.importorskip("matplotlib")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from launch.bench.common import build_random_model
    folder = str(tmp_path_factory.mktemp("tiny"))
    build_random_model(folder, "tiny", "cpu")
    return folder


def sweep_file(tmp_path, tiny: str, grid: dict, name: str = "sweep.json", **fixed) -> str:
    spec = {"model": tiny, "kind": "latency", "device": "cpu", "grid": grid, "input_len": 6, "output_len": 3,
            "num_iters": 1, "num_iters_warmup": 0, **fixed}
    path = tmp_path / name
    path.write_text(json.dumps(spec))
    return str(path)


def lines(out) -> list[dict]:
    with open(os.path.join(out, "results.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_grid_table_plot_failure_resume_and_skip(tiny, ray_cluster, tmp_path, capsys):
    out = str(tmp_path / "out")
    spec = sweep_file(tmp_path, tiny, {"batch_size": [1, 2], "max_model_len": [64, 100000]})
    assert main(["bench", "sweep", spec, "--out", out, "--no-progress"]) == 0
    recs = lines(out)
    assert len(recs) == 4
    ok = [r for r in recs if r["status"] == "ok"]
    failed = [r for r in recs if r["status"] == "failed"]
    assert len(ok) == 2 and len(failed) == 2  # max_model_len 100000 is past the tiny model's positions
    assert all("max_model_len (100000)" in r["error"] for r in failed)
    for r in ok:
        assert r["figures"]["output_tok_s"] > 0 and r["devices"] == 1 and r["device_name"] == "CPU"
        assert set(r["versions"]) == {"distengine", "torch", "triton", "ray"} and r["node"]
    table = open(os.path.join(out, "results.md")).read()
    assert table.count("| ok |") == 2 and table.count("| failed |") == 2 and "per GPU vs TP=1" in table
    png = open(os.path.join(out, "throughput.png"), "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    capsys.readouterr()

    # Without --resume an existing result file is not overwritten.
    assert main(["bench", "sweep", spec, "--out", out, "--no-progress"]) == 2
    assert "--resume" in capsys.readouterr().err
    # With it, only the new points run: two new batch sizes, and one point too large for the cluster.
    spec2 = sweep_file(tmp_path, tiny, {"batch_size": [1, 2, 3], "max_model_len": [64, 100000],
                                        "tensor_parallel_size": [1]}, name="sweep2.json")
    spec2_data = json.loads(open(spec2).read())
    spec2_data["grid"].pop("tensor_parallel_size")
    open(spec2, "w").write(json.dumps(spec2_data))
    assert main(["bench", "sweep", spec2, "--out", out, "--resume", "--no-progress"]) == 0
    recs = lines(out)
    assert len(recs) == 6 and len({json.dumps(r["point"], sort_keys=True) for r in recs}) == 6
    assert "4 already in" in capsys.readouterr().out
    assert main(["bench", "sweep", spec2, "--out", out, "--resume", "--no-progress"]) == 0
    assert len(lines(out)) == 6  # nothing ran twice

    big = sweep_file(tmp_path, tiny, {"tensor_parallel_size": [8]}, name="big.json", max_model_len=64)
    out3 = str(tmp_path / "out3")
    assert main(["bench", "sweep", big, "--out", out3, "--no-progress"]) == 0
    recs = {r["point"]["tensor_parallel_size"]: r for r in lines(out3)}
    assert recs[8]["status"] == "skipped" and "CPU: asks for 8.1, the cluster has 4" in recs[8]["error"]
    assert "skipped: needs more than the cluster has" in capsys.readouterr().out


def test_unknown_parameters_are_refused_before_anything_starts(tiny, tmp_path, capsys):
    bad = sweep_file(tmp_path, tiny, {"batch_size": [1], "temprature": [0.5]})
    assert main(["bench", "sweep", bad, "--out", str(tmp_path / "o")]) == 2
    assert "unknown parameter(s) ['temprature']" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o" / "results.jsonl")
    (tmp_path / "k.json").write_text(json.dumps({"model": tiny, "kind": "speed", "grid": {"batch_size": [1]}}))
    assert main(["bench", "sweep", str(tmp_path / "k.json")]) == 2
    assert "kind must be one of" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["sweep_gemma3_12b.yaml", "sweep_serve.yaml", "sweep_serve_quick.yaml"])
def test_example_sweep_files_are_valid(name):
    """The examples the README's figures come from: every name known, every point a TP size of 1 or 2."""
    from launch.bench.sweep import load_sweep, points
    spec = load_sweep(os.path.join(os.path.dirname(__file__), "..", "examples", name))
    pts = points(spec)
    assert len(pts) >= 6 and {p["tensor_parallel_size"] for p in pts} == {1, 2}


def _ray() -> str:
    local = os.path.join(os.path.dirname(sys.executable), "ray")
    return local if os.path.exists(local) else "ray"


@pytest.mark.serial
def test_points_run_on_both_nodes_of_a_two_node_cluster(tiny, tmp_path):
    if ray.is_initialized():
        ray.shutdown()  # the driver below joins the two-node cluster instead
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_DISABLE_USAGE_STATS": "1", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": os.urandom(16).hex()}
    run = lambda *a: subprocess.run([_ray(), *a], env=env, capture_output=True, text=True, timeout=120)  # noqa: E731
    spec = sweep_file(tmp_path, tiny, {"batch_size": [1, 2]}, max_model_len=64)
    out = str(tmp_path / "nodes")
    try:
        # Two logical CPUs a node: a point (1 CPU for its worker, 0.1 for its task) fits on one node,
        # two do not, so two points run at once, one on each node.
        head = run("start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                   "--disable-usage-stats")
        assert head.returncode == 0, head.stderr[-2000:]
        second = run("start", f"--address=127.0.0.1:{port}", "--num-cpus=2", "--disable-usage-stats")
        assert second.returncode == 0, second.stderr[-2000:]
        driver = subprocess.run([sys.executable, "-m", "launch.cli", "bench", "sweep", spec, "--out", out,
                                 "--ray-address", f"127.0.0.1:{port}", "--no-progress"],
                                cwd=ROOT, env={**env, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=600)
        assert driver.returncode == 0, driver.stdout[-2000:] + driver.stderr[-3000:]
    finally:
        run("stop", "--force")
    recs = lines(out)
    assert len(recs) == 2 and all(r["status"] == "ok" for r in recs), recs
    assert len({r["node"] for r in recs}) == 2, [r["node"] for r in recs]
