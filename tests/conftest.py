"""Shared test setup. Triton kernels run natively on a GPU and under Triton's interpreter on CPU;
the interpreter must be chosen before triton is first imported. Tests marked `gpu` need a CUDA
device and are skipped without one."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for a module's TP=2 tests (one already running is reused, not stopped)."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
