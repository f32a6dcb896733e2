"""The model through the binding: files, Hugging Face state dicts held in memory, the loss,
logits, traces and gradients."""
import json
import subprocess

import numpy as np
import pytest

import normref
from normref.vectors import read_tensors


def test_save_and_load(tmp_path, model):
    model.save(tmp_path / "m.st")
    back = normref.Model.load(tmp_path / "m.st")
    assert back.config == model.config
    a, b = model.parameters(), back.parameters()
    assert list(a) == model.names and all(np.array_equal(a[k], b[k]) for k in a)


def test_loss_logits_traces_gradients(model, batch):
    tokens, targets = batch
    loss, grads = model.gradients(tokens, targets)
    z = model.logits(tokens)
    assert z.shape == (2, 8, 256)
    # the loss is the mean cross-entropy of the logits, as the reference op computes it
    loss2, _ = normref.cross_entropy_forward(z.reshape(16, 256), targets.reshape(16))
    assert abs(loss - loss2) <= 1e-13 * abs(loss)
    model.forward(tokens, targets)
    tr = model.traces()
    assert sorted(tr) == sorted([f"stream.{k}" for k in range(5)] +
                                [f"branch.{k}" for k in range(4)])
    assert set(grads) == set(model.names) and grads["wte"].shape == (256, 8)


def test_a_hugging_face_state_dict_in_memory(tool, tmp_path):
    """normref's converter writes a GPT-2 state dict; the same tensors held in a dict come back
    as the same model, through Model.from_hf and no file."""
    gpt = normref.Model.new(placement="pre", norm="layernorm", n_layer=2, n_embd=8, n_head=2,
                            vocab_size=256, block_size=8, seed=7)
    gpt.save(tmp_path / "m.st")
    subprocess.run([tool, "convert", "--from", "normref", "--to", "hf", "--in",
                    str(tmp_path / "m.st"), "--out", str(tmp_path / "hf.st")], check=True,
                   capture_output=True)
    state = read_tensors(tmp_path / "hf.st")
    config = json.loads((tmp_path / "config.json").read_text())
    back = normref.Model.from_hf(state, config)
    a, b = gpt.parameters(), back.parameters()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    back2 = normref.Model.from_hf(state, n_head=2)
    assert back2.config["n_head"] == 2
    with pytest.raises(normref.Error, match="h.0.attn.c_attn.weight"):
        state["transformer.h.0.attn.c_attn.weight"] = state["transformer.h.0.attn.c_attn.weight"][:4]
        normref.Model.from_hf(state, config)


def test_model_new_refuses_a_bad_configuration():
    with pytest.raises(normref.Error, match="n_head"):
        normref.Model.new(placement="pre", norm="layernorm", n_layer=1, n_embd=8, n_head=3,
                          vocab_size=16, block_size=4)
