"""The float64 reference operations, forward and backward, as NumPy functions.

Each function checks its arguments (see ``_lib.real``), allocates its outputs, calls the C
function of the same name and returns what that function writes.  Norms work on the last
axis of an array of any rank (the C functions' ``[N, d]`` with ``N`` the product of the
others).  The backward functions return fresh gradients (the C functions accumulate into
their outputs; here the outputs start at zero).
"""
import ctypes
from ctypes import c_double, c_int, c_long, c_size_t, c_void_p, c_char_p, POINTER

import numpy as np

from ._lib import lib, call, real, integers, number, ptr, iptr, InputError, c_double_p, c_int_p, \
    _sig

EPS_DEFAULT = 1e-5
SCHEDULES = ("constant", "harmonic", "sqrt", "linear")
NORMS = ("layernorm", "rmsnorm")

_sig("LayerNorm_forward", c_int, c_double_p, c_double_p, c_double_p, c_double_p, c_double_p,
     c_double_p, c_size_t, c_size_t, c_double)
_sig("LayerNorm_backward", c_int, c_double_p, c_double_p, c_double_p, c_double_p, c_double_p,
     c_double_p, c_double_p, c_double_p, c_size_t, c_size_t)
_sig("RMSNorm_forward", c_int, c_double_p, c_double_p, c_double_p, c_double_p, c_size_t, c_size_t,
     c_double)
_sig("RMSNorm_backward", c_int, c_double_p, c_double_p, c_double_p, c_double_p, c_double_p,
     c_double_p, c_size_t, c_size_t)
_sig("GeoNorm_forward", c_int, c_double_p, c_double_p, c_double_p, c_double, c_size_t, c_size_t)
_sig("GeoNorm_backward", c_int, c_double_p, c_double_p, c_double_p, c_double_p, c_double_p,
     c_double_p, c_double, c_size_t, c_size_t)
_sig("GeoNorm_step_size", c_double, c_int, c_double, c_size_t, c_size_t)
_sig("Gelu_forward", None, c_double_p, c_double_p, c_size_t)
_sig("Gelu_backward", None, c_double_p, c_double_p, c_double_p, c_size_t)
_sig("CrossEntropy_forward", c_int, c_double_p, c_double_p, c_double_p, c_int_p, c_size_t,
     c_size_t)
_sig("CrossEntropy_backward", None, c_double_p, c_double, c_double_p, c_int_p, c_size_t, c_size_t)
_sig("Attention_cache_size", c_size_t, c_size_t, c_size_t, c_size_t, c_size_t)
_sig("Attention_work_size", c_size_t, c_size_t, c_size_t)
_sig("Attention_probabilities", c_double_p, c_double_p, c_size_t, c_size_t, c_size_t, c_size_t)


def _rows(x, name):
    """(N, d) of an array normalized over its last axis"""
    d = x.shape[-1]
    return x.size // d, d


def _eps(eps):
    return number(eps, "eps", low=0.0)


# ---------------------------------------------------------------- LayerNorm and RMSNorm

def layernorm_forward(x, gamma, beta=None, eps=EPS_DEFAULT):
    """y, mean, rstd of LayerNorm over the last axis of x; beta None: no shift."""
    x = real(x, "x")
    N, d = _rows(x, "x")
    gamma = real(gamma, "gamma", shape=(d,))
    beta = None if beta is None else real(beta, "beta", shape=(d,))
    y, mean, rstd = np.empty_like(x), np.empty(x.shape[:-1]), np.empty(x.shape[:-1])
    call(lib.LayerNorm_forward, ptr(y), ptr(mean), ptr(rstd), ptr(x), ptr(gamma), ptr(beta), N, d,
         _eps(eps))
    return y, mean, rstd


def _stats(a, name, x):
    """mean or rstd: one value per row, the shape of x without its last axis"""
    return real(a, name, shape=x.shape[:-1])


def _rstd(rstd, x):
    r = _stats(rstd, "rstd", x)
    if np.any(r <= 0):
        raise InputError("rstd: every value must be positive (the rstd a forward pass returned)")
    return r


