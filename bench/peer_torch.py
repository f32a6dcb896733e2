#!/usr/bin/env python3
"""normref's training step written as a PyTorch user writes it: the benchmark peer.

    python3 bench/peer_torch.py --n-layer 12 --n-embd 768 --n-head 12 --vocab-size 50257 \
        --batch 4 --seq 64 --steps 3 --threads 2 [--compile]

The model is the Pre-LN GPT-2 of normref's float32 step (learned positions, LayerNorm with
bias, biased linear maps, tanh GELU, the head tied to the token embedding, mean cross-entropy)
in the form of nanoGPT: nn.LayerNorm and nn.Linear (F.layer_norm, F.linear),
F.gelu(approximate='tanh'), F.scaled_dot_product_attention(is_causal=True) where the version
has it (PyTorch >= 2.0; before, the masked softmax of nanoGPT's own fallback), F.cross_entropy,
and AdamW with the GPT-2 decay mask (matrices decay, vectors do not), fused where the version
has a fused AdamW for the CPU, else foreach.  --compile wraps the model in torch.compile.

A step is what normref's step is: zero the gradients, forward with the loss, backward, one
AdamW update.  After --warmup steps (the first faults in memory and, under --compile,
compiles), --steps are timed.  The program prints one line of key=value words: the median and
the fastest step, tokens per second of each, the warm-up time, the peak resident set of
training (the high-water mark reset once the model exists, as normref's bench/bench_perf does)
and of the whole process.  Exit status 77 when PyTorch is absent, 3 when torch.compile fails
(the reason on stderr and in the line's note).  --matmul times the model's matrix products alone
(torch.mm on the shapes of normref's bench_perf sgemm) and prints their rate.  PEER_VERBOSE=1
in the environment prints every step's time on stderr.
"""
import argparse
import math
import os
import resource
import statistics
import sys
import time
from peak_memory import hwm_mib, hwm_reset

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    print("peer_torch: PyTorch is not installed for %s" % sys.executable, file=sys.stderr)
    sys.exit(77)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def attention(self, x):
        B, T, d = x.shape
        q, k, v = self.attn(x).split(d, dim=2)
        q, k, v = (t.view(B, T, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(T, T, dtype=torch.bool).tril()
            att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
            y = att @ v
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, d))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.down(F.gelu(self.up(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, L, d, h, V, T):
        super().__init__()
        self.wte = nn.Embedding(V, d)
        self.wpe = nn.Embedding(T, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(L))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                residual = name.endswith(("proj.weight", "down.weight"))
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * L) if residual else 0.02)
            elif "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, tokens, targets):
        B, T = tokens.shape
        x = self.wte(tokens) + self.wpe(torch.arange(T))
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def adamw(model):
    """AdamW with the GPT-2 decay mask; fused where the version has it on the CPU, else foreach."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    kw = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    for flavour in ("fused", "foreach"):
        try:
            opt = torch.optim.AdamW(groups, **kw, **{flavour: True})
            if flavour == "fused":   # some versions accept fused=True, refuse the CPU at step()
                probe = torch.zeros(1, requires_grad=True)
                p_opt = torch.optim.AdamW([probe], lr=0.0, fused=True)
                probe.grad = torch.zeros(1)
                p_opt.step()
            return opt, flavour
        except (TypeError, RuntimeError, ValueError):
            continue
    return torch.optim.AdamW(groups, **kw), "for-loop"


def matmul_rate(a):
    """The rate of this PyTorch's matrix products on the model's product shapes.

    The fifteen products of a step as normref's bench_perf sgemm times them with cblas_sgemm
    (y = x W^T, dx = dy W, dW += dy^T x for the four maps of a block and the tied head, the
    fastest of five calls), through torch.mm with this version's own BLAS, weighted as a step
    makes them: the sgemm rate of the frameworks that do not use normref's OpenBLAS."""
    N, d, V, L = a.batch * a.seq, a.n_embd, a.vocab_size, a.n_layer
    flops = secs = 0.0
    for fan_in, fan_out, count in ((d, 3 * d, L), (d, d, L), (d, 4 * d, L), (4 * d, d, L),
                                   (d, V, 1)):
        x, W = torch.randn(N, fan_in), torch.randn(fan_out, fan_in)
        dy, dW = torch.randn(N, fan_out), torch.zeros(fan_out, fan_in)
        t = 0.0
        for f in (lambda: torch.mm(x, W.t()), lambda: torch.mm(dy, W),
                  lambda: dW.addmm_(dy.t(), x)):
            f()
            best = math.inf
            for _ in range(5):
                t0 = time.perf_counter()
                f()
                best = min(best, time.perf_counter() - t0)
            t += best
        flops += 6.0 * N * fan_in * fan_out * count
        secs += t * count
    print("impl=torch-%s-mm threads=%d L=%d d=%d V=%d B=%d T=%d sgemm_gflops=%.2f sgemm_s=%.6f" %
          (torch.__version__.split("+")[0], torch.get_num_threads(), L, d, V, a.batch, a.seq,
           1e-9 * flops / secs, secs))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--vocab-size", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--matmul", action="store_true", help="time the model's products only")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.matmul:
        return matmul_rate(a)
    torch.manual_seed(1)
    model = GPT(a.n_layer, a.n_embd, a.n_head, a.vocab_size, a.seq)
    opt, flavour = adamw(model)
    run = model
    name = "torch-%s%s" % (torch.__version__.split("+")[0], "-compile" if a.compile else "")
    if a.compile:
        run = torch.compile(model)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, a.vocab_size, (a.batch, a.seq), generator=g)
    targets = torch.randint(0, a.vocab_size, (a.batch, a.seq), generator=g)
    reset = hwm_reset()
    times, t_start, warm_s = [], time.perf_counter(), 0.0
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        try:
            loss = run(tokens, targets)
            loss.backward()
        except Exception as e:            # torch.compile's failures are of many classes
            if not a.compile:
                raise
            reason = " ".join(str(e).split())[:300]
            print("peer_torch: torch.compile failed: %s" % reason, file=sys.stderr)
            print("impl=%s skipped=1 note=torch.compile-failed" % name)
            sys.exit(3)
        opt.step()
        t = time.perf_counter() - t0
        if os.environ.get("PEER_VERBOSE"):
            print("peer_torch: step %d: %.6f s" % (step, t), file=sys.stderr)
        if step == a.warmup - 1:
            warm_s = time.perf_counter() - t_start
        if step >= a.warmup:
            times.append(t)
    med, fast = statistics.median(times), min(times)
    N = a.batch * a.seq
    print("impl=%s threads=%d adamw=%s sdpa=%d B=%d T=%d step_s=%.6f min_s=%.6f "
          "tokens_per_s=%.1f max_tokens_per_s=%.1f warmup_s=%.3f peak_rss_mib=%.1f "
          "max_rss_mib=%.1f loss=%.4f" %
          (name, torch.get_num_threads(), flavour, int(hasattr(F, "scaled_dot_product_attention")),
           a.batch, a.seq, med, fast, N / med, N / fast, warm_s,
           hwm_mib() if reset else -1.0,
           resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, loss.item()))


if __name__ == "__main__":
    main()
