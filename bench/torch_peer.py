#!/usr/bin/env python3
"""An independent PyTorch implementation of the normref model, for cross-checking.

It reads a normref model file (safetensors, configuration in the metadata), builds the
same placement from its own code (spec sections 2-5, written from the specification, not
translated from the C), runs the batch that `normref grad` reads from a byte file, and
compares its loss and every gradient with a gradient file written by `normref grad`.

    /usr/bin/python3 bench/torch_peer.py check MODEL DATA B T GRADS [--tol 1e-12]
    /usr/bin/python3 bench/torch_peer.py check-list FILE [--tol 1e-12]

prints one line per tensor (normwise relative difference) and exits 0 when every tensor
agrees within --tol, 1 otherwise, 77 when PyTorch is not installed.  check-list reads one
"MODEL DATA B T GRADS" line per check (one process for many models: PyTorch starts slowly). This is the loop the
README describes for validating a faster implementation, with PyTorch as the example.
The same module provides the timing peer of the benchmarks (bench/bench_train.py).
"""
import json
import math
import struct
import sys

try:
    import numpy as np
    import torch
except ImportError:  # the C build and make check never depend on Python packages
    print("torch_peer: PyTorch (python3-torch) is not installed", file=sys.stderr)
    sys.exit(77)

DTYPES = {"F64": np.float64, "F32": np.float32}