def layernorm_backward(dy, x, gamma, mean, rstd):
    """dx, dgamma, dbeta of LayerNorm for the upstream gradient dy."""
    x = real(x, "x")
    N, d = _rows(x, "x")
    dy = real(dy, "dy", shape=x.shape)
    gamma = real(gamma, "gamma", shape=(d,))
    mean, rstd = _stats(mean, "mean", x), _rstd(rstd, x)
    dx, dgamma, dbeta = np.zeros_like(x), np.zeros(d), np.zeros(d)
    call(lib.LayerNorm_backward, ptr(dx), ptr(dgamma), ptr(dbeta), ptr(dy), ptr(x), ptr(gamma),
         ptr(mean), ptr(rstd), N, d)
    return dx, dgamma, dbeta


def rmsnorm_forward(x, gamma, eps=EPS_DEFAULT):
    """y, rstd of RMSNorm over the last axis of x."""
    x = real(x, "x")
    N, d = _rows(x, "x")
    gamma = real(gamma, "gamma", shape=(d,))
    y, rstd = np.empty_like(x), np.empty(x.shape[:-1])
    call(lib.RMSNorm_forward, ptr(y), ptr(rstd), ptr(x), ptr(gamma), N, d, _eps(eps))
    return y, rstd


def rmsnorm_backward(dy, x, gamma, rstd):
    """dx, dgamma of RMSNorm for the upstream gradient dy."""
    x = real(x, "x")
    N, d = _rows(x, "x")
    dy = real(dy, "dy", shape=x.shape)
    gamma = real(gamma, "gamma", shape=(d,))
    rstd = _rstd(rstd, x)
    dx, dgamma = np.zeros_like(x), np.zeros(d)
    call(lib.RMSNorm_backward, ptr(dx), ptr(dgamma), ptr(dy), ptr(x), ptr(gamma), ptr(rstd), N, d)
    return dx, dgamma


# ---------------------------------------------------------------- attention with QK-/QKV-Norm

class _AttentionNorms(ctypes.Structure):
    _fields_ = [("kind", c_int), ("eps", c_double)] + \
        [(f"{w}_{p}", c_double_p) for p in "qkv" for w in ("gamma", "beta")]


class _AttentionNormGrads(ctypes.Structure):
    _fields_ = [(f"{w}_{p}", c_double_p) for p in "qkv" for w in ("gamma", "beta")]


_sig("Attention_forward", c_int, c_double_p, c_double_p, c_double_p, POINTER(_AttentionNorms),
     c_size_t, c_size_t, c_size_t, c_size_t)
_sig("Attention_backward", c_int, c_double_p, POINTER(_AttentionNormGrads), c_double_p, c_double_p,
     c_double_p, c_double_p, POINTER(_AttentionNorms), c_size_t, c_size_t, c_size_t, c_size_t)


