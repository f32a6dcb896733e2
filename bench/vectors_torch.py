#!/usr/bin/python3
"""Run normref's test vectors (normref vectors --out DIR) through PyTorch's own functions.

usage: vectors_torch.py DIR [--precisions f64,f32,bf16,f16] [--verbose]

Reads DIR/manifest.json and the safetensors files it names (with a small reader of its own:
the safetensors package is not needed), runs each vector with PyTorch on the CPU in every
precision asked for (inputs rounded to the precision, as the manifest's tolerance assumes),
and prints one line per vector and precision, PASS / FAIL / SKIP with the worst ratio of
error to tolerance, then a summary.  The exit status is 0 when the runner could run (failures
are results, reported), 2 on a bad manifest or file.
"""
import json
import math
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

DTYPES = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
NP = {"F64": np.float64, "F32": np.float32}


class BadFile(Exception):
    pass


def read_safetensors(path):
    """The tensors of a safetensors file as float64 numpy arrays, by name."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise BadFile(f"{path}: shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise BadFile(f"{path}: header length {n} beyond the end of the file")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise BadFile(f"{path}: the header is not JSON ({e})")
    body = data[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if e.get("dtype") not in NP:
            raise BadFile(f"{path}: tensor {name} has dtype {e.get('dtype')}, not F64 or F32")
        a, b = e["data_offsets"]
        dt = np.dtype(NP[e["dtype"]]).newbyteorder("<")
        count = int(np.prod(e["shape"])) if e["shape"] else 1
        if not (0 <= a <= b <= len(body)) or b - a != count * dt.itemsize:
            raise BadFile(f"{path}: tensor {name} has data offsets {a}..{b} that do not fit")
        out[name] = np.frombuffer(body[a:b], dtype=dt).astype(np.float64).reshape(e["shape"])
    return out


class NotRunnable(Exception):
    """PyTorch has no function for the op (or not in this precision on the CPU)."""


def t(x, dtype, grad=False):
    return torch.tensor(x, dtype=torch.float64).to(dtype).requires_grad_(grad)


def g64(x):
    return None if x is None else x.detach().to(torch.float64).numpy()


def rms_norm(x, shape, weight, eps):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, shape, weight, eps)
    raise NotRunnable("torch.nn.functional.rms_norm does not exist in PyTorch " + torch.__version__)


def run_norm(kind, params, inp, dtype):
    x, gamma, dy = t(inp["x"], dtype, True), t(inp["gamma"], dtype, True), t(inp["dy"], dtype)
    d = x.shape[-1]
    if kind == "layernorm":
        beta = t(inp["beta"], dtype, True)
        y = F.layer_norm(x, (d,), gamma, beta, params["eps"])
    else:
        beta = None
        y = rms_norm(x, (d,), gamma, params["eps"])
    y.backward(dy)
    out = {"y": g64(y), "dx": g64(x.grad), "dgamma": g64(gamma.grad)}
    if beta is not None:
        out["dbeta"] = g64(beta.grad)
    return out


def head_norm(z, kind, gamma, beta, eps):
    dk = z.shape[-1]
    if kind == "layernorm":
        return F.layer_norm(z, (dk,), gamma, beta, eps)
    return rms_norm(z, (dk,), gamma, eps)


def run_attention(params, inp, dtype):
    qkv, dout = t(inp["qkv"], dtype, True), t(inp["dout"], dtype)
    B, T, d3 = qkv.shape
    d, h = d3 // 3, int(params["n_head"])
    dk = d // h
    norm = params.get("norm")
    ws = {k: t(v, dtype, True) for k, v in inp.items() if k.startswith(("gamma_", "beta_"))}
    q, k, v = [qkv[:, :, i * d:(i + 1) * d].reshape(B, T, h, dk).transpose(1, 2) for i in range(3)]
    parts = {"q": q, "k": k, "v": v}
    for s in "qkv":
        if norm is not None and ("gamma_" + s) in ws:
            parts[s] = head_norm(parts[s], norm, ws["gamma_" + s], ws.get("beta_" + s),
                                 params["eps"])
    scores = parts["q"] @ parts["k"].transpose(-1, -2) / math.sqrt(dk)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    probs = F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    o = (probs @ parts["v"]).transpose(1, 2).reshape(B, T, d)
    o.backward(dout)
    out = {"out": g64(o), "probs": g64(probs), "dqkv": g64(qkv.grad)}
    for name, w in ws.items():
        out["d" + name] = g64(w.grad)
    return out


def run_gelu(params, inp, dtype):
    x, dy = t(inp["x"], dtype, True), t(inp["dy"], dtype)
    try:
        y = F.gelu(x, approximate="tanh")
    except TypeError:
        raise NotRunnable("F.gelu has no approximate='tanh' in PyTorch " + torch.__version__)
    y.backward(dy)
    return {"y": g64(y), "dx": g64(x.grad)}


def run_cross_entropy(params, inp, dtype):
    z = t(inp["logits"], dtype, True)
    target = torch.tensor(inp["targets"].astype(np.int64))
    loss = F.cross_entropy(z, target)
    loss.backward()
    return {"loss": g64(loss), "probs": g64(F.softmax(z.detach(), dim=-1)), "dlogits": g64(z.grad)}


def run_adamw(params, inp, dtype):
    mask = inp["decay_mask"] != 0
    p = t(inp["params"], dtype)
    groups, pieces = [], []
    for decay in (True, False):
        idx = np.nonzero(mask == decay)[0]
        if len(idx) == 0:
            continue
        w = torch.nn.Parameter(p[idx].clone())
        w.grad = t(inp["grads"][idx], dtype)
        groups.append({"params": [w], "weight_decay": params["weight_decay"] if decay else 0.0})
        pieces.append((idx, w))
    opt = torch.optim.AdamW(groups, lr=params["lr"], betas=(params["beta1"], params["beta2"]),
                            eps=params["eps"])
    step = int(params["t"])
    if step > 0:
        for idx, w in pieces:
            opt.state[w] = {"step": torch.tensor(float(step)),
                            "exp_avg": t(inp["m"][idx], dtype),
                            "exp_avg_sq": t(inp["v"][idx], dtype)}
    opt.step()
    out = {k: np.zeros(len(mask)) for k in ("params_out", "m_out", "v_out")}
    for idx, w in pieces:
        st = opt.state[w]
        out["params_out"][idx] = g64(w)
        out["m_out"][idx] = g64(st["exp_avg"])
        out["v_out"][idx] = g64(st["exp_avg_sq"])
    return out


def run_model(params, inp, dtype):
    """The model vectors through the independent PyTorch model of bench/torch_peer.py."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        from torch_peer import Peer
    except ImportError as e:
        raise NotRunnable(f"bench/torch_peer.py cannot be imported ({e})")
    cfg = params["config"]
    if cfg["placement"] == "ngpt":
        raise NotRunnable("bench/torch_peer.py has no nGPT")
    weights = {k: v for k, v in inp.items() if k not in ("tokens", "targets")}
    peer = Peer(cfg, weights, dtype)
    tokens = torch.tensor(inp["tokens"].astype(np.int64))
    targets = torch.tensor(inp["targets"].astype(np.int64))
    loss = peer.loss(tokens, targets)
    loss.backward()
    out = {"loss": g64(loss)}
    for name, w in peer.p.items():
        out["grad." + name] = g64(w.grad) if w.grad is not None else np.zeros(tuple(w.shape))
    return out


