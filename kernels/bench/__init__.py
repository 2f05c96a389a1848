"""The kernels' lab: timings, tile sweeps and micro-benchmarks of the Triton kernels on a GPU, each
a module run as `python -m kernels.bench.NAME`. Like every module of `kernels`, they import nothing
of the project but `kernels`, so a kernel can be measured without the engine; what needs the
engine's layers or the engine itself is in `launch.bench`. Nothing here runs at import."""
