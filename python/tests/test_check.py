"""check() gives the verdicts of `normref check` on the same results: the same verdict, the
same first failing tensor, the same table."""
import json
import subprocess

import numpy as np
import pytest

import normref
from normref._files import safetensors_bytes
from conftest import TEXT


def cli(tool, tmp_path, model, results, precision):
    """normref check on files holding the same model, batch and results"""
    model.save(tmp_path / "model.st")
    (tmp_path / "data.txt").write_bytes(TEXT)
    (tmp_path / "results.st").write_bytes(safetensors_bytes(results))
    r = subprocess.run([tool, "check", "--model", str(tmp_path / "model.st"), "--data",
                        str(tmp_path / "data.txt"), "--batch", "2", "--seq", "8", "--results",
                        str(tmp_path / "results.st"), "--precision", precision, "--json",
                        str(tmp_path / "report.json")], capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr
    with open(tmp_path / "report.json") as f:
        return r.returncode, r.stdout, json.load(f)


def same_as_cli(tool, tmp_path, model, batch, results, precision):
    status, stdout, js = cli(tool, tmp_path, model, results, precision)
    rep = normref.check(results, str(tmp_path / "model.st"), batch, precision)
    assert rep.passed == (status == 0)
    assert rep.first_failure == (js["summary"]["first_failure"]
                                 or js["summary"]["first_identity_failure"])
    assert rep.json == js
    # the table the command prints after its first line, character for character
    assert stdout.split("\n", 1)[1] == rep.text
    return rep


def perturbed(res, name, factor):
    res = dict(res)
    res[name] = res[name] * factor
    return res


def test_own_results_pass_at_f64(tool, tmp_path, model, batch):
    rep = same_as_cli(tool, tmp_path, model, batch, model.results(*batch), "f64")
    assert rep.passed and rep.first_failure is None
    names = [row["name"] for row in rep.table]
    assert names[0] == "stream.0" and "loss" in names and "grad.wte" in names


def test_float32_results_at_f32(tool, tmp_path, model, batch):
    res = {k: np.asarray(v, dtype=np.float32) for k, v in model.results(*batch).items()}
    assert same_as_cli(tool, tmp_path, model, batch, res, "f32").passed


@pytest.mark.parametrize("name", ["branch.1", "logits", "grad.h.0.attn.w_qkv", "grad.wte"])
def test_a_wrong_tensor_is_the_first_failure(tool, tmp_path, model, batch, name):
    res = perturbed(model.results(*batch), name, 1 + 1e-6)
    rep = same_as_cli(tool, tmp_path, model, batch, res, "f64")
    assert not rep.passed and rep.first_failure == name
    assert rep[name]["verdict"] == "fail" and rep[name]["ratio"] > 1


def test_two_wrong_tensors_first_in_forward_order(tool, tmp_path, model, batch):
    res = perturbed(perturbed(model.results(*batch), "grad.wte", 1.01), "stream.3", 1.01)
    rep = same_as_cli(tool, tmp_path, model, batch, res, "f64")
    assert rep.first_failure == "stream.3"


def test_a_missing_tensor_as_the_command_sees_it(tool, tmp_path, model, batch):
    res = model.results(*batch)
    del res["grad.h.1.mlp.w_up"]
    rep = same_as_cli(tool, tmp_path, model, batch, res, "f64")
    assert rep.first_failure == "grad.h.1.mlp.w_up"
    # it fails whatever the reference says: reported alone, before the reference is computed
    assert rep.json["summary"]["reference_computed"] is False
    assert [row["name"] for row in rep.table] == ["grad.h.1.mlp.w_up"]


def test_results_from_a_file(tmp_path, model, batch):
    path = tmp_path / "results.st"
    path.write_bytes(safetensors_bytes(model.results(*batch)))
    assert normref.check(str(path), model, batch, "f64").passed


def test_the_model_is_unchanged_by_a_check(model, batch):
    before = model.parameters()
    normref.check(model.results(*batch), model, batch, "f64")
    after = model.parameters()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_the_assertion_names_the_first_failing_tensor(model, batch):
    good = model.results(*batch)
    assert normref.assert_matches_reference(good, model=model, batch=batch, precision="f64").passed
    with pytest.raises(normref.ReferenceMismatch) as e:
        normref.assert_matches_reference(perturbed(good, "grad.wte", 1.001), model=model,
                                         batch=batch, precision="f64")
    first = str(e.value).splitlines()[0]
    assert first.startswith("the results do not match the reference at f64: first failing "
                            "tensor grad.wte: max abs error")
    assert "tolerance" in first and e.value.report.first_failure == "grad.wte"


@pytest.mark.parametrize("precision,runs", [("f32", 16), ("bf16", 64), ("f16", 64)])
def test_the_runs_by_default_are_the_commands(tool, tmp_path, model, batch, precision, runs):
    res = {k: np.asarray(v, dtype=np.float32) for k, v in model.results(*batch).items()}
    rep = same_as_cli(tool, tmp_path, model, batch, res, precision)
    assert rep.json["calibration_runs"] == runs


def test_the_identities_of_the_gradient(tool, tmp_path, model, batch):
    res = {k: np.asarray(v, dtype=np.float32) for k, v in model.results(*batch).items()}
    rep = same_as_cli(tool, tmp_path, model, batch, res, "f32")
    assert [row["name"] for row in rep.identities][:4] == [
        "identity.h.0.attn_in", "identity.h.0.mlp_in", "identity.h.0.qk", "identity.h.0.vo"]
    row = rep["identity.h.0.mlp_in"]
    assert row["verdict"] == "pass" and abs(row["skew"]) <= row["tolerance"]
    rep = same_as_cli(tool, tmp_path, model, batch, perturbed(res, "grad.h.0.mlp.w_up", 1.01),
                      "f32")
    assert rep["identity.h.0.mlp_in"]["verdict"] == "fail" and not rep.passed
    assert abs(rep["identity.h.0.mlp_in"]["skew"] - 0.01) < 1e-3


def test_a_failing_identity_alone_is_the_first_failure():
    js = {"precision": "bf16", "tensors": [{"name": "grad.h.0.attn.w_o", "verdict": "pass"}],
          "identities": [{"name": "identity.h.0.vo", "verdict": "fail", "skew": -0.0097,
                          "tolerance": 0.0068, "ratio": 1.42}],
          "summary": {"verdict": "fail", "first_failure": None,
                      "first_identity_failure": "identity.h.0.vo"}}
    rep = normref.Report("the table", js)
    assert not rep.passed and rep.first_failure == "identity.h.0.vo"
    assert rep[rep.first_failure]["skew"] == -0.0097
