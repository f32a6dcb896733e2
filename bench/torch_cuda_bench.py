#!/usr/bin/env python3
"""PyTorch's side of the CUDA device check (bench/cuda_check.sh, chapter cuda).

    python3 bench/torch_cuda_bench.py --mode eager --batch 8 --seq 1024 --steps 10

times full training steps (zero the gradients, forward with the loss, backward, one AdamW
update) of a GPT-2-shaped Pre-LN model with LayerNorm in float32 on the GPU, written as a
PyTorch user writes it: F.layer_norm, F.gelu(approximate='tanh'),
F.scaled_dot_product_attention(is_causal=True), a head tied to the embedding,
F.cross_entropy, and torch.optim.AdamW with fused=True (foreach where fused is missing),
decay on the matrices only.  TF32 is off unless --tf32 is given, so that the products are
the strict float32 ones normref's cuda backend computes by default.  --mode compile wraps the
model in torch.compile.  Prints one line of key=value pairs: the median seconds per step over
the timed steps (after warm-up steps, which include compilation), tokens per second, and the
peak GPU memory.  Exit status 77 when PyTorch or a GPU is missing.
"""
import argparse
import math
import sys
import time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    print("torch_cuda_bench: PyTorch is not installed", file=sys.stderr)
    sys.exit(77)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln_1_w, self.ln_1_b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))
        self.ln_2_w, self.ln_2_b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, d = x.shape
        a = F.layer_norm(x, (d,), self.ln_1_w, self.ln_1_b, 1e-5)
        q, k, v = self.c_attn(a).split(d, dim=2)
        q, k, v = (t.view(B, T, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, d))
        m = F.layer_norm(x, (d,), self.ln_2_w, self.ln_2_b, 1e-5)
        return x + self.mlp_proj(F.gelu(self.c_fc(m), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, L, d, h, V, T):
        super().__init__()
        self.wte = nn.Embedding(V, d)
        self.wpe = nn.Embedding(T, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(L))
        self.ln_f_w, self.ln_f_b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * L) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        x = F.layer_norm(x, (x.shape[-1],), self.ln_f_w, self.ln_f_b, 1e-5)
        logits = x @ self.wte.weight.t()                       # the tied head
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def optimizer(model, lr):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    kw = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8)
    try:
        return torch.optim.AdamW(groups, fused=True, **kw), "fused"
    except (TypeError, RuntimeError):
        return torch.optim.AdamW(groups, foreach=True, **kw), "foreach"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("eager", "compile"), default="eager")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--vocab-size", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tf32", action="store_true", help="let the products use TF32")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch_cuda_bench: PyTorch sees no GPU", file=sys.stderr)
        return 77
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    torch.backends.cudnn.allow_tf32 = a.tf32
    torch.set_float32_matmul_precision("high" if a.tf32 else "highest")
    torch.manual_seed(1)
    dev = torch.device("cuda")
    model = GPT(a.n_layer, a.n_embd, a.n_head, a.vocab_size, a.seq).to(dev)
    opt, kind = optimizer(model, 3e-4)
    step_model = model
    if a.mode == "compile":
        if not hasattr(torch, "compile"):
            print("torch_cuda_bench: this PyTorch has no torch.compile", file=sys.stderr)
            return 77
        step_model = torch.compile(model)
    g = torch.Generator(device="cpu").manual_seed(12345)
    idx = torch.randint(0, a.vocab_size, (a.batch, a.seq), generator=g).to(dev)
    tgt = torch.randint(0, a.vocab_size, (a.batch, a.seq), generator=g).to(dev)
    times, loss = [], float("nan")
    for s in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        l = step_model(idx, tgt)
        l.backward()
        opt.step()
        torch.cuda.synchronize()
        if s >= a.warmup:
            times.append(time.perf_counter() - t0)
        loss = l.item()
        if s == a.warmup - 1:
            torch.cuda.reset_peak_memory_stats()
    times.sort()
    mid = len(times) // 2
    step = times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid])
    n = sum(p.numel() for p in model.parameters())
    print("impl=torch-%s adamw=%s tf32=%d L=%d d=%d V=%d B=%d T=%d params=%d step_s=%.6f "
          "min_s=%.6f tokens_per_s=%.1f peak_gpu_mib=%.1f loss=%.4f torch=%s gpu=%s"
          % (a.mode, kind, int(a.tf32), a.n_layer, a.n_embd, a.vocab_size, a.batch, a.seq, n, step,
             times[0], a.batch * a.seq / step, torch.cuda.max_memory_allocated() / 2**20, loss,
             torch.__version__, torch.cuda.get_device_name(0).replace(" ", "_")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
