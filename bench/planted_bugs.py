#!/usr/bin/env python3
"""Results of a PyTorch implementation at float32 and bfloat16, correct or with a planted bug.

The suite of `normref check`'s verdicts (chapter planted): the model of the specification
in PyTorch autograd (bench/torch_peer.py's, a Pre-LN GPT as nanoGPT writes it), computed as
users compute it, and eleven mistakes that a kernel or a framework can make.  Each export
writes loss, logits, every grad.NAME and every trace stream.{k}, branch.{k}
(interchange specification, section "Results"), as float32, with
__metadata__.precision the precision claimed.

    /usr/bin/python3 bench/planted_bugs.py export-list FILE [--device cuda]

FILE holds one export a line:  MODEL DATA B T OUT IMPL [BUG]

IMPL is how the model is computed:
  f32        weights, activations and loss in float32
  bf16       the model in torch.bfloat16 (weights rounded to bfloat16, every activation
             bfloat16), the loss in float32 from the logits cast to float
  autocast   float32 weights, the forward pass under torch.autocast('cpu', torch.bfloat16)
             (its products in bfloat16), the loss in float32
  bf16-fused as bf16, with the GELU computed in float32 from the bfloat16 input and rounded
             once to bfloat16, forward and backward, as a fused kernel computes it
  f16        IEEE half storage, as a kernel library with float32 arithmetic inside its kernels
             computes it (PyTorch has no half-precision kernels on the CPU): the weights rounded
             to half, and every tensor a kernel writes (the embedding's sum, each product with
             its bias, the scaled and masked scores, the probabilities, each norm's output, the
             GELU's, each residual sum, the logits) rounded to half on the way out, its gradient
             rounded to half on the way back; products and sums in float32, the loss in float32
             from the half logits, the parameters' gradients summed in float32 and stored in half
  f16-ops    as f16, with each norm and the GELU written from tensor operations, every
             operation's output (and its gradient) stored in half, their constants (eps, the
             GELU's) stored in half, the cube as (a a) a, a product stored before its bias is
             added, and the scores stored before their scale: as PyTorch's half-precision
             tensor operations compute them where it has half kernels
  hf-f32, hf-bf16, hf-autocast
             Hugging Face's GPT2LMHeadModel loaded from MODEL, a folder written by
             `normref convert --to hf` (model.safetensors, config.json), in float32, in
             torch.bfloat16, or in float32 with the forward pass under torch.autocast('cpu',
             torch.bfloat16); the results keep Hugging Face's names (grad.transformer.h.0.
             attn.c_attn.weight, ..., hidden_states.{i}), for `normref convert --from hf
             --to normref --results`
  hf-tf32, hf-f16-autocast
             the same model in float32 with its products in TF32 (PyTorch's allow_tf32), which
             claims f32 and is a fault: TF32 keeps 10 of float32's 23 fraction bits; and the
             forward pass under torch.autocast(DEVICE, torch.float16), the backward pass from
             the loss times 1024 (a static loss scale, the gradients divided by it), claimed as
             f16.  Both need a GPU (--device cuda): the CPU has no TF32 and no half kernels

--device cuda computes the Hugging Face lines on the GPU (float32 without TF32 unless the
line says hf-tf32; the attention is the library's fused one where it has it); the default is
the CPU.
BUG, for f32, bf16, autocast, bf16-fused and f16 only, is one of
  zero-grads       every gradient is zero
  grad-x2          grad.h.0.mlp.w_up is twice the true one
  grad-x1.01       grad.h.0.mlp.w_up is 1.01 times the true one
  eps-outside      every LayerNorm divides by sqrt(var) + eps, not sqrt(var + eps)
  unbiased-var     every LayerNorm uses the unbiased variance (divides by n - 1)
  gelu-erf         the MLP uses the erf GELU, not the tanh approximation
  no-causal-mask   the attention sees the future
  scale-1/dk       the attention's scores are scaled by 1/d_k, not 1/sqrt(d_k)
  no-final-bias    the final LayerNorm adds no bias
  wpe-shift        position t gets the embedding of position t + 1
  loss+0.01        the loss is 0.01 too large (the gradients are right)

One process writes every file (PyTorch starts slowly).  Exit 0 when every file is written,
1 when one could not be, 2 on a usage error, 77 when PyTorch is not installed.
"""
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peer  # noqa: E402,F401  (exits 77 without PyTorch)
from torch_peer import Peer, byte_batch, read_safetensors  # noqa: E402
from torch_export import h16, round_to_half, write_safetensors  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

