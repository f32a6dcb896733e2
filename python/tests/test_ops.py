"""The reference ops through the binding: each agrees with the test vectors at f64 (run
through vectors.run as any NumPy function would be), refuses what the reference refuses,
and computes what the C library computes."""
import numpy as np
import pytest

import normref
from normref import vectors


def ln(x, gamma, beta, eps, dy):
    y, mean, rstd = normref.layernorm_forward(x, gamma, beta, eps)
    dx, dgamma, dbeta = normref.layernorm_backward(dy, x, gamma, mean, rstd)
    return dict(y=y, mean=mean, rstd=rstd, dx=dx, dgamma=dgamma, dbeta=dbeta)


def rms(x, gamma, eps, dy):
    y, rstd = normref.rmsnorm_forward(x, gamma, eps)
    dx, dgamma = normref.rmsnorm_backward(dy, x, gamma, rstd)
    return dict(y=y, rstd=rstd, dx=dx, dgamma=dgamma)


def attention(qkv, dout, n_head, norm=None, eps=1e-5, **weights):
    out, cache = normref.attention_forward(qkv, n_head, norm=norm, eps=eps, **weights)
    dqkv, dw = normref.attention_backward(dout, cache)
    return dict(out=out, probs=cache.probs, dqkv=dqkv, **dw)


def geonorm(x, u, a, dy, schedule=None, block=1, n_layer=1):
    y = normref.geonorm_forward(x, u, a)
    dx, du, da = normref.geonorm_backward(dy, x, u, a)
    out = dict(y=y, dx=dx, du=du, da=np.array([da]))
    if schedule is not None:
        out["dbase"] = np.array([da * normref.geonorm_step_size(schedule, 1.0, block, n_layer)])
    return out


def gelu(x, dy):
    return dict(y=normref.gelu_forward(x), dx=normref.gelu_backward(dy, x))


def cross_entropy(logits, targets):
    loss, probs = normref.cross_entropy_forward(logits, targets)
    return dict(loss=loss, probs=probs, dlogits=normref.cross_entropy_backward(probs, targets))


def adamw(params, grads, m, v, decay_mask, t, lr, beta1, beta2, eps, weight_decay):
    p, m2, v2, _ = normref.adamw_step(params, grads, lr, m, v, t, beta1, beta2, eps,
                                      weight_decay, decay_mask)
    return dict(params_out=p, m_out=m2, v_out=v2)


FUNCTIONS = dict(layernorm=ln, rmsnorm=rms, attention=attention, geonorm=geonorm, gelu=gelu,
                 cross_entropy=cross_entropy, adamw=adamw)


@pytest.mark.parametrize("op", sorted(FUNCTIONS))
def test_the_reference_passes_its_own_vectors(op):
    run = vectors.run(FUNCTIONS[op], op=op, precision="f64", framework="numpy")
    assert len(run) > 0
    assert run.passed, repr(run)
    # every valid vector compared outputs and the gradients, not only a refusal
    judged = [r for r in run if r.verdict == "pass" and "refused" not in r.message]
    assert judged, repr(run)


def test_every_output_of_a_vector_is_judged():
    """A function that returns a wrong gradient fails: the gradients are compared too."""
    def wrong_dgamma(**kw):
        out = rms(**kw)
        out["dgamma"] = out["dgamma"] * (1 + 1e-9)
        return out
    run = vectors.run(wrong_dgamma, op="rmsnorm", precision="f64", framework="numpy",
                      ids=["rmsnorm-1"])
    assert not run.passed and "dgamma" in run.first_failure.where


def test_the_geonorm_schedules():
    assert normref.SCHEDULES == ("constant", "harmonic", "sqrt", "linear")
    got = [normref.geonorm_step_size(s, 2.0, 2, 4) for s in normref.SCHEDULES]
    assert got == [2.0, 1.0, 2.0 / np.sqrt(2.0), 2.0 * 3 / 4]


def test_layernorm_of_any_rank_and_float32():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 16))
    y, mean, rstd = normref.layernorm_forward(x.astype(np.float32), np.ones(16), np.zeros(16))
    y2, _, _ = normref.layernorm_forward(x.astype(np.float32).astype(np.float64).reshape(6, 16),
                                         np.ones(16), np.zeros(16))
    assert y.shape == x.shape and mean.shape == (2, 3) and np.array_equal(y.reshape(6, 16), y2)


def test_a_single_row():
    """x of one axis: mean and rstd are 0-d arrays, and the backward pass takes them back"""
    x = np.linspace(-1, 2, 8)
    y, mean, rstd = normref.layernorm_forward(x, np.ones(8), np.zeros(8))
    assert y.shape == (8,) and mean.shape == () and rstd.shape == ()
    dx, dgamma, dbeta = normref.layernorm_backward(np.ones(8), x, np.ones(8), mean, rstd)
    assert dx.shape == (8,) and np.allclose(dbeta, 1)
    y2, rstd2 = normref.rmsnorm_forward(x, np.ones(8))
    assert normref.rmsnorm_backward(np.ones(8), x, np.ones(8), rstd2)[0].shape == (8,)


def test_attention_probabilities_are_causal():
    rng = np.random.default_rng(2)
    out, cache = normref.attention_forward(rng.standard_normal((1, 4, 12)), 2)
    p = cache.probs
    assert p.shape == (1, 2, 4, 4)
    assert np.allclose(p.sum(-1), 1) and np.all(np.triu(p[0, 0], 1) == 0)


def test_adamw_first_step_moves_by_lr():
    p, m, v, t = normref.adamw_step(np.ones(3), np.array([1.0, -2.0, 0.5]), 1e-3,
                                    weight_decay=0.0)
    assert t == 1 and np.allclose(p, 1 - 1e-3 * np.sign([1.0, -2.0, 0.5]), rtol=0, atol=1e-10)
