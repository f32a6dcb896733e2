#!/usr/bin/env python3
"""The PyTorch side of normref's training benchmark.

    /usr/bin/python3 bench/torch_bench.py --placement pre --n-layer 12 --n-embd 768 --n-head 12 \
        --vocab-size 50257 --batch 4 --seq 64 --steps 5 --threads 2

times full training steps (forward, backward, AdamW) of the model of the specification in
float32, with the same shapes as normref's benchmark, using the model code of
bench/torch_peer.py (the independent implementation that make check compares with normref),
and prints one line of key=value pairs: seconds per step (median of the timed steps, after
one warm-up step), tokens per second, and the peak resident memory: of the whole process
(peak_rss_mib) and of training alone (train_peak_mib, the high-water mark reset once the
float32 model exists, as normref's bench/bench_perf does; -1 where Linux refuses the reset).
Exit status 77 when PyTorch is not installed.
"""
import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peer  # noqa: E402  (exits 77 without PyTorch)
from peak_memory import hwm_mib, hwm_reset  # noqa: E402

torch = torch_peer.torch
np = torch_peer.np


def weights(cfg, rng):
    """Random weights with the names and shapes of spec section 7 for placement cfg."""
    d, V, T, L = cfg["n_embd"], cfg["vocab_size"], cfg["block_size"], cfg["n_layer"]
    dk = d // cfg["n_head"]
    w = {"wte": rng.normal(0, 0.02, (V, d)), "wpe": rng.normal(0, 0.02, (T, d))}
    ln = cfg["norm"] == "layernorm"

    def norm(name, n):
        w[name + ".weight"] = np.ones(n)
        if ln:
            w[name + ".bias"] = np.zeros(n)

    p = cfg["placement"]
    for l in range(L):
        h = "h.%d." % l
        w[h + "attn.w_qkv"] = rng.normal(0, 0.02, (3 * d, d))
        w[h + "attn.b_qkv"] = np.zeros(3 * d)
        w[h + "attn.w_o"] = rng.normal(0, 0.02 / (2 * L) ** 0.5, (d, d))
        w[h + "attn.b_o"] = np.zeros(d)
        w[h + "mlp.w_up"] = rng.normal(0, 0.02, (4 * d, d))
        w[h + "mlp.b_up"] = np.zeros(4 * d)
        w[h + "mlp.w_down"] = rng.normal(0, 0.02 / (2 * L) ** 0.5, (d, 4 * d))
        w[h + "mlp.b_down"] = np.zeros(d)
        if p in ("pre", "peri", "sandwich", "geonorm", "hybrid_star"):
            norm(h + "norm_attn_in", d)
        if p in ("pre", "peri", "sandwich", "geonorm", "hybrid", "hybrid_star"):
            norm(h + "norm_mlp_in", d)
        if p in ("peri", "sandwich", "post"):
            norm(h + "norm_attn_out", d)
            norm(h + "norm_mlp_out", d)
        if cfg["qk_norm"] or cfg["qkv_norm"]:
            norm(h + "norm_q", dk)
            norm(h + "norm_k", dk)
        if cfg["qkv_norm"]:
            norm(h + "norm_v", dk)
    if p not in ("none", "post", "deepnorm"):
        norm("norm_f", d)
    if cfg["emb_norm"] and p != "geonorm":
        norm("norm_emb", d)
    return w


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--placement", default="pre")
    ap.add_argument("--norm", default="layernorm")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--vocab-size", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    p = a.placement
    cfg = {"placement": p, "norm": a.norm, "n_layer": a.n_layer, "n_embd": a.n_embd, "n_head": a.n_head,
           "vocab_size": a.vocab_size, "block_size": a.seq, "dt": 1.0, "eps": 1e-5, "qk_norm": False,
           "qkv_norm": p in ("hybrid", "hybrid_star"), "emb_norm": p in ("peri", "geonorm"),
           "geo_schedule": "harmonic", "geo_alpha_attn": 1.0, "geo_alpha_mlp": 1.0}
    rng = np.random.default_rng(1)
    peer = torch_peer.Peer(cfg, weights(cfg, rng), dtype=torch.float32)
    opt = torch.optim.AdamW(list(peer.p.values()), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    tokens = torch.tensor(rng.integers(0, a.vocab_size, (a.batch, a.seq)))
    targets = torch.tensor(rng.integers(0, a.vocab_size, (a.batch, a.seq)))
    reset = hwm_reset()
    times = []
    for step in range(a.steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = peer.loss(tokens, targets)
        loss.backward()
        opt.step()
        if step > 0:                      # the first step warms up allocators and caches
            times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    train_mib = hwm_mib() if reset else -1.0
    print("peer=pytorch-%s threads=%d step_s=%.6f min_s=%.6f tokens_per_s=%.1f peak_rss_mib=%.1f "
          "train_peak_mib=%.1f loss=%.4f" %
          (torch.__version__, a.threads, step_s, min(times), a.batch * a.seq / step_s, rss_mib,
           train_mib, loss.item()))


if __name__ == "__main__":
    main()