def run(op, params, inp, dtype):
    if op in ("layernorm", "rmsnorm"):
        return run_norm(op, params, inp, dtype)
    if op == "attention":
        return run_attention(params, inp, dtype)
    if op == "gelu":
        return run_gelu(params, inp, dtype)
    if op == "cross_entropy":
        return run_cross_entropy(params, inp, dtype)
    if op == "adamw":
        return run_adamw(params, inp, dtype)
    if op == "geonorm":
        raise NotRunnable("PyTorch has no GeoNorm")
    if op == "model":
        return run_model(params, inp, dtype)
    raise NotRunnable(f"no PyTorch function for op {op}")


def judge(test, tensors, prec, got):
    """(worst ratio, where) over the outputs PyTorch computed"""
    worst, where = 0.0, ""
    tol = test["precisions"][prec].get("tolerance", {})
    for name, g in got.items():
        entry = tol.get(name)
        if entry is None:
            continue
        want, bound = tensors[name], tensors[entry["tensor"]]
        g = np.asarray(g, dtype=np.float64).reshape(want.shape)
        err = np.abs(g - want)
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(bound > 0, err / bound, np.where(err == 0, 0.0, np.inf))
        r = np.where(np.isnan(err), np.inf, r)
        i = int(np.argmax(r)) if r.size else 0
        if r.size and r.flat[i] > worst:
            worst = float(r.flat[i])
            where = (f"{name}[{i}]: got {g.flat[i]:.9g}, want {want.flat[i]:.9g}, "
                     f"tol {bound.flat[i]:.3g}")
    return worst, where


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(argv) >= 2 else 2
    folder = argv[1]
    precs = ["f64", "f32", "bf16", "f16"]
    verbose = "--verbose" in argv
    if "--precisions" in argv:
        precs = argv[argv.index("--precisions") + 1].split(",")
    try:
        with open(f"{folder}/manifest.json") as f:
            man = json.load(f)
    except (OSError, ValueError) as e:
        print(f"vectors_torch: cannot read {folder}/manifest.json: {e}", file=sys.stderr)
        return 2
    print(f"# PyTorch {torch.__version__}, {folder}")
    counts = {p: {"PASS": 0, "FAIL": 0, "SKIP": 0} for p in precs}
    worst_op = {}
    for group in man["groups"]:
        op = group["op"]
        for test in group["tests"]:
            try:
                tensors = read_safetensors(f"{folder}/{test['file']}")
            except (OSError, BadFile) as e:
                print(f"vectors_torch: {e}", file=sys.stderr)
                return 2
            inp = {k: tensors[k] for k in test["inputs"]}
            for prec in precs:
                verdict = test["precisions"][prec]["result"]
                head = f"{test['id']:16s} {prec:4s}"
                if verdict == "not representable":
                    print(f"SKIP {head} not representable in {prec}")
                    counts[prec]["SKIP"] += 1
                    continue
                try:
                    with np.errstate(all="ignore"):
                        got = run(op, test["params"], inp, DTYPES[prec])
                    err = None
                except NotRunnable as e:
                    print(f"SKIP {head} {e}")
                    counts[prec]["SKIP"] += 1
                    continue
                except RuntimeError as e:
                    if "not implemented for" in str(e):
                        print(f"SKIP {head} not runnable on the CPU: {str(e).splitlines()[0]}")
                        counts[prec]["SKIP"] += 1
                        continue
                    err = str(e).splitlines()[0]
                if verdict == "invalid":
                    ok = err is not None
                    why = (f"refused: {err}" if ok else
                           "expected a refusal (" + test.get("error", "") + "); PyTorch returned "
                           + ("non-finite numbers" if not all(np.all(np.isfinite(v))
                                                              for v in got.values())
                              else "numbers"))
                    ratio = 0.0 if ok else math.inf
                elif err is not None:
                    ok = verdict == "acceptable"
                    ratio, why = (0.0 if ok else math.inf), f"error: {err}"
                else:
                    ratio, why = judge(test, tensors, prec, got)
                    ok = ratio <= 1
                    finite = all(np.all(np.isfinite(v)) for v in got.values())
                    if verdict == "acceptable" and not ok and not finite:
                        ok, why = True, "non-finite outputs, acceptable here: " + \
                            test["precisions"][prec].get("note", "")
                word = "PASS" if ok else "FAIL"
                counts[prec][word] += 1
                key = (op, prec)
                if ratio != math.inf or not ok:
                    worst_op[key] = max(worst_op.get(key, 0.0), ratio)
                if verbose or not ok or why.startswith(("refused", "error", "non-finite")):
                    print(f"{word} {head} worst {ratio:.3g} {why}  ({test['comment']})")
                else:
                    print(f"{word} {head} worst {ratio:.3g}")
    print("# summary (PASS / FAIL / SKIP per precision)")
    for p in precs:
        c = counts[p]
        print(f"summary {p:4s} PASS {c['PASS']:3d} FAIL {c['FAIL']:3d} SKIP {c['SKIP']:3d}")
    for (op, p), r in sorted(worst_op.items()):
        print(f"worst {op:14s} {p:4s} {r:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
