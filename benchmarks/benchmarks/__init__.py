"""airspeed velocity suite of subspace_ref (see docs/benchmarks.md).

Modules: ``bench_attend`` (decode attention per backend, static and adaptive states, with the
roofline ``track_`` metrics of spec R1-R12), ``bench_exact`` (the exact-attention baselines:
torch SDPA and the NumPy oracle), ``bench_append`` (appending tokens per backend) and ``bench_fd``
(Frequent Directions updates, spec A4). ``common`` holds the shared fixtures.

Set ``SUBSPACE_BENCH_QUICK=1`` to shrink every parameter grid to one small point (CI).
"""
