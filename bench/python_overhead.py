#!/usr/bin/python3
"""The cost of the Python binding: each reference op on a 64 x 768 input called through
normref (checks, conversions, fresh outputs) and called bare through ctypes on buffers made
beforehand (the C function's own time plus the foreign call), the fastest of repeated batches.

usage: NORMREF_LIBRARY=src/.libs/libnormref.so.0 PYTHONPATH=python python_overhead.py [N D]
(N x D: the input, 64 x 768 by default; D a multiple of 3 for the attention)
"""
import ctypes
import sys
import time

import numpy as np

import normref
from normref._lib import lib, ptr, iptr

N, D = (int(v) for v in (sys.argv[1:3] if len(sys.argv) > 2 else (64, 768)))


def timed(py, bare, seconds=1.0):
    """(python, bare) microseconds per call: batches of each, interleaved, so that the load
    of the machine falls on both alike; the processor time of this process (not the wall
    time, which includes waiting for a core) of the fastest batch of each"""
    py()
    bare()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.02:
        py()
        reps += 1
    best = [float("inf"), float("inf")]
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for i, f in enumerate((py, bare)):
            t0 = time.process_time()
            for _ in range(reps):
                f()
            best[i] = min(best[i], (time.process_time() - t0) / reps)
    return 1e6 * best[0], 1e6 * best[1]


def main():
    rng = np.random.default_rng(0)
    x, dy, u = (rng.standard_normal((N, D)) for _ in range(3))
    g, b = 1 + 0.01 * rng.standard_normal(D), 0.1 * rng.standard_normal(D)
    y, dx, du = np.empty((N, D)), np.zeros((N, D)), np.zeros((N, D))
    dg, db, mean, rstd, da = np.zeros(D), np.zeros(D), np.empty(N), np.empty(N), np.zeros(1)
    tg = rng.integers(0, D, N)
    tg32 = tg.astype(np.int32)
    loss = ctypes.c_double()
    _, mean, rstd = normref.layernorm_forward(x, g, b)
    _, rstd_rms = normref.rmsnorm_forward(x, g)
    _, probs = normref.cross_entropy_forward(x, tg)
    qkv = x.reshape(1, N, D)            # d = 256, 4 heads: qkv is 64 x 768
    ad, h = D // 3, 4
    out, cache = normref.attention_forward(qkv, h)
    c_cache = np.zeros(lib.Attention_cache_size(1, N, ad, h))
    work = np.zeros(lib.Attention_work_size(N, ad) + 1)
    dout = rng.standard_normal((1, N, ad))
    o = np.empty((1, N, ad))
    rows = [
        ("layernorm_forward", lambda: normref.layernorm_forward(x, g, b),
         lambda: lib.LayerNorm_forward(ptr(y), ptr(mean), ptr(rstd), ptr(x), ptr(g), ptr(b), N, D,
                                       1e-5)),
        ("layernorm_backward", lambda: normref.layernorm_backward(dy, x, g, mean, rstd),
         lambda: lib.LayerNorm_backward(ptr(dx), ptr(dg), ptr(db), ptr(dy), ptr(x), ptr(g),
                                        ptr(mean), ptr(rstd), N, D)),
        ("rmsnorm_forward", lambda: normref.rmsnorm_forward(x, g),
         lambda: lib.RMSNorm_forward(ptr(y), ptr(rstd), ptr(x), ptr(g), N, D, 1e-5)),
        ("rmsnorm_backward", lambda: normref.rmsnorm_backward(dy, x, g, rstd_rms),
         lambda: lib.RMSNorm_backward(ptr(dx), ptr(dg), ptr(dy), ptr(x), ptr(g), ptr(rstd_rms),
                                      N, D)),
        ("geonorm_forward", lambda: normref.geonorm_forward(x, u, 0.5),
         lambda: lib.GeoNorm_forward(ptr(y), ptr(x), ptr(u), 0.5, N, D)),
        ("geonorm_backward", lambda: normref.geonorm_backward(dy, x, u, 0.5),
         lambda: lib.GeoNorm_backward(ptr(dx), ptr(du), ptr(da), ptr(dy), ptr(x), ptr(u), 0.5,
                                      N, D)),
        ("gelu_forward", lambda: normref.gelu_forward(x),
         lambda: lib.Gelu_forward(ptr(y), ptr(x), N * D)),
        ("gelu_backward", lambda: normref.gelu_backward(dy, x),
         lambda: lib.Gelu_backward(ptr(dx), ptr(dy), ptr(x), N * D)),
        ("cross_entropy_forward", lambda: normref.cross_entropy_forward(x, tg),
         lambda: lib.CrossEntropy_forward(ctypes.byref(loss), ptr(y), ptr(x), iptr(tg32), N, D)),
        ("cross_entropy_backward", lambda: normref.cross_entropy_backward(probs, tg),
         lambda: lib.CrossEntropy_backward(ptr(dx), 1.0, ptr(probs), iptr(tg32), N, D)),
        ("attention_forward", lambda: normref.attention_forward(qkv, h),
         lambda: lib.Attention_forward(ptr(o), ptr(c_cache), ptr(qkv), None, 1, N, ad, h)),
        ("attention_backward", lambda: normref.attention_backward(dout, cache),
         lambda: lib.Attention_backward(ptr(dx), None, ptr(work), ptr(dout), ptr(c_cache),
                                        ptr(qkv), None, 1, N, ad, h)),
        ("adamw_step", lambda: normref.adamw_step(x, dy, 1e-3), None),
    ]
    print(f"# {N} x {D}, float64; microseconds of processor time per call (fastest batch); {normref.LIBRARY_PATH}")
    print(f"{'op':24s} {'python':>10s} {'bare C':>10s} {'overhead':>10s}")
    for name, py, bare in rows:
        tp, tc = timed(py, bare or (lambda: None))
        if bare is None:
            print(f"{name:24s} {tp:10.1f} {'-':>10s} {'-':>10s}")
        else:
            print(f"{name:24s} {tp:10.1f} {tc:10.1f} {tp - tc:10.1f}")


if __name__ == "__main__":
    main()