def read_safetensors(path):
    """Return (metadata dict, {name: float64 numpy array})."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = raw[8 + n:]
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        arr = np.frombuffer(data[begin:end], dtype=DTYPES[info["dtype"]])
        tensors[name] = arr.reshape(info["shape"]).astype(np.float64)
    return meta, tensors


def step_size(schedule, base, k, L):
    return {"constant": base, "harmonic": base / k, "sqrt": base / math.sqrt(k),
            "linear": base * (L - k + 1) / L}[schedule]


class _EmbeddingF32Sum(torch.autograd.Function):
    """The rows of a bfloat16 table looked up by token; backward, the gradient rows of a
    repeated token summed in float32 and rounded once.  PyTorch 1.13's own lookup sums them
    in bfloat16 (one token 512 times errs by 2.6%), outside the convention bf16 of normref
    check (float32 accumulation), which rightly fails it on batches with many repeats."""

    @staticmethod
    def forward(ctx, table, tokens):
        ctx.save_for_backward(tokens)
        ctx.rows = table.shape[0]
        return table[tokens]

    @staticmethod
    def backward(ctx, grad):
        tokens, = ctx.saved_tensors
        total = torch.zeros((ctx.rows, grad.shape[-1]), dtype=torch.float32)
        total.index_add_(0, tokens.reshape(-1), grad.float().reshape(-1, grad.shape[-1]))
        return total.to(grad.dtype), None


class Peer:
    """The model of the specification, in PyTorch autograd."""

    def __init__(self, cfg, weights, dtype=torch.float64):
        self.c = cfg
        self.p = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in weights.items()}

    @staticmethod
    def mm(a, b):
        """a @ b as the bfloat16 conventions of normref check compute it: the stored (bfloat16)
        operands multiplied and summed in float32, the result stored in bfloat16, as cuBLAS and
        oneDNN's AVX-512 kernels do.  PyTorch 1.13's own bfloat16 products accumulate in
        bfloat16 on a processor without AVX-512 (their error grows like the square root of the
        inner dimension: 3.6% at 1024 against 0.17%), which is outside those conventions, and
        normref check rightly fails them there; this peer is to be a correct implementation
        on every processor.  Under autocast, the operands are cast as autocast casts them.
        In float64 and float32, a @ b."""
        if torch.is_autocast_cpu_enabled():
            low = torch.get_autocast_cpu_dtype()
            with torch.autocast(device_type="cpu", enabled=False):
                return (a.to(low).float() @ b.to(low).float()).to(low)
        if a.dtype == torch.bfloat16 or b.dtype == torch.bfloat16:
            return (a.float() @ b.float()).to(torch.bfloat16)
        return a @ b

    # -- spec section 2: the norms, eps inside the square root, biased variance
    def norm(self, x, slot):
        eps = self.c["eps"]
        if self.c["norm"] == "layernorm":
            mu = x.mean(-1, keepdim=True)
            var = ((x - mu) ** 2).mean(-1, keepdim=True)
            return (x - mu) / torch.sqrt(var + eps) * self.p[slot + ".weight"] + self.p[slot + ".bias"]
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * self.p[slot + ".weight"]

    # -- spec section 3: attention with optional per-head norms, GELU MLP
    def attention(self, x, l, norm_qk, norm_v):
        B, T, d = x.shape
        h = self.c["n_head"]
        dk = d // h
        pre = "h.%d.attn." % l
        qkv = self.mm(x, self.p[pre + "w_qkv"].T) + self.p[pre + "b_qkv"]
        q, k, v = [t.reshape(B, T, h, dk).transpose(1, 2) for t in qkv.split(d, dim=-1)]
        if norm_qk:
            q = self.norm(q, "h.%d.norm_q" % l)
            k = self.norm(k, "h.%d.norm_k" % l)
        if norm_v:
            v = self.norm(v, "h.%d.norm_v" % l)
        att = torch.softmax(self.scores(q, k), dim=-1)
        y = self.mm(att, v).transpose(1, 2).reshape(B, T, d)
        return self.mm(y, self.p[pre + "w_o"].T) + self.p[pre + "b_o"]

    def scores(self, q, k):
        """The attention's scores of q and k [B, h, T, d_k]: q k^T / sqrt(d_k), causally masked."""
        T, dk = q.shape[-2], q.shape[-1]
        att = self.mm(q, k.transpose(-1, -2)) / math.sqrt(dk)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        return att.masked_fill(mask, float("-inf"))

    def mlp(self, x, l):
        pre = "h.%d.mlp." % l
        a = self.mm(x, self.p[pre + "w_up"].T) + self.p[pre + "b_up"]
        return self.mm(self.gelu(a), self.p[pre + "w_down"].T) + self.p[pre + "b_down"]

    @staticmethod
    def gelu(a):
        """GELU, the tanh approximation of GPT-2 (spec section 3)."""
        return 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))

    # -- spec section 5: the geodesic step
    @staticmethod
    def geo(x, u, a):
        r2 = (x * x).sum(-1, keepdim=True)
        v = u - (u * x).sum(-1, keepdim=True) / r2 * x
        n = torch.sqrt((v * v).sum(-1, keepdim=True))
        theta = a * n / torch.sqrt(r2)
        small = theta < 1e-4
        safe = torch.where(small, torch.ones_like(theta), theta)
        sinc = torch.where(small, 1 - theta ** 2 / 6 + theta ** 4 / 120, torch.sin(safe) / safe)
        return torch.cos(theta) * x + sinc * a * v

    def record(self, k, stream, branch):
        """Sublayer k's input stream and its branch output (spec section 8); kept by the exporter."""

    @staticmethod
    def res(v):
        """A residual sum that becomes the stream (stored, where a precision stores tensors)."""
        return v

    # -- spec section 4: the placements; R(k, x, f) records sublayer k (input x, branch f) and gives f
    def block(self, x, l):
        c, L, dt = self.c, self.c["n_layer"], self.c["dt"]
        p = c["placement"]
        if p == "mixln":
            p = "post" if l < L // 4 else "pre"
        nqk = c["qk_norm"] or c["qkv_norm"]
        nv = c["qkv_norm"]
        A = lambda z: self.attention(z, l, nqk, nv)
        M = lambda z: self.mlp(z, l)
        N = lambda z, slot: self.norm(z, "h.%d.%s" % (l, slot))
        a, m = 2 * l, 2 * l + 1

        def R(k, stream, f):
            self.record(k, stream, f)
            return f
        if p == "none":
            y = self.res(x + dt * R(a, x, A(x)))
            return self.res(y + dt * R(m, y, M(y)))
        if p in ("post", "deepnorm"):
            al = (2 * L) ** 0.25 if p == "deepnorm" else 1.0
            y = N(al * x + dt * R(a, x, A(x)), "norm_attn_out")
            return N(al * y + dt * R(m, y, M(y)), "norm_mlp_out")
        if p == "pre" or (p == "hybrid_star" and l == 0):
            y = self.res(x + dt * R(a, x, A(N(x, "norm_attn_in"))))
            return self.res(y + dt * R(m, y, M(N(y, "norm_mlp_in"))))
        if p in ("peri", "sandwich"):
            y = self.res(x + dt * R(a, x, N(A(N(x, "norm_attn_in")), "norm_attn_out")))
            return self.res(y + dt * R(m, y, N(M(N(y, "norm_mlp_in")), "norm_mlp_out")))
        if p in ("hybrid", "hybrid_star"):
            y = self.res(x + dt * R(a, x, A(x)))
            ny = N(y, "norm_mlp_in")
            return self.res(ny + dt * R(m, y, M(ny)))
        if p == "geonorm":
            k = l + 1
            aA = step_size(c["geo_schedule"], c["geo_alpha_attn"], k, L)
            aM = step_size(c["geo_schedule"], c["geo_alpha_mlp"], k, L)
            y = self.geo(x, R(a, x, A(N(x, "norm_attn_in"))), aA)
            return self.geo(y, R(m, y, M(N(y, "norm_mlp_in"))), aM)
        raise ValueError("unknown placement " + p)

    def loss(self, tokens, targets):
        return self.forward(tokens, targets)[0]

    def forward(self, tokens, targets):
        """(the mean loss, the logits); the stream leaving the last block is kept in self.last_stream."""
        c = self.c
        B, T = tokens.shape
        wte = self.p["wte"]
        x = (_EmbeddingF32Sum.apply(wte, tokens) if wte.dtype == torch.bfloat16
             else wte[tokens]) + self.p["wpe"][:T]
        if c["emb_norm"]:
            if c["placement"] == "geonorm":
                x = math.sqrt(c["n_embd"]) * x / torch.sqrt((x * x).sum(-1, keepdim=True))
            else:
                x = self.norm(x, "norm_emb")
        for l in range(c["n_layer"]):
            x = self.block(x, l)
        self.last_stream = x
        if c["placement"] not in ("none", "post", "deepnorm"):
            x = self.norm(x, "norm_f")
        logits = self.mm(x, self.p["wte"].T)
        loss = torch.nn.functional.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1))
        return loss, logits


