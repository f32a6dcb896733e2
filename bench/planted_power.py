#!/usr/bin/env python3
"""How far a statistic made for a named bug can tell it from correct rounding.

A bug whose effect lies below a precision's rounding may still be seen by a statistic made
for it: where the alternative is known exactly (the erf GELU for the tanh one), the
difference D = x_bug - x between the float64 results with and without the bug is a direction
in the space of all results, and the error of a result projected on it,

    z = sum_t w_t <r_t - x_t, D_t> / sum_t w_t |D_t|^2,

is 0 for the exact correct result and 1 for the exact bugged one (t runs over the tensors,
w_t = 1 / the mean square error of tensor t over the correct results, so that each tensor
counts by what its rounding leaves of it).  Rounding adds noise to z; a bug can be told from
correct rounding by this test only if the bugged results' z stay apart from the correct
results'.  Chapter planted, section "What bf16
cannot see", reports it for the suite's models.

    /usr/bin/python3 bench/planted_power.py MODEL DATA B T [BUG ...]

computes, on the batch of B x T bytes of DATA (as normref grad reads it), the float64
results of the suite's model (bench/planted_bugs.py's) with and without each BUG (default:
gelu-erf eps-outside), then the results of each correct and bugged implementation at bf16,
autocast and bf16-fused, and prints z for each, over the gradients alone and over every
tensor (gradients, traces, logits), and at f32, where z is 0 and 1 to within float32's
rounding (a check of the statistic).  Each bug's summary gives the gap between the lowest
bugged z and the highest correct one (positive: apart) over the width of the correct ones:
a tolerance that passes the correct results with the check's margin c (c times their
largest distance from their mean) catches every bugged one only where the gap exceeds
about (c - 1)/2 of that width, 0.65 for bf16's c = 2.31.
Exit 0; 1 when a file cannot be read or the batch does not fit; 2 on a usage error; 77
without PyTorch.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import planted_bugs  # noqa: E402  (exits 77 without PyTorch)
from planted_bugs import BUGS, Planted, export_peer  # noqa: E402
from torch_peer import byte_batch, read_safetensors  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

IMPLS = ("bf16", "autocast", "bf16-fused")


def exact(model, data, B, T, bug):
    """The float64 results of the planted model: {name: array}."""
    meta, weights = read_safetensors(model)
    cfg = json.loads(meta["config"])
    peer = Planted(cfg, weights, torch.float64, bug)
    tokens, targets = byte_batch(data, B, T)
    logits = peer.logits(tokens)
    loss = torch.nn.functional.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1))
    loss.backward()
    out = {k: v.detach().numpy() for k, v in peer.trace.items()}
    out["logits"] = logits.detach().numpy()
    for name, t in peer.p.items():
        out["grad." + name] = (t.grad.numpy() if t.grad is not None
                               else np.zeros(tuple(t.shape)))
    return out


def rounded(model, data, B, T, impl, bug):
    tensors, _ = export_peer(model, data, B, T, None, impl, bug)
    return {k: v.astype(np.float64) for k, v in tensors if k != "loss"}


def z(r, x, D, w, names):
    num = sum(w[k] * np.vdot(r[k] - x[k], D[k]) for k in names)
    den = sum(w[k] * np.vdot(D[k], D[k]) for k in names)
    return num / den


def main(args):
    if (len(args) < 4 or not args[2].isdigit() or not args[3].isdigit()
            or any(b not in BUGS for b in args[4:])):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        return measure(args[0], args[1], int(args[2]), int(args[3]), args[4:])
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print("planted_power: %s" % e, file=sys.stderr)
        return 1


def measure(model, data, B, T, bugs):
    bugs = bugs or ["gelu-erf", "eps-outside"]
    if os.path.getsize(data) < B * (T + 1):
        raise ValueError("%s has %d bytes; a batch of %d x %d needs %d"
                         % (data, os.path.getsize(data), B, T, B * (T + 1)))
    if B < 1 or T < 1:
        raise ValueError("B and T must be at least 1")
    torch.set_num_threads(1)
    x = exact(model, data, B, T, None)
    correct = {impl: rounded(model, data, B, T, impl, None) for impl in IMPLS + ("f32",)}
    names = [k for k in x if k in correct[IMPLS[0]]]
    grads = [k for k in names if k.startswith("grad.")]
    w = {}
    for k in names:
        ms = np.mean([np.mean((correct[i][k] - x[k]) ** 2) for i in IMPLS])
        w[k] = 1.0 / ms if ms > 0 else 0.0
    print("# %s, %d x %d tokens of %s" % (os.path.basename(model), B, T, os.path.basename(data)))
    print("# z: 0 is the exact correct result, 1 the exact bugged one")
    print("%-12s %-11s %10s %10s %10s %10s" % ("bug", "impl", "correct g", "bugged g",
                                              "correct all", "bugged all"))
    for bug in bugs:
        xb = exact(model, data, B, T, bug)
        D = {k: xb[k] - x[k] for k in names}
        zs = {"cg": [], "bg": [], "ca": [], "ba": []}
        for impl in IMPLS:
            rb = rounded(model, data, B, T, impl, bug)
            row = (z(correct[impl], x, D, w, grads), z(rb, x, D, w, grads),
                   z(correct[impl], x, D, w, names), z(rb, x, D, w, names))
            for key, v in zip(("cg", "bg", "ca", "ba"), row):
                zs[key].append(v)
            print("%-12s %-11s %10.3f %10.3f %10.3f %10.3f" % ((bug, impl) + row))
        # float32 rounds far below either bug: its z are 0 and 1 to within its rounding, a
        # check of the statistic itself, not counted in the summary
        f32 = (z(correct["f32"], x, D, w, names), z(rounded(model, data, B, T, "f32", bug),
                                                   x, D, w, names))
        print("%-12s %-11s %10s %10s %10.3f %10.3f" % (bug, "f32", "", "", f32[0], f32[1]))
        for label, c, b in (("gradients", zs["cg"], zs["bg"]), ("every tensor", zs["ca"], zs["ba"])):
            gap = min(b) - max(c)           # > 0: every bugged result above every correct one
            print("%-12s %s: correct %.3f to %.3f, bugged %.3f to %.3f: %s, gap/width %.2f" % (
                bug, label, min(c), max(c), min(b), max(b), "apart" if gap > 0 else "overlap",
                gap / (max(c) - min(c))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
