"""Shared test setup. Triton kernels run natively on a GPU and under Triton's interpreter on CPU;
the interpreter must be chosen before triton is first imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