def byte_batch(path, B, T):
    raw = np.frombuffer(open(path, "rb").read(B * (T + 1)), dtype=np.uint8).astype(np.int64)
    rows = raw.reshape(B, T + 1)
    return torch.tensor(rows[:, :T]), torch.tensor(rows[:, 1:])


def check(model, data, B, T, grads, tol):
    meta, weights = read_safetensors(model)
    cfg = json.loads(meta["config"])
    peer = Peer(cfg, weights)
    tokens, targets = byte_batch(data, int(B), int(T))
    loss = peer.loss(tokens, targets)
    loss.backward()
    _, ref = read_safetensors(grads)
    worst = abs(loss.item() - float(ref["loss"])) / abs(float(ref["loss"]))
    print("%-28s relative difference %.2e  (normref %.17g, peer %.17g)" %
          ("loss", worst, float(ref["loss"]), loss.item()))
    # A tensor whose true gradient is zero (the shift of a per-head key norm: it moves every
    # logit of a row equally, which the softmax ignores) holds rounding noise in both
    # implementations.  Noise is bounded by a sum of B*T*d terms of the size of the model's
    # largest gradient, gamma_{BTd} * max|g| with gamma_n = n u; such a tensor is judged
    # by that absolute bound instead of a ratio of noise to noise.
    grads = {name: (t.grad.numpy() if t.grad is not None else np.zeros(tuple(t.shape)))
             for name, t in peer.p.items()}
    big = max(np.abs(ref["grad." + name]).max() for name in grads)
    zero = int(B) * int(T) * cfg["n_embd"] * np.finfo(float).eps / 2 * big
    for name, g in grads.items():
        r = ref["grad." + name]
        scale = max(np.abs(r).max(), np.abs(g).max())
        if scale <= zero:
            print("%-28s zero to rounding in both (max %.1e <= %.1e)" % ("grad." + name, scale, zero))
            continue
        rel = np.abs(g - r).max() / scale
        worst = max(worst, rel)
        print("%-28s normwise relative difference %.2e" % ("grad." + name, rel))
    ok = worst <= tol
    print("%s: worst relative difference %.2e (tolerance %.0e), placement %s, %s" %
          ("agree" if ok else "DISAGREE", worst, tol, cfg["placement"], model))
    return 0 if ok else 1


if __name__ == "__main__":
    args = sys.argv[1:]
    tol = 1e-12
    if "--tol" in args:
        i = args.index("--tol")
        tol = float(args[i + 1])
        del args[i:i + 2]
    torch.set_num_threads(1)
    if len(args) == 6 and args[0] == "check":
        sys.exit(check(*args[1:], tol))
    if len(args) == 2 and args[0] == "check-list":
        status = 0
        for line in open(args[1]):
            if line.strip():
                status |= check(*line.split(), tol)
        sys.exit(status)
    print(__doc__, file=sys.stderr)
    sys.exit(2)
