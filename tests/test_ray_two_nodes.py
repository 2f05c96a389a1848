"""Two Ray nodes on one machine (`ray start --head` plus `ray start --address`, one CPU each):
TP=2 placed across them with SPREAD gives transformers' greedy tokens. Runs after the other Ray
tests (file order) and stops the nodes it started."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.test_engine import _hf_greedy, _prompts
from tests.test_models import build

pytestmark = pytest.mark.skipif(shutil.which("ray") is None and not os.path.exists(
    os.path.join(os.path.dirname(sys.executable), "ray")), reason="the ray command is not installed")

DRIVER = textwrap.dedent("""
    import json, sys
    import ray
    from distengine import LLM, SamplingParams
    folder, address, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    with LLM(folder, tensor_parallel_size=2, device="cpu", dtype="float32", block_size=4, max_model_len=128,
             ray_address=address, placement_strategy="SPREAD") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        nodes = set(ray.util.placement_group_table(llm.executor.pg)["bundles_to_node_id"].values())
        print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "nodes": len(nodes),
                          "alive": sum(n["Alive"] for n in ray.nodes())}))
""")


def _ray() -> str:
    local = os.path.join(os.path.dirname(sys.executable), "ray")
    return local if os.path.exists(local) else "ray"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.serial
def test_tp2_spread_over_two_ray_nodes(tmp_path):
    import ray
    if ray.is_initialized():
        ray.shutdown()  # the tests' own cluster: `ray stop --force` below would end it under them
    hf, _ = build("qwen2")
    hf.save_pretrained(tmp_path / "m")
    prompts = _prompts(2)
    port = _port()
    # Ray 2.5x+ nodes authenticate to each other: one token for the head, the node and the driver.
    env = {**os.environ, "RAY_DISABLE_USAGE_STATS": "1", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex()}
    run = lambda *a: subprocess.run([_ray(), *a], env=env, capture_output=True, text=True, timeout=120)  # noqa: E731
    try:
        head = run("start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                   "--disable-usage-stats")
        assert head.returncode == 0, head.stderr[-2000:]
        second = run("start", f"--address=127.0.0.1:{port}", "--num-cpus=1", "--disable-usage-stats")
        assert second.returncode == 0, second.stderr[-2000:]
        driver = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path / "m"), f"127.0.0.1:{port}",
                                 json.dumps(prompts)], env={**env, "PYTHONPATH": os.getcwd()},
                                capture_output=True, text=True, timeout=300)
        assert driver.returncode == 0, driver.stderr[-3000:]
        got = json.loads(driver.stdout.strip().splitlines()[-1])
    finally:
        run("stop", "--force")
    assert got["alive"] == 2 and got["nodes"] == 2  # one worker on each node
    for p, toks in zip(prompts, got["tokens"]):
        assert toks == _hf_greedy(hf, p, 12)
