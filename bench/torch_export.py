#!/usr/bin/env python3
"""Export a PyTorch implementation's results with the specification's names, for `normref check`.

This is the other side of a validation: an implementation that is not normref computes the
loss, the logits, every gradient and the trace of the residual stream on the batch that
`normref grad` and `normref check` read, and writes them as a safetensors file named as
spec section 8 says (`loss`, `logits`, `grad.NAME`, `stream.{k}`, `branch.{k}`), with the
precision it claims in `__metadata__.precision`.  The implementation is bench/torch_peer.py's
model, written from the specification in PyTorch autograd.

    /usr/bin/python3 bench/torch_export.py MODEL DATA B T OUT [--dtype f64|f32|bf16|f16] [--break NAME]
                                          [--loss-scale S]
    /usr/bin/python3 bench/torch_export.py export-list FILE

export-list reads one "MODEL DATA B T OUT [options]" line per export.

--dtype bf16 is the convention `bf16` of `normref check`: the model converted to bfloat16
(every parameter, activation and gradient stored in it, as model.to(torch.bfloat16) does) and
the loss computed in float32 from the bfloat16 logits; its tensors are written as F32.  Its
products and the embedding's gradient sum in float32, as the convention says (PyTorch 1.13's
own sum them in bfloat16 on some processors; see bench/torch_peer.py).  The
metadata records model_fnv1a64 and batch_fnv1a64, the digests `normref grad` writes (FNV-1a 64
of the model file's bytes, and of the tokens then the targets as little-endian int32).

--dtype f16 is the convention `f16`, computed as a kernel library with float32 arithmetic inside
its kernels computes it (PyTorch has no half-precision kernels on the CPU): float32 tensors that
hold half-precision values, the weights rounded to half, and every product, norm output, GELU
output, geodesic step and residual sum that becomes the stream rounded to half on its way out
and its gradient rounded to half on its way back; bias additions, the softmax and a sum that
only feeds a norm (Post-LN's, DeepNorm's) are kept in float32 (fused into their neighbours), the loss in float32 from the half logits, the
parameters' gradients summed in float32 and stored in half.  The backward pass starts from the
loss times 1024 and the parameters' gradients are divided by it before they are stored, as
half-precision training scales its loss (a static scale): a loss's gradient divided by B*T
tokens lies below half's smallest normal number, and the gradients that pass through the
attention's scores would lose percents to half's subnormals.  --loss-scale S sets that scale
(a power of two from 1 to 2^24; 1 is half precision without one); the metadata's producer
names it when it is not 1024.

--break plants one deliberate mistake, so that the report that catches it can be read:
  ln-eps-outside   LayerNorm divides by sqrt(var) + eps instead of sqrt(var + eps)
  gelu-erf         the MLP uses the erf GELU instead of the tanh approximation

Exit 0 when the file is written, 2 on a usage error, 77 when PyTorch is not installed.
"""
import json
import math
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peer  # noqa: E402,F401  (exits 77 without PyTorch)
from torch_peer import Peer, byte_batch, read_safetensors  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

BREAKS = ("ln-eps-outside", "gelu-erf")
F16_LOSS_SCALE = 1024.0     # the gradients' scale in half precision (--dtype f16)
LOSS_SCALES = tuple(str(2 ** k) for k in range(25))   # what --loss-scale accepts


class TracedPeer(Peer):
    """The peer, recording the stream entering every sublayer and every branch output.

    stream.{k} enters sublayer k (k = 0 .. 2L, stream.0 after any embedding norm); branch.{k}
    is sublayer k's F(h) after any output norm, before the step size multiplies it, which
    is what is added to (or, for GeoNorm, combined with) the stream."""

    def __init__(self, cfg, weights, dtype, broken):
        super().__init__(cfg, weights, dtype)
        self.broken = broken
        self.trace = {}

    def norm(self, x, slot):
        if self.broken == "ln-eps-outside" and self.c["norm"] == "layernorm":
            mu = x.mean(-1, keepdim=True)
            var = ((x - mu) ** 2).mean(-1, keepdim=True)
            return ((x - mu) / (torch.sqrt(var) + self.c["eps"]) * self.p[slot + ".weight"]
                    + self.p[slot + ".bias"])
        return super().norm(x, slot)

    def gelu(self, a):
        if self.broken != "gelu-erf":
            return super().gelu(a)
        return 0.5 * a * (1 + torch.erf(a / math.sqrt(2)))

    def record(self, k, stream, branch):
        self.trace["stream.%d" % k] = stream
        self.trace["branch.%d" % k] = branch