BUGS = ("zero-grads", "grad-x2", "grad-x1.01", "eps-outside", "unbiased-var", "gelu-erf",
        "no-causal-mask", "scale-1/dk", "no-final-bias", "wpe-shift", "loss+0.01")
IMPLS = ("f32", "bf16", "autocast", "bf16-fused", "f16", "f16-ops", "hf-f32", "hf-bf16",
         "hf-autocast", "hf-tf32", "hf-f16-autocast")
DEVICE = "cpu"              # where the Hugging Face lines run (--device)
# The tensor that grad-x2 and grad-x1.01 scale: the largest weight matrix of block 0 (d x 4d
# elements), the product of the MLP's backward pass that a matrix kernel computes.
SCALED = "h.0.mlp.w_up"


class Planted(Peer):
    """The peer with a bug, in a storage type, recording every sublayer's stream and branch."""

    def __init__(self, cfg, weights, dtype, bug):
        super().__init__(cfg, weights, dtype)
        self.bug = bug
        self.fused = False
        self.trace = {}

    def record(self, k, stream, branch):
        self.trace["stream.%d" % k] = stream
        self.trace["branch.%d" % k] = branch

    def norm(self, x, slot):
        if self.bug not in ("eps-outside", "unbiased-var", "no-final-bias"):
            return super().norm(x, slot)
        eps, n = self.c["eps"], x.shape[-1]
        mu = x.mean(-1, keepdim=True)
        ss = ((x - mu) ** 2).sum(-1, keepdim=True)
        var = ss / (n - 1) if self.bug == "unbiased-var" else ss / n
        den = torch.sqrt(var) + eps if self.bug == "eps-outside" else torch.sqrt(var + eps)
        y = (x - mu) / den * self.p[slot + ".weight"]
        if self.bug == "no-final-bias" and slot == "norm_f":
            return y
        return y + self.p[slot + ".bias"]

    def scores(self, q, k):
        if self.bug not in ("no-causal-mask", "scale-1/dk"):
            return super().scores(q, k)
        T, dk = q.shape[-2], q.shape[-1]
        att = self.mm(q, k.transpose(-1, -2)) / (dk if self.bug == "scale-1/dk" else math.sqrt(dk))
        if self.bug != "no-causal-mask":
            mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
            att = att.masked_fill(mask, float("-inf"))
        return att

    def gelu(self, a):
        if self.fused:      # in float32 from the stored input, one rounding of the output
            return self.gelu_any(a.float()).to(a.dtype)
        return self.gelu_any(a)

    def gelu_any(self, a):
        if self.bug != "gelu-erf":
            return super().gelu(a)
        return 0.5 * a * (1 + torch.erf(a / math.sqrt(2)))

    def logits(self, tokens):
        """The logits of the Pre-LN model (the only placement of the suite)."""
        T = tokens.shape[1]
        wpe = self.p["wpe"][1:T + 1] if self.bug == "wpe-shift" else self.p["wpe"][:T]
        x = self.p["wte"][tokens] + wpe
        for l in range(self.c["n_layer"]):
            x = self.block(x, l)
        self.trace["stream.%d" % (2 * self.c["n_layer"])] = x
        return self.mm(self.norm(x, "norm_f"), self.p["wte"].T)


