"""The two ceilings of a roofline, measured on the device in the same run as the figures they
judge: device-to-device copy bandwidth (a step that must read its bytes once can go no faster)
and the rate of a large matrix product (a step of products can go no faster). Measured rather
than taken from a data sheet: clocks, power limits and the GPU's variant move them by tens of
percent."""
from __future__ import annotations

import time

__all__ = ["copy_bandwidth", "matmul_rate", "synchronize"]


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy, bytes read + written per second (the roofline's bandwidth)."""
    import torch
    cuda = device.startswith("cuda")
    n = (2 << 30) if cuda else (64 << 20)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    reps = 20 if cuda else 5
    for _ in range(3):
        y.copy_(x)
    synchronize(device)
    t = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    synchronize(device)
    bw = 2 * n * reps / (time.perf_counter() - t)
    del x, y
    return bw


def matmul_rate(device: str, seconds: float | None = None) -> float:
    """FLOP/s of a large bf16 matrix product on random data (fp32 on CPU): over ten products,
    or with `seconds`, over that long of products back to back after as long again of them. A
    power-limited GPU lowers its clocks within a fraction of a second of products (one H200:
    1,980 MHz idle, ~1,450 MHz at its 700 W limit; 788 TFLOP/s over ten products of 8,192^3,
    674-690 over 150), so a step of products that lasts longer runs at the held rate."""
    import torch
    cuda = device.startswith("cuda")
    n, dtype = (8192, torch.bfloat16) if cuda else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    if seconds is not None:
        _products_for(a, b, seconds, device)
        reps, elapsed = _products_for(a, b, seconds, device)
        return 2 * n ** 3 * reps / elapsed
    reps = 10 if cuda else 3
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    synchronize(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t)


def _products_for(a, b, seconds: float, device: str) -> tuple[int, float]:
    """(products, seconds they took): products queued in groups of ten until `seconds` passed."""
    reps = 0
    t = time.perf_counter()
    while True:
        for _ in range(10):
            a @ b
        reps += 10
        synchronize(device)
        elapsed = time.perf_counter() - t
        if elapsed >= seconds:
            return reps, elapsed


def synchronize(device: str) -> None:
    """Wait for the device's queued work (a host timer around it measures the work itself)."""
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()
