#!/usr/bin/env python3
"""The attention alone in PyTorch, at the shapes of normref's `bench_fast attention`.

    python3 bench/peer_attention.py [--threads 2] [--seq 256 512 1024 2048]

Causal multi-head attention as a PyTorch user writes it (the q, k, v columns of one [B, T, 3d]
tensor split into heads, F.scaled_dot_product_attention(is_causal=True), the heads merged
back), forward and backward from a gradient of the output, at B = 4, d = 256, 4 heads and each
T asked; the fastest and the median of five timed calls after one untimed, in the format of
`bench_fast attention`, so that the two read side by side.  Exit status 77 when PyTorch is
absent or has no scaled_dot_product_attention.
"""
import argparse
import statistics
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("peer_attention: PyTorch is not installed for %s" % sys.executable, file=sys.stderr)
    sys.exit(77)

B, D, H, REPS = 4, 256, 4, 5


def attend(qkv, T):
    q, k, v = (x.view(B, T, H, D // H).transpose(1, 2) for x in qkv.split(D, dim=2))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).contiguous().view(B, T, D)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024, 2048])
    a = ap.parse_args()
    if not hasattr(F, "scaled_dot_product_attention"):
        print("peer_attention: this PyTorch (%s) has no scaled_dot_product_attention"
              % torch.__version__, file=sys.stderr)
        sys.exit(77)
    if any(T < 1 for T in a.seq) or a.threads < 1:
        ap.error("--seq and --threads must be positive")
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(1)
    print("attention forward+backward in torch %s, B=%d d=%d h=%d, %d threads, causal SDPA "
          "(fastest and median of %d)" % (torch.__version__, B, D, H, a.threads, REPS))
    for T in a.seq:
        qkv = (torch.rand(B, T, 3 * D, generator=g) - 0.5).requires_grad_(True)
        dout = torch.rand(B, T, D, generator=g) * 1e-2
        times = []
        for r in range(REPS + 1):
            t0 = time.perf_counter()
            attend(qkv, T).backward(dout)
            t = time.perf_counter() - t0
            qkv.grad = None
            if r > 0:
                times.append(t)
        print("  T = %4d   %8.2f ms (median %8.2f)" %
              (T, 1e3 * min(times), 1e3 * statistics.median(times)))


if __name__ == "__main__":
    main()
