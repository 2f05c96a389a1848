"""Shared test setup. Triton kernels run natively on a GPU and under Triton's interpreter on CPU;
the interpreter must be chosen before triton is first imported. Tests marked `gpu` need a CUDA
device and are skipped without one."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# A CPU engine's pool defaults to 1 GiB, zeroed on every start (half a second, on each rank); the
# tiny test models fill a fraction of 128 MiB.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "0.125")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(config, items):
    # Skipped here, once, rather than by a skipif in every module: the marker is what `-m gpu` /
    # `-m "not gpu"` select on, and a GPU host runs exactly the tests a CPU host skips.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def _ray_session():
    ray = pytest.importorskip("ray")
    yield ray
    if ray.is_initialized():  # (this process started it: the test run ends)
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(_ray_session):
    """A local Ray cluster of 4 logical CPUs and no GPU (its TP=2 tests run on CPU, on any host):
    started once and kept for the whole test run (a start and stop cost ~7 s on a small host); one
    already running is reused; a module after a test that stopped it (the two-node tests) gets a
    new one."""
    ray = _ray_session
    if not ray.is_initialized():
        ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    return ray