class Round16(torch.autograd.Function):
    """A float32 tensor stored in IEEE half: forward its value rounded, backward its gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.half().float()

    @staticmethod
    def backward(ctx, g):
        return g.half().float()


h16 = Round16.apply


def round_to_half(params):
    """Every float32 parameter (a dict of leaf tensors) rounded to half, in place."""
    with torch.no_grad():
        for t in params.values():
            t.copy_(t.half().float())


class HalfPeer(TracedPeer):
    """TracedPeer at f16: its kernels' outputs stored in half (the docstring's --dtype f16)."""

    def __init__(self, cfg, weights, broken):
        super().__init__(cfg, weights, torch.float32, broken)
        round_to_half(self.p)

    def mm(self, a, b):
        return h16(a @ b)

    def norm(self, x, slot):
        return h16(super().norm(x, slot))

    def gelu(self, a):
        return h16(super().gelu(a))

    def geo(self, x, u, a):
        return h16(Peer.geo(x, u, a))

    def res(self, v):
        return h16(v)


def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, numpy array); written in that order, plain (no checksums)."""
    header, offset, blobs = {"__metadata__": metadata}, 0, []
    for name, arr in tensors:
        arr = np.array(arr, order="C")      # keeps a 0-d array 0-d (the scalar loss)
        dtype = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32"}[arr.dtype]
        raw = arr.astype(arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path + ".tmp%d" % os.getpid()
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)
    os.replace(tmp, path)


def host(t):
    """a tensor as a numpy array; bfloat16, which numpy lacks, widened exactly to float32"""
    t = t.detach()
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def fnv1a64(chunks):
    h = 0xcbf29ce484222325
    for chunk in chunks:
        for byte in chunk:
            h = ((h ^ byte) * 0x100000001b3) & 0xffffffffffffffff
    return "%016x" % h


def export(model, data, B, T, out, dtype, broken, loss_scale=F16_LOSS_SCALE):
    meta, weights = read_safetensors(model)
    cfg = json.loads(meta["config"])
    tdtype, ndtype = {"f64": (torch.float64, np.float64), "f32": (torch.float32, np.float32),
                      "bf16": (torch.bfloat16, np.float32), "f16": (None, np.float32)}[dtype]
    peer = (HalfPeer(cfg, weights, broken) if dtype == "f16"
            else TracedPeer(cfg, weights, tdtype, broken))
    tokens, targets = byte_batch(data, B, T)
    loss, logits = peer.forward(tokens, targets)
    if dtype == "bf16":                 # the loss in float32 from the bfloat16 logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(B * T, -1),
                                                 targets.reshape(-1))
    peer.trace["stream.%d" % (2 * cfg["n_layer"])] = peer.last_stream
    scale = loss_scale if dtype == "f16" else 1.0
    (loss * scale).backward()
    with open(model, "rb") as f:
        digests = {"model_fnv1a64": fnv1a64([f.read()]),
                   "batch_fnv1a64": fnv1a64([np.asarray(x, dtype="<i4").tobytes()
                                             for x in (tokens, targets)])}
    tensors = []
    L = cfg["n_layer"]
    for k in range(2 * L + 1):
        tensors.append(("stream.%d" % k, host(peer.trace["stream.%d" % k])))
        if k < 2 * L:
            tensors.append(("branch.%d" % k, host(peer.trace["branch.%d" % k])))
    tensors.append(("logits", host(logits)))
    tensors.append(("loss", np.array(loss.item(), dtype=ndtype)))
    for name, t in peer.p.items():
        g = host(t.grad) if t.grad is not None else np.zeros(tuple(t.shape), dtype=ndtype)
        if dtype == "f16":
            g = (g / np.float32(scale)).astype(np.float16).astype(np.float32)     # stored in half
        tensors.append(("grad." + name, g))
    write_safetensors(out, [(n, np.asarray(a, dtype=ndtype)) for n, a in tensors],
                      dict(digests, precision=dtype, producer="bench/torch_export.py" +
                           (" --break " + broken if broken else "") +
                           (" --loss-scale %g" % scale if dtype == "f16" and
                            scale != F16_LOSS_SCALE else "")))
    print("torch_export: %s %s, loss %.17g, %d tensors -> %s" %
          (cfg["placement"], cfg["norm"], loss.item(), len(tensors), out))
    return 0


def main(args):
    if len(args) == 2 and args[0] == "export-list":
        # one "MODEL DATA B T OUT [options]" line per export: one process for many (PyTorch starts slowly)
        torch.set_num_threads(1)
        status = 0
        for line in open(args[1]):
            if line.strip():
                status |= main(line.split())
        return status
    dtype, broken, scale = "f64", None, None
    while len(args) > 5:
        if args[-2] == "--dtype" and args[-1] in ("f64", "f32", "bf16", "f16"):
            dtype = args[-1]
        elif args[-2] == "--break" and args[-1] in BREAKS:
            broken = args[-1]
        elif args[-2] == "--loss-scale" and args[-1] in LOSS_SCALES:
            scale = float(args[-1])
        else:
            break
        del args[-2:]
    misplaced_scale = scale is not None and dtype != "f16"
    if len(args) != 5 or misplaced_scale:
        print(__doc__, file=sys.stderr)
        if misplaced_scale:
            print("torch_export: --loss-scale is for --dtype f16 alone", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    return export(args[0], args[1], int(args[2]), int(args[3]), args[4], dtype, broken,
                  F16_LOSS_SCALE if scale is None else scale)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
