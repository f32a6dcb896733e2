#!/usr/bin/env python3
"""Cross-check normref against Hugging Face transformers' GPT2LMHeadModel.

    hf_crosscheck.py NORMREF WORKDIR

Both directions, in float64:
  from-hf:  a randomly initialised GPT2LMHeadModel (no download) is saved as a state dict
            (safetensors + config.json), converted with 'normref convert --from hf', and the
            loss and every gradient of PyTorch and of 'normref grad' are compared;
  to-hf:    a model of 'normref init' is converted with 'normref convert --to hf', loaded with
            GPT2LMHeadModel.from_pretrained, and compared in the same way.
The batch follows 'normref grad': row b is bytes b(T+1) .. b(T+1)+T of the data file, inputs
the first T, targets the last T; the loss is the mean cross-entropy of the logits, computed
here (not with HF's shifted labels).  Prints one line 'agree: ...' or 'DISAGREE: ...' per
direction with the largest relative differences; the exit status is 0 when both agree.
"""
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

TOL = 1e-12      # relative, normwise per tensor: the error model of the book's chapter convert
B, T = 3, 16
SIZES = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=256, n_positions=16)

# normref name -> (Hugging Face name, transposed)
def hf_names(n_layer):
    names = {"wte": ("transformer.wte.weight", False), "wpe": ("transformer.wpe.weight", False),
             "norm_f.weight": ("transformer.ln_f.weight", False),
             "norm_f.bias": ("transformer.ln_f.bias", False)}
    block = [("norm_attn_in.weight", "ln_1.weight", False), ("norm_attn_in.bias", "ln_1.bias", False),
             ("attn.w_qkv", "attn.c_attn.weight", True), ("attn.b_qkv", "attn.c_attn.bias", False),
             ("attn.w_o", "attn.c_proj.weight", True), ("attn.b_o", "attn.c_proj.bias", False),
             ("norm_mlp_in.weight", "ln_2.weight", False), ("norm_mlp_in.bias", "ln_2.bias", False),
             ("mlp.w_up", "mlp.c_fc.weight", True), ("mlp.b_up", "mlp.c_fc.bias", False),
             ("mlp.w_down", "mlp.c_proj.weight", True), ("mlp.b_down", "mlp.c_proj.bias", False)]
    for l in range(n_layer):
        for ours, theirs, tr in block:
            names[f"h.{l}.{ours}"] = (f"transformer.h.{l}.{theirs}", tr)
    return names


def run(*args):
    out = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): {' '.join(args)}\n{out.stdout}")
    return out.stdout


def batch(data_path):
    data = open(data_path, "rb").read()[: B * (T + 1)]
    rows = torch.tensor(list(data), dtype=torch.long).view(B, T + 1)
    return rows[:, :T], rows[:, 1:]


def torch_loss_and_grads(model, inputs, targets):
    model.eval()           # no dropout (the configurations have none anyway)
    model.zero_grad()
    logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.item(), grads


def compare(label, normref, model_path, data_path, torch_loss, torch_grads, work):
    gpath = os.path.join(work, label + ".grads.safetensors")
    run(normref, "grad", "--model", model_path, "--data", data_path, "--batch", str(B), "--seq",
        str(T), "--out", gpath)
    g = load_file(gpath)
    loss = g["loss"].item()
    loss_rel = abs(loss - torch_loss) / abs(torch_loss)
    rels = {}
    for ours, (theirs, tr) in hf_names(SIZES["n_layer"]).items():
        ref = torch_grads[theirs]       # wte's includes lm_head's share: the same Parameter
        if tr:
            ref = ref.t()
        rels[ours] = ((g["grad." + ours] - ref).norm() / ref.norm()).item()
    worst = max(rels, key=rels.get)
    ok = loss_rel <= TOL and rels[worst] <= TOL
    print(f"{'agree' if ok else 'DISAGREE'}: {label}: loss {loss:.17g}, relative difference "
          f"of the loss {loss_rel:.3g}, of the gradients at most {rels[worst]:.3g} ({worst}), "
          f"over {len(rels)} tensors; tolerance {TOL:g}")
    return ok


def from_hf(normref, work, data_path):
    torch.manual_seed(2385)
    cfg = GPT2Config(**SIZES, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).double()
    with torch.no_grad():          # high-entropy values: every bias and norm parameter drawn
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    d = os.path.join(work, "from-hf")
    os.makedirs(d, exist_ok=True)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    cfg.to_json_file(os.path.join(d, "config.json"))
    out = os.path.join(work, "from-hf.st")
    run(normref, "convert", "--from", "hf", "--to", "normref", "--in",
        os.path.join(d, "model.safetensors"), "--out", out)
    inputs, targets = batch(data_path)
    loss, grads = torch_loss_and_grads(model, inputs, targets)
    return compare("from-hf", normref, out, data_path, loss, grads, work)


def to_hf(normref, work, data_path):
    src = os.path.join(work, "to-hf.st")
    run(normref, "init", "--placement", "pre", "--n-layer", str(SIZES["n_layer"]), "--n-embd",
        str(SIZES["n_embd"]), "--n-head", str(SIZES["n_head"]), "--vocab-size",
        str(SIZES["vocab_size"]), "--block-size", str(SIZES["n_positions"]), "--seed", "7",
        "--out", src)
    d = os.path.join(work, "to-hf")
    os.makedirs(d, exist_ok=True)
    run(normref, "convert", "--from", "normref", "--to", "hf", "--in", src, "--out",
        os.path.join(d, "model.safetensors"))
    json.load(open(os.path.join(d, "config.json")))
    model = GPT2LMHeadModel.from_pretrained(d, torch_dtype=torch.float64, local_files_only=True)
    assert next(model.parameters()).dtype == torch.float64
    inputs, targets = batch(data_path)
    loss, grads = torch_loss_and_grads(model, inputs, targets)
    return compare("to-hf", normref, src, data_path, loss, grads, work)


def main():
    normref, work = sys.argv[1], sys.argv[2]
    torch.set_default_dtype(torch.float64)
    data_path = os.path.join(work, "data.txt")
    with open(data_path, "wb") as f:
        f.write(bytes((37 * k * k + 11 * k + 5) % 256 for k in range(B * (T + 1))))
    ok = from_hf(normref, work, data_path)
    ok = to_hf(normref, work, data_path) and ok
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
