"""Bad input: an exception that names the argument and the problem, never an abort."""
import numpy as np
import pytest

import normref
from normref import InputError, Error

X = np.arange(32, dtype=np.float64).reshape(2, 16) / 7 - 1
G = np.ones(16)


def test_wrong_dtype():
    with pytest.raises(InputError, match=r"^x: dtype int64 is not a real floating type"):
        normref.layernorm_forward(np.arange(32).reshape(2, 16), G)
    with pytest.raises(InputError, match=r"^targets: dtype float64 is not an integer type"):
        normref.cross_entropy_forward(np.zeros((2, 3)), np.zeros(2))


def test_wrong_shape():
    with pytest.raises(InputError, match=r"^gamma: shape \[15\], expected \[16\]"):
        normref.rmsnorm_forward(X, np.ones(15))
    with pytest.raises(InputError, match=r"^dy: shape \[2, 15\], expected \[2, 16\]"):
        normref.gelu_backward(np.ones((2, 15)), X)
    with pytest.raises(InputError, match=r"^n_head: d = 4 is not divisible by n_head = 3"):
        normref.attention_forward(np.zeros((1, 2, 12)), 3)


def test_non_contiguous():
    with pytest.raises(InputError, match=r"^x: the array is not contiguous"):
        normref.layernorm_forward(np.ones((16, 4)).T, np.ones(16))


def test_nan_and_infinity():
    x = X.copy()
    x[1, 3] = np.nan
    with pytest.raises(InputError, match=r"^x: element 19 \(index \[1, 3\]\) is nan, not finite"):
        normref.layernorm_forward(x, G)
    with pytest.raises(InputError, match=r"^eps: inf is not finite"):
        normref.rmsnorm_forward(X, G, eps=np.inf)


def test_empty_and_not_an_array():
    with pytest.raises(InputError, match=r"^x: the array is empty"):
        normref.gelu_forward(np.zeros(0))
    with pytest.raises(InputError, match=r"^x: a object is not an array"):
        normref.gelu_forward(object())


def test_the_library_refuses_with_its_reason():
    """A constant row at eps = 0: the C library's own error, its code and its message."""
    with pytest.raises(Error, match=r"LayerNorm_forward: row 0 has variance 0") as e:
        normref.layernorm_forward(np.ones((1, 4)), np.ones(4), eps=0.0)
    assert e.value.code == 1 and e.value.name == "NR_EINVAL"
    with pytest.raises(Error, match=r"AdamW: beta1 = 1 must lie in \[0, 1\)"):
        normref.adamw_step(np.ones(2), np.ones(2), 1e-3, beta1=1.0)


def test_a_missing_file_and_a_corrupt_one(tmp_path):
    with pytest.raises(Error, match=str(tmp_path / "none.safetensors")) as e:
        normref.Model.load(tmp_path / "none.safetensors")
    assert e.value.name == "NR_EIO"
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(Error, match="bad.safetensors") as e:
        normref.Model.load(bad)
    assert e.value.name == "NR_EFORMAT"


def test_check_a_missing_tensor(model, batch):
    res = model.results(*batch)
    del res["loss"]
    rep = normref.check(res, model, batch, "f64")
    assert not rep.passed and rep.first_failure == "loss"
    assert "missing" in rep["loss"]["problem"]


def test_check_bad_arguments(model, batch):
    res = model.results(*batch)
    with pytest.raises(InputError, match=r"^precision: 'f8' is not one of f64, f32, bf16, f16"):
        normref.check(res, model, batch, "f8")
    with pytest.raises(InputError, match=r"^tokens: element 0 is 300, outside 0..255"):
        normref.check(res, model, (np.full((1, 4), 300), np.zeros((1, 4), int)), "f64")
    with pytest.raises(InputError, match=r"^results: expected a dict"):
        normref.check([1, 2], model, batch, "f64")
    with pytest.raises(InputError, match=r"^grad.wte: dtype int64 cannot be checked"):
        normref.check({"grad.wte": np.zeros((256, 8), dtype=np.int64)}, model, batch, "f64")


def test_vectors_bad_arguments():
    with pytest.raises(InputError, match=r"^op: 'softmax' is not one of"):
        normref.vectors.run(lambda x: x, op="softmax")
    with pytest.raises(InputError, match=r"^precision: 'f8'"):
        normref.vectors.run(lambda x: x, op="gelu", precision="f8")
    with pytest.raises(InputError, match=r"^ids: no vector gelu-99"):
        normref.vectors.run(lambda x: x, op="gelu", ids="gelu-99", framework="numpy")


def test_no_library_is_an_import_error(tmp_path):
    """A library that cannot be loaded: ImportError naming what was tried, not a crash."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, NORMREF_LIBRARY=str(tmp_path / "libnormref.so.0"),
               PYTHONPATH=os.path.dirname(os.path.dirname(normref.__file__)))
    r = subprocess.run([sys.executable, "-c", "import normref"], env=env, capture_output=True,
                       text=True, cwd=tmp_path)
    assert r.returncode == 1
    assert "ImportError: normref: cannot load the C library libnormref.so.0" in r.stderr
    assert str(tmp_path / "libnormref.so.0") in r.stderr