class Half(Planted):
    """The planted model at f16: float32 tensors that hold half-precision values, rounded
    where a kernel stores its output (the docstring's IMPLS)."""

    def __init__(self, cfg, weights, bug, ops=False):
        super().__init__(cfg, weights, torch.float32, bug)
        self.ops = ops
        round_to_half(self.p)

    @staticmethod
    def mm(a, b):
        return a @ b                        # float32; each caller stores the result

    def norm(self, x, slot):
        if not self.ops:
            return h16(super().norm(x, slot))
        eps = torch.tensor(self.c["eps"]).half().float()
        mu = h16(x.mean(-1, keepdim=True))
        xc = h16(x - mu)
        var = h16(h16(xc * xc).mean(-1, keepdim=True))
        y = h16(xc / h16(torch.sqrt(h16(var + eps))))
        return h16(h16(y * self.p[slot + ".weight"]) + self.p[slot + ".bias"])

    def gelu(self, a):
        if not self.ops:
            return h16(self.gelu_any(a))
        k = lambda v: float(torch.tensor(v).half())
        u = h16(a + h16(k(0.044715) * h16(h16(a * a) * a)))
        t = h16(torch.tanh(h16(k(math.sqrt(2 / math.pi)) * u)))
        return h16(h16(0.5 * a) * h16(1 + t))

    def affine(self, x, w, b):
        """x w^T + b stored: at once, or the product stored before the bias is added"""
        return h16(h16(x @ w.T) + b) if self.ops else h16(x @ w.T + b)

    def scores(self, q, k):
        if not self.ops:
            return super().scores(q, k)
        T, dk = q.shape[-2], q.shape[-1]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        return (h16(q @ k.transpose(-1, -2)) / math.sqrt(dk)).masked_fill(mask, float("-inf"))

    def attention(self, x, l, norm_qk, norm_v):
        B, T, d = x.shape
        h = self.c["n_head"]
        pre = "h.%d.attn." % l
        qkv = self.affine(x, self.p[pre + "w_qkv"], self.p[pre + "b_qkv"])
        q, k, v = [t.reshape(B, T, h, d // h).transpose(1, 2) for t in qkv.split(d, dim=-1)]
        att = h16(torch.softmax(h16(self.scores(q, k)), dim=-1))
        y = h16(att @ v).transpose(1, 2).reshape(B, T, d)
        return self.affine(y, self.p[pre + "w_o"], self.p[pre + "b_o"])

    def mlp(self, x, l):
        pre = "h.%d.mlp." % l
        a = self.affine(x, self.p[pre + "w_up"], self.p[pre + "b_up"])
        return self.affine(self.gelu(a), self.p[pre + "w_down"], self.p[pre + "b_down"])

    def res(self, v):                       # the stream, after each residual sum
        return h16(v)

    def logits(self, tokens):
        T = tokens.shape[1]
        wpe = self.p["wpe"][1:T + 1] if self.bug == "wpe-shift" else self.p["wpe"][:T]
        x = h16(self.p["wte"][tokens] + wpe)
        for l in range(self.c["n_layer"]):
            x = self.block(x, l)
        self.trace["stream.%d" % (2 * self.c["n_layer"])] = x
        return h16(self.norm(x, "norm_f") @ self.p["wte"].T)


def export_peer(model, data, B, T, out, impl, bug):
    meta, weights = read_safetensors(model)
    cfg = json.loads(meta["config"])
    if cfg["placement"] != "pre" or cfg["norm"] != "layernorm" or cfg["emb_norm"]:
        raise ValueError("%s: the suite's implementation is the Pre-LN LayerNorm GPT" % model)
    if bug == "wpe-shift" and T + 1 > cfg["block_size"]:
        raise ValueError("wpe-shift needs T + 1 <= block_size")
    if impl in ("f16", "f16-ops"):
        peer = Half(cfg, weights, bug, ops=impl == "f16-ops")
    else:
        peer = Planted(cfg, weights,
                       torch.bfloat16 if impl in ("bf16", "bf16-fused") else torch.float32, bug)
    peer.fused = impl == "bf16-fused"
    tokens, targets = byte_batch(data, B, T)
    if impl == "autocast":
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            logits = peer.logits(tokens)
    else:
        logits = peer.logits(tokens)
    # the loss in float32 from the logits cast to float, as users write it at bfloat16
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(B * T, -1), targets.reshape(-1))
    loss.backward()
    if bug == "loss+0.01":
        loss = loss + 0.01
    f32 = lambda t: t.detach().float().numpy()
    L = cfg["n_layer"]
    tensors = []
    for k in range(2 * L + 1):
        tensors.append(("stream.%d" % k, f32(peer.trace["stream.%d" % k])))
        if k < 2 * L:
            tensors.append(("branch.%d" % k, f32(peer.trace["branch.%d" % k])))
    tensors.append(("logits", f32(logits)))
    tensors.append(("loss", np.array(loss.item(), dtype=np.float32)))
    for name, t in peer.p.items():
        g = f32(t.grad) if t.grad is not None else np.zeros(tuple(t.shape), np.float32)
        if impl in ("f16", "f16-ops"):
            g = g.astype(np.float16).astype(np.float32)     # stored in half
        if bug == "zero-grads":
            g = np.zeros_like(g)
        elif bug in ("grad-x2", "grad-x1.01") and name == SCALED:
            g = g * np.float32(2.0 if bug == "grad-x2" else 1.01)
        tensors.append(("grad." + name, g))
    return tensors, loss.item()


def export_hf(folder, data, B, T, impl):
    import transformers
    from transformers import GPT2LMHeadModel   # only the hf lines need it
    dtype = torch.bfloat16 if impl == "hf-bf16" else torch.float32
    # the argument is dtype from transformers 4.56 on, torch_dtype before (where dtype is ignored)
    major, minor = (int(v) for v in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model = GPT2LMHeadModel.from_pretrained(folder, **{key: dtype})
    if next(model.parameters()).dtype != dtype:
        raise ValueError("%s: transformers %s loaded the model in %s, not %s"
                         % (folder, transformers.__version__, next(model.parameters()).dtype, dtype))
    model.to(DEVICE)
    model.eval()    # no dropout (the conversion writes zero dropout rates anyway)
    tokens, targets = byte_batch(os.path.join(data), B, T)
    tokens, targets = tokens.to(DEVICE), targets.to(DEVICE)
    if DEVICE == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = impl == "hf-tf32"
        torch.backends.cudnn.allow_tf32 = impl == "hf-tf32"
    elif impl in ("hf-tf32", "hf-f16-autocast"):
        raise ValueError("%s needs --device cuda" % impl)
    scale = 1024.0 if impl == "hf-f16-autocast" else 1.0
    if impl in ("hf-autocast", "hf-f16-autocast"):
        half = torch.float16 if impl == "hf-f16-autocast" else torch.bfloat16
        with torch.autocast(device_type=DEVICE, dtype=half):
            outputs = model(tokens, output_hidden_states=True)
    else:
        outputs = model(tokens, output_hidden_states=True)
    logits = outputs.logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(B * T, -1), targets.reshape(-1))
    (loss * scale).backward()
    f32 = lambda t: t.detach().float().cpu().numpy()
    tensors = [("hidden_states.%d" % i, f32(h)) for i, h in enumerate(outputs.hidden_states)]
    tensors.append(("logits", f32(logits)))
    tensors.append(("loss", np.array(loss.item(), dtype=np.float32)))
    for name, p in model.named_parameters():
        tensors.append(("grad." + name, f32(p.grad) / np.float32(scale)))
    return tensors, loss.item()


def export(model, data, B, T, out, impl, bug):
    if impl.startswith("hf-"):
        tensors, loss = export_hf(model, data, B, T, impl)
    else:
        tensors, loss = export_peer(model, data, B, T, out, impl, bug)
    write_safetensors(out, tensors, {
        "precision": ("f32" if impl in ("f32", "hf-f32", "hf-tf32")
                      else "f16" if impl.startswith("f16") or impl == "hf-f16-autocast" else "bf16"),
        "producer": "bench/planted_bugs.py %s%s%s" % (impl, " " + bug if bug else "",
                                                      " on cuda" if impl.startswith("hf-") and DEVICE == "cuda" else "")})
    print("planted_bugs: %s %s, loss %.9g -> %s" % (impl, bug or "correct", loss, out))


def main(args):
    global DEVICE
    if len(args) == 4 and args[2] == "--device" and args[3] in ("cpu", "cuda"):
        DEVICE = args[3]
        args = args[:2]
    if len(args) != 2 or args[0] != "export-list":
        print(__doc__, file=sys.stderr)
        return 2
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("planted_bugs: --device cuda: PyTorch sees no GPU", file=sys.stderr)
        return 77
    torch.set_num_threads(1)
    torch.manual_seed(0)
    status = 0
    for line in open(args[1]):
        w = line.split()
        if not w:
            continue
        if len(w) not in (6, 7) or w[5] not in IMPLS or (len(w) == 7 and (
                w[6] not in BUGS or w[5].startswith("hf-") or w[5] == "f16-ops")):
            print("planted_bugs: bad line: %s" % line.strip(), file=sys.stderr)
            return 2
        try:
            export(w[0], w[1], int(w[2]), int(w[3]), w[4], w[5], w[6] if len(w) == 7 else None)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            print("planted_bugs: %s: %s" % (w[4], e), file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
