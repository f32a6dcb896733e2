"""PyTorch through the plugin: F.layer_norm and a hand-written RMSNorm held against the test
vectors at f32 and bf16, the mistake of eps outside the square root found and named, tensors
of any dtype accepted, and a Hugging Face GPT-2 checked end to end without a file."""
import numpy as np
import pytest

import normref as nr
from conftest import torch_or_skip

torch = torch_or_skip()
import torch.nn.functional as F


def torch_layernorm(x, gamma, beta, eps):
    return F.layer_norm(x, x.shape[-1:], gamma, beta, eps)


def rmsnorm(x, gamma, eps):
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    ms = xf.pow(2).mean(-1, keepdim=True)
    if bool((ms + eps == 0).any()):
        raise ValueError("a zero row with eps = 0 has no RMS")
    return (xf * torch.rsqrt(ms + eps) * gamma.to(xf.dtype)).to(x.dtype)


def rmsnorm_eps_outside(x, gamma, eps):
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    ms = xf.pow(2).mean(-1, keepdim=True)
    if bool((ms + eps == 0).any()):
        raise ValueError("a zero row with eps = 0 has no RMS")
    return (xf / (ms.sqrt() + eps) * gamma.to(xf.dtype)).to(x.dtype)


@pytest.mark.parametrize("precision", ["f64", "f32", "bf16"])
def test_hand_written_rmsnorm_passes(normref, precision):
    run = normref.assert_matches_reference(rmsnorm, op="rmsnorm", precision=precision)
    assert len(run) == 6 and all(r.verdict == "pass" for r in run)


@pytest.mark.parametrize("precision,first", [("f32", "rmsnorm-1"), ("bf16", "rmsnorm-3")])
def test_eps_outside_the_square_root_fails_naming_the_vector(normref, precision, first):
    with pytest.raises(normref.ReferenceMismatch) as e:
        normref.assert_matches_reference(rmsnorm_eps_outside, op="rmsnorm", precision=precision)
    msg = str(e.value)
    assert msg.startswith(f"rmsnorm_eps_outside does not match the reference on vector {first} ")
    assert "tolerance" in msg.splitlines()[0]


# F.layer_norm returns NaN for a constant row at eps = 0, which the reference refuses
# (layernorm-2), and at bf16 its backward leaves 0.25 where the gradient of d = 1 is zero
# (layernorm-7): the failures of chapter vectors' PyTorch runner, and no others.
@pytest.mark.parametrize("precision,expected", [("f32", {"layernorm-2"}),
                                                ("bf16", {"layernorm-2", "layernorm-7"})])
def test_torch_layer_norm(normref, precision, expected):
    with pytest.raises(normref.ReferenceMismatch) as e:
        normref.assert_matches_reference(torch_layernorm, op="layernorm", precision=precision)
    run = e.value.run
    assert {r.id for r in run.failures} == expected
    assert "expected a refusal" in run.first_failure.message
    assert len([r for r in run if r.verdict == "pass"]) == len(run) - len(expected)


def test_tensors_in_any_dtype_and_dlpack():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    y, rstd = nr.rmsnorm_forward(x, torch.ones(16))
    y2, _ = nr.rmsnorm_forward(x.float().numpy(), np.ones(16))
    assert np.array_equal(y, y2)

    class OnlyDLPack:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, stream=None):
            return self.t.__dlpack__()

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()
    z = torch.randn(3, 8, dtype=torch.float64)
    assert np.array_equal(nr.gelu_forward(OnlyDLPack(z)), nr.gelu_forward(z.numpy()))


def test_bf16_results_as_the_command_sees_them(tool, tmp_path, model, batch):
    from test_check import same_as_cli
    # the bf16 convention: tensors stored in bfloat16, the loss in float32 (a loss rounded to
    # bfloat16 is off by up to 2^-9 of itself, outside the convention, and fails)
    res = {k: torch.tensor(np.asarray(v)).to(torch.bfloat16 if k != "loss" else torch.float32)
           for k, v in model.results(*batch).items()}
    assert same_as_cli(tool, tmp_path, model, batch, res, "bf16").passed
    res["loss"] = res["loss"].to(torch.bfloat16)
    assert not same_as_cli(tool, tmp_path, model, batch, res, "bf16").passed


def test_gpt2_end_to_end_without_a_file(normref):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=256, n_positions=16))
    ref = normref.Model.from_hf(gpt.state_dict(), gpt.config)
    tokens, targets = normref.byte_batch(b"The quick brown fox jumps over the lazy dog", 2, 8)
    normref.assert_matches_reference(normref.hf_results(gpt, tokens, targets), model=ref,
                                     batch=(tokens, targets), precision="f32")
    gpt.transformer.h[0].ln_2.eps = 1e-2        # a mistake in the first block's second norm
    with pytest.raises(normref.ReferenceMismatch, match="first failing tensor stream.2:"):
        normref.assert_matches_reference(normref.hf_results(gpt, tokens, targets), model=ref,
                                         batch=(tokens, targets), precision="f32")


def test_bf16_rounding():
    """The inputs a function gets at bf16 are the float64 values rounded once to the nearest
    bfloat16, ties to even: PyTorch's rounding over the whole range, subnormals, ties and
    overflow included, except where PyTorch 1.13 rounds through float32 first."""
    from normref.vectors import _round
    rng = np.random.default_rng(3)
    a = rng.standard_normal(200000) * 10.0 ** rng.uniform(-45, 39, 200000)
    a = np.concatenate([a, [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 1.5 * 2.0 ** -133,
                            3.4e38, 3.39e38, -3.4e38, 1e-45, 0.0, -0.0]])
    want = torch.tensor(a).to(torch.bfloat16).float().numpy()
    got = _round(a, "bf16")
    assert got.dtype == np.float32 and np.array_equal(got, want), a[got != want][:5]
    # just above a tie in float64, on it once rounded to float32: one rounding goes up;
    # PyTorch's two (float64 to float32 to bfloat16) go to the even neighbour below
    x = np.array([1 + 2.0 ** -8 + 2.0 ** -40])
    assert _round(x, "bf16")[0] == 1 + 2.0 ** -7
    assert torch.tensor(x).to(torch.bfloat16).item() in (1.0, 1 + 2.0 ** -7)