class AttentionCache:
    """What attention_forward keeps for attention_backward: the cache of the C function, the
    inputs it was computed from, and the probabilities [B, h, T, T] (``probs``)."""

    def __init__(self, cache, qkv, n_head, norm, eps, weights, struct):
        self.cache, self.qkv, self.n_head = cache, qkv, n_head
        self.norm, self.eps, self.weights, self._struct = norm, eps, weights, struct
        B, T, d3 = qkv.shape
        p = lib.Attention_probabilities(ptr(cache), B, T, d3 // 3, n_head)
        h = n_head
        self.probs = np.ctypeslib.as_array(p, shape=(B, h, T, T)).copy()


def attention_forward(qkv, n_head, norm=None, eps=EPS_DEFAULT, gamma_q=None, beta_q=None,
                      gamma_k=None, beta_k=None, gamma_v=None, beta_v=None):
    """Causal softmax attention of qkv [B, T, 3d] with n_head heads, scaled by 1/sqrt(d_k);
    with norm ('layernorm' or 'rmsnorm') the heads of q, k (QK-Norm) and v (QKV-Norm) whose
    gamma is given are normalized first (gamma, beta [d_k], shared by the heads).  Returns
    (out [B, T, d], cache)."""
    qkv = real(qkv, "qkv", ndim=3)
    B, T, d3 = qkv.shape
    if d3 % 3:
        raise InputError(f"qkv: last axis {d3} is not 3d")
    d = d3 // 3
    h = number(n_head, "n_head", low=1, integer=True)
    if d % h:
        raise InputError(f"n_head: d = {d} is not divisible by n_head = {h}")
    dk = d // h
    weights = {"gamma_q": gamma_q, "beta_q": beta_q, "gamma_k": gamma_k, "beta_k": beta_k,
               "gamma_v": gamma_v, "beta_v": beta_v}
    given = {k: v for k, v in weights.items() if v is not None}
    struct = None
    if norm is None:
        if given:
            raise InputError(f"{sorted(given)[0]}: given, but norm is None (say 'layernorm' or "
                             "'rmsnorm')")
    else:
        if norm not in NORMS:
            raise InputError(f"norm: '{norm}' is neither 'layernorm' nor 'rmsnorm'")
        for p in "qkv":
            if weights["beta_" + p] is not None and weights["gamma_" + p] is None:
                raise InputError(f"beta_{p}: a shift without a scale (gamma_{p} is None)")
            if norm == "rmsnorm" and weights["beta_" + p] is not None:
                raise InputError(f"beta_{p}: RMSNorm has no shift")
        given = {k: real(v, k, shape=(dk,)) for k, v in given.items()}
        struct = _AttentionNorms(NORMS.index(norm), _eps(eps),
                                 *[ptr(given.get(f"{w}_{p}")) for p in "qkv"
                                   for w in ("gamma", "beta")])
    out = np.empty((B, T, d))
    cache = np.zeros(lib.Attention_cache_size(B, T, d, h))
    call(lib.Attention_forward, ptr(out), ptr(cache), ptr(qkv),
         None if struct is None else ctypes.byref(struct), B, T, d, h)
    return out, AttentionCache(cache, qkv, h, norm, eps, given, struct)


def attention_backward(dout, cache):
    """dqkv [B, T, 3d] and the gradients of the per-head norms' weights given to
    attention_forward (a dict: dgamma_q, dbeta_q, ...), for the upstream gradient dout."""
    if not isinstance(cache, AttentionCache):
        raise InputError("cache: expected the AttentionCache that attention_forward returned")
    qkv = cache.qkv
    B, T, d3 = qkv.shape
    d, h = d3 // 3, cache.n_head
    dout = real(dout, "dout", shape=(B, T, d))
    dqkv = np.zeros_like(qkv)
    work = np.zeros(max(1, lib.Attention_work_size(T, d)))
    grads = {"d" + k: np.zeros(v.shape) for k, v in cache.weights.items()}
    gstruct = _AttentionNormGrads(*[ptr(grads.get(f"d{w}_{p}")) for p in "qkv"
                                    for w in ("gamma", "beta")])
    call(lib.Attention_backward, ptr(dqkv), ctypes.byref(gstruct), ptr(work), ptr(dout),
         ptr(cache.cache), ptr(qkv),
         None if cache._struct is None else ctypes.byref(cache._struct), B, T, d, h)
    return dqkv, grads


# ---------------------------------------------------------------- GeoNorm

def geonorm_forward(x, u, a):
    """x' = exp_x(a P_x u), row by row over the last axis (the sphere of each row of x)."""
    x = real(x, "x")
    N, d = _rows(x, "x")
    u = real(u, "u", shape=x.shape)
    y = np.empty_like(x)
    call(lib.GeoNorm_forward, ptr(y), ptr(x), ptr(u), number(a, "a"), N, d)
    return y


def geonorm_backward(dy, x, u, a):
    """dx, du, da of GeoNorm for the upstream gradient dy."""
    x = real(x, "x")
    N, d = _rows(x, "x")
    u = real(u, "u", shape=x.shape)
    dy = real(dy, "dy", shape=x.shape)
    dx, du, da = np.zeros_like(x), np.zeros_like(x), np.zeros(1)
    call(lib.GeoNorm_backward, ptr(dx), ptr(du), ptr(da), ptr(dy), ptr(x), ptr(u), number(a, "a"),
         N, d)
    return dx, du, float(da[0])


def geonorm_step_size(schedule, base, k, n_layer):
    """The step a of block k (1-based) of n_layer under a schedule: 'constant' (base),
    'harmonic' (base/k), 'sqrt' (base/sqrt k), 'linear' (base (L-k+1)/L)."""
    if schedule not in SCHEDULES:
        raise InputError(f"schedule: '{schedule}' is not one of {', '.join(SCHEDULES)}")
    n_layer = number(n_layer, "n_layer", low=1, integer=True)
    k = number(k, "k", low=1, high=n_layer, integer=True)
    return lib.GeoNorm_step_size(SCHEDULES.index(schedule), number(base, "base"), k, n_layer)


# ---------------------------------------------------------------- GELU and cross-entropy

def gelu_forward(x):
    """GELU, tanh approximation, element-wise."""
    x = real(x, "x")
    y = np.empty_like(x)
    lib.Gelu_forward(ptr(y), ptr(x), x.size)
    return y


def gelu_backward(dy, x):
    """dx = gelu'(x) dy."""
    x = real(x, "x")
    dy = real(dy, "dy", shape=x.shape)
    dx = np.zeros_like(x)
    lib.Gelu_backward(ptr(dx), ptr(dy), ptr(x), x.size)
    return dx


def cross_entropy_forward(logits, targets):
    """loss (the mean over rows), probs [N, V] of logits [N, V] and integer targets [N]."""
    z = real(logits, "logits", ndim=2)
    N, V = z.shape
    t = integers(targets, "targets", shape=(N,), high=V)
    loss, probs = c_double(), np.empty_like(z)
    call(lib.CrossEntropy_forward, ctypes.byref(loss), ptr(probs), ptr(z), iptr(t), N, V)
    return loss.value, probs


def cross_entropy_backward(probs, targets, dloss=1.0):
    """dlogits = dloss (probs - onehot(targets)) / N."""
    p = real(probs, "probs", ndim=2)
    N, V = p.shape
    t = integers(targets, "targets", shape=(N,), high=V)
    dz = np.zeros_like(p)
    lib.CrossEntropy_backward(ptr(dz), number(dloss, "dloss"), ptr(p), iptr(t), N, V)
    return dz


# ---------------------------------------------------------------- AdamW

class _AdamWConfig(ctypes.Structure):
    _fields_ = [("beta1", c_double), ("beta2", c_double), ("eps", c_double),
                ("weight_decay", c_double)]


class _AdamWState(ctypes.Structure):
    _fields_ = [("n", c_size_t), ("m", c_double_p), ("v", c_double_p), ("t", c_long)]


_sig("AdamW_new", c_void_p, c_size_t, POINTER(_AdamWConfig))
_sig("AdamW_free", None, POINTER(c_void_p))
_sig("AdamW_restore", c_int, c_void_p, c_double_p, c_double_p, c_long)
_sig("AdamW_step", c_int, c_void_p, c_double_p, c_double_p, POINTER(ctypes.c_ubyte), c_double)
_sig("AdamW_state", _AdamWState, c_void_p)


def adamw_step(params, grads, lr, m=None, v=None, t=0, beta1=0.9, beta2=0.95, eps=1e-8,
               weight_decay=0.1, decay_mask=None):
    """One AdamW update: (params_out, m_out, v_out, t + 1) from the parameters, their
    gradients, the moments m, v after t steps (None: zero, t = 0) and a decay mask (nonzero:
    the parameter decays; None: every one does).  The arrays are flat views of any shape."""
    p = real(params, "params")
    n = p.size
    g = real(grads, "grads", shape=p.shape)
    m = np.zeros(p.shape) if m is None else real(m, "m", shape=p.shape)
    v = np.zeros(p.shape) if v is None else real(v, "v", shape=p.shape)
    t = number(t, "t", low=0, integer=True)
    mask = None
    if decay_mask is not None:
        mk = np.asarray(_to_mask(decay_mask))
        if mk.shape != p.shape:
            raise InputError(f"decay_mask: shape {list(mk.shape)}, expected {list(p.shape)}")
        mask = np.ascontiguousarray(mk != 0, dtype=np.uint8)
    cfg = _AdamWConfig(number(beta1, "beta1"), number(beta2, "beta2"), number(eps, "eps"),
                       number(weight_decay, "weight_decay"))
    opt = c_void_p(lib.AdamW_new(n, ctypes.byref(cfg)))
    if not opt.value:
        from ._lib import raise_last
        raise_last()
    try:
        call(lib.AdamW_restore, opt, ptr(m), ptr(v), t)
        out = p.copy()
        call(lib.AdamW_step, opt, ptr(out), ptr(g),
             None if mask is None else mask.ctypes.data_as(POINTER(ctypes.c_ubyte)),
             number(lr, "lr", low=0.0))
        st = lib.AdamW_state(opt)
        m_out = np.ctypeslib.as_array(st.m, shape=(n,)).reshape(p.shape).copy()
        v_out = np.ctypeslib.as_array(st.v, shape=(n,)).reshape(p.shape).copy()
        return out, m_out, v_out, int(st.t)
    finally:
        lib.AdamW_free(ctypes.byref(opt))


def _to_mask(x):
    from ._lib import to_numpy
    a = to_numpy(x, "decay_mask")
    if a.dtype.kind not in "biuf":
        raise InputError(f"decay_mask: dtype {a.dtype} is not boolean or numeric")
    return a
