"""The test vectors of ``normref vectors`` run through a user's own function.

    from normref import vectors
    run = vectors.run(my_rmsnorm, op="rmsnorm", precision="bf16")
    assert run.passed, run

Each vector's real inputs are rounded to the precision (the manifest's claim: inputs rounded
to P, arithmetic at float32 or better, outputs stored at P), handed to the function by name,
its outputs (and, for a PyTorch function, the gradients autograd finds) compared element by
element with the reference's within the manifest's tolerance tensors tol.P.NAME.
"""
import ctypes
import hashlib
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from ctypes import c_char_p, c_int, c_size_t, c_void_p, POINTER

import numpy as np

from ._lib import lib, call, _sig, c_double_p, to_numpy, InputError, Error

OPS = ("layernorm", "rmsnorm", "attention", "geonorm", "gelu", "cross_entropy", "adamw")
PRECISIONS = ("f64", "f32", "bf16", "f16")
# the output that an op's function returns when it returns one array
PRIMARY = {"layernorm": "y", "rmsnorm": "y", "geonorm": "y", "gelu": "y", "attention": "out",
           "cross_entropy": "loss", "adamw": "params_out"}
# what a function returning a tuple returns, in order
TUPLES = {"layernorm": ("y", "mean", "rstd"), "rmsnorm": ("y", "rstd"),
          "attention": ("out", "probs"), "cross_entropy": ("loss", "probs"),
          "adamw": ("params_out", "m_out", "v_out"), "geonorm": ("y",), "gelu": ("y",)}
UPSTREAM = ("dy", "dout")     # upstream gradients: inputs of the backward pass only

_sig("SafeTensors_read", c_int, c_char_p, POINTER(c_void_p))
_sig("SafeTensors_free", None, POINTER(c_void_p))
_sig("SafeTensors_count", c_size_t, c_void_p)
_sig("SafeTensors_name", c_char_p, c_void_p, c_size_t)
_sig("SafeTensors_info", c_int, c_void_p, c_char_p, POINTER(c_int), POINTER(c_size_t),
     POINTER(c_size_t))
_sig("SafeTensors_get", c_int, c_void_p, c_char_p, c_size_t, POINTER(c_size_t), c_double_p)


def read_tensors(path):
    """Every tensor of a safetensors file as float64, by name, read by the C library."""
    st = c_void_p()
    call(lib.SafeTensors_read, os.fsencode(path), ctypes.byref(st))
    try:
        out = {}
        for i in range(lib.SafeTensors_count(st)):
            name = lib.SafeTensors_name(st, i)
            dt, nd, shape = c_int(), c_size_t(), (c_size_t * 8)()
            call(lib.SafeTensors_info, st, name, ctypes.byref(dt), ctypes.byref(nd), shape)
            dims = tuple(shape[:nd.value])
            a = np.empty(dims if dims else ())
            call(lib.SafeTensors_get, st, name, nd.value, shape, a.ctypes.data_as(c_double_p))
            out[name.decode()] = a
        return out
    finally:
        lib.SafeTensors_free(ctypes.byref(st))


# ---------------------------------------------------------------- where the vectors are

def _binary():
    env = os.environ.get("NORMREF_BINARY")
    if env:
        return env
    try:
        from . import _build
        p = os.path.join(_build.BINDIR, "normref")
        if os.access(p, os.X_OK):
            return p
    except ImportError:
        pass
    return shutil.which("normref")


def folder():
    """The folder of the vectors: $NORMREF_VECTORS; else the copy make install put in
    $(pkgdatadir)/vectors; else written once by the normref command (NORMREF_BINARY, the
    installed one, or the one on PATH) into $XDG_CACHE_HOME/normref/, under a name made
    from the command's own bytes, so that another build writes its own."""
    env = os.environ.get("NORMREF_VECTORS")
    if env:
        return env
    try:
        from . import _build
        p = os.path.join(_build.PKGDATADIR, "vectors")
        if os.path.isfile(os.path.join(p, "manifest.json")):
            return p
    except ImportError:
        pass
    exe = _binary()
    if exe is None:
        raise InputError("no test vectors: set NORMREF_VECTORS to a folder 'normref vectors "
                         "--out DIR' wrote, or put the normref command on PATH")
    with open(exe, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    out = os.path.join(cache, "normref", "vectors-" + digest)
    if not os.path.isfile(os.path.join(out, "manifest.json")):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix="vectors-", dir=os.path.dirname(out))
        r = subprocess.run([exe, "vectors", "--out", tmp, "--force"], capture_output=True,
                           text=True)
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise Error(4, f"{exe} vectors failed: {r.stderr.strip()}")
        try:
            os.rename(tmp, out)
        except OSError:           # another process wrote it first
            shutil.rmtree(tmp, ignore_errors=True)
    return out


_manifests = {}


def manifest(where=None):
    where = where or folder()
    if where not in _manifests:
        path = os.path.join(where, "manifest.json")
        try:
            with open(path) as f:
                m = json.load(f)
        except (OSError, ValueError) as e:
            raise InputError(f"cannot read {path}: {e}")
        if m.get("format") != "normref-vectors":
            raise InputError(f"{path}: not a manifest of normref's vectors")
        _manifests[where] = m
    return _manifests[where]


# ---------------------------------------------------------------- rounding to a precision



def _round(a, prec):
    """The values of a rounded to prec, as the NumPy array a function of that precision
    receives: float64, float32, and float32 holding bfloat16 or float16 values."""
    if prec == "f64":
        return np.array(a, dtype=np.float64)
    if prec == "f32":
        return np.array(a, dtype=np.float32)
    if prec == "f16":
        with np.errstate(over="ignore"):
            return np.array(a, dtype=np.float16).astype(np.float32)
    # bf16: from float64 directly, not through float32 (two roundings can differ from one)
    return _bf16_from_f64(np.asarray(a, dtype=np.float64))


def _bf16_from_f64(a):
    """round-to-nearest-even of float64 to bfloat16 (8 significand bits), held in float32"""
    with np.errstate(all="ignore"):
        m, e = np.frexp(a)                      # a = m 2^e, 0.5 <= |m| < 1
        r = np.ldexp(np.rint(np.ldexp(m, 8)), e - 8)   # 8 bits of significand, ties to even
        small = np.abs(a) < 2.0 ** -126         # subnormal bfloat16: a fixed spacing 2^-133
        r = np.where(small, np.rint(a * 2.0 ** 133) * 2.0 ** -133, r)
        big = np.abs(r) > float.fromhex("0x1.FEp127")
        r = np.where(big, np.copysign(np.inf, a), r)
        r = np.where(np.isfinite(a), r, a)
    return r.astype(np.float32)


_TORCH_DTYPES = {"f64": "float64", "f32": "float32", "bf16": "bfloat16", "f16": "float16"}


# ---------------------------------------------------------------- one vector

class VectorResult:
    """One vector at one precision: ``id``, ``comment``, ``verdict`` ('pass', 'fail',
    'skip'), ``ratio`` (worst |error| / tolerance), ``where`` (the worst element, its value,
    the reference's and the tolerance), ``message``."""

    def __init__(self, vid, comment, precision, verdict, ratio=0.0, where="", message=""):
        self.id, self.comment, self.precision = vid, comment, precision
        self.verdict, self.ratio, self.where, self.message = verdict, ratio, where, message

    @property
    def passed(self):
        return self.verdict != "fail"

    def line(self):
        s = f"{self.verdict.upper():4s} {self.id:16s} {self.precision:4s}"
        if self.verdict != "skip":
            s += f" worst {self.ratio:.3g}"
        if self.where:
            s += f" at {self.where}"
        if self.message:
            s += f" ({self.message})"
        if self.verdict == "fail":
            s += f"  [{self.comment}]"
        return s

    def __repr__(self):
        return self.line()


class VectorRun(list):
    """The verdicts of vectors.run: a list of VectorResult, ``passed``, ``failures``,
    ``first_failure``; repr prints a line per vector."""

    def __init__(self, op, precision, results):
        super().__init__(results)
        self.op, self.precision = op, precision

    @property
    def failures(self):
        return [r for r in self if r.verdict == "fail"]

    @property
    def passed(self):
        return not self.failures

    @property
    def first_failure(self):
        f = self.failures
        return f[0] if f else None

    def __repr__(self):
        n = {v: sum(r.verdict == v for r in self) for v in ("pass", "fail", "skip")}
        return "\n".join([r.line() for r in self] +
                         [f"{self.op} at {self.precision}: {n['pass']} pass, {n['fail']} fail, "
                          f"{n['skip']} skipped"])

    __str__ = __repr__


def _framework(framework):
    if framework == "auto":
        return "torch" if "torch" in sys.modules else "numpy"
    if framework not in ("torch", "numpy"):
        raise InputError(f"framework: '{framework}' is not 'auto', 'torch' or 'numpy'")
    return framework


def _param(v):
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _accepts(fn):
    """the keyword names fn takes, or None when it takes any (**kwargs)"""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    names = []
    for p in sig.parameters.values():
        if p.kind == p.VAR_KEYWORD:
            return None
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            names.append(p.name)
    return names


def _outputs(op, got):
    """the function's return value as {output name: value}"""
    if isinstance(got, dict):
        return dict(got)
    if isinstance(got, (tuple, list)):
        names = TUPLES[op]
        if len(got) > len(names):
            raise InputError(f"the function returned {len(got)} values; a tuple for {op} is "
                             f"({', '.join(names)}) or a prefix of it; return a dict for others")
        return dict(zip(names, got))
    return {PRIMARY[op]: got}


def _call_numpy(fn, op, params, inp, test, prec):
    kw = {k: _param(v) for k, v in params.items()}
    for name, spec in test["inputs"].items():
        kw[name] = _round(inp[name], prec) if spec["kind"] == "real" else \
            inp[name].astype(np.int64)
    return _outputs(op, _invoke(fn, kw))


def _invoke(fn, kw):
    names = _accepts(fn)
    if names is not None:
        kw = {k: v for k, v in kw.items() if k in names}
    return fn(**kw)


def _call_torch(fn, op, params, inp, test, prec):
    import torch
    dt = getattr(torch, _TORCH_DTYPES[prec])
    kw = {k: _param(v) for k, v in params.items()}
    leaves = {}
    wanted = {o[1:] for o in test["outputs"] if o.startswith("d")}
    for name, spec in test["inputs"].items():
        if spec["kind"] != "real":
            kw[name] = torch.tensor(inp[name].astype(np.int64))
            continue
        # rounded once by _round (PyTorch 1.13 rounds float64 to bfloat16 through float32);
        # the values are then exact in dt
        t = torch.tensor(_round(inp[name], prec)).to(dt)
        if name in wanted and name not in UPSTREAM and op != "adamw":
            t.requires_grad_(True)
            leaves[name] = t
        kw[name] = t
    upstream = {k: kw.pop(k) for k in UPSTREAM if k in kw}
    out = _outputs(op, _invoke(fn, kw))
    primary = out.get(PRIMARY[op])
    if leaves and isinstance(primary, torch.Tensor) and primary.requires_grad:
        up = next(iter(upstream.values()), None)
        primary.backward(torch.ones_like(primary) if up is None else up.to(primary.dtype))
        for name, t in leaves.items():
            if t.grad is not None and "d" + name not in out:
                out["d" + name] = t.grad
    return out


def _judge(test, tensors, prec, got):
    """(worst ratio, where, number of outputs judged)"""
    worst, where, judged = 0.0, "", 0
    tol = test["precisions"][prec].get("tolerance", {})
    for name, g in got.items():
        entry = tol.get(name)
        if entry is None or name not in tensors:
            continue
        want, bound = tensors[name], tensors[entry["tensor"]]
        g = to_numpy(g, name).astype(np.float64)
        if g.size != want.size:
            return math.inf, f"{name}: {g.size} values, expected shape {list(want.shape)}", 1
        g = g.reshape(want.shape)
        judged += 1
        with np.errstate(all="ignore"):
            err = np.abs(g - want)
            r = np.where(bound > 0, err / bound, np.where(err == 0, 0.0, np.inf))
        r = np.where(np.isnan(err), np.inf, r)
        i = int(np.argmax(r)) if r.size else 0
        if r.size and (r.flat[i] > worst or not where):
            worst = float(r.flat[i])
            idx = list(np.unravel_index(i, want.shape)) if want.ndim else []
            where = (f"{name}{idx}: got {g.flat[i]:.9g}, want {want.flat[i]:.9g}, "
                     f"tolerance {bound.flat[i]:.3g}")
    return worst, where, judged


def _one(fn, op, test, where, prec, mode):
    spec = test["precisions"][prec]
    verdict = spec["result"]
    res = lambda v, ratio=0.0, at="", msg="": VectorResult(test["id"], test["comment"], prec, v,
                                                           ratio, at, msg)
    if verdict == "not representable":
        return res("skip", msg=f"not representable in {prec}")
    tensors = read_tensors(os.path.join(where, test["file"]))
    inp = {k: tensors[k] for k in test["inputs"]}
    caller = _call_torch if mode == "torch" else _call_numpy
    err = None
    try:
        with np.errstate(all="ignore"):
            got = caller(fn, op, test["params"], inp, test, prec)
    except InputError:
        raise
    except Exception as e:         # the function refused the input, or failed
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if mode == "torch" and "not implemented for" in text:
            return res("skip", msg=f"not runnable: {text}")
        err = f"{type(e).__name__}: {text}"
    if verdict == "invalid":
        if err is not None:
            return res("pass", msg=f"refused: {err}")
        return res("fail", math.inf, msg="expected a refusal (the reference: "
                   + test.get("error", "") + "); the function returned values")
    if err is not None:
        if verdict == "acceptable":
            return res("pass", msg=f"error, acceptable here: {err}")
        return res("fail", math.inf, msg=f"error: {err}")
    ratio, at, judged = _judge(test, tensors, prec, got)
    if judged == 0:
        return res("fail", math.inf, msg="the function returned no output this vector judges "
                   f"(it returned {sorted(got)}; the vector has {sorted(test['outputs'])})")
    if ratio <= 1:
        return res("pass", ratio, at)
    finite = all(np.all(np.isfinite(to_numpy(v, k).astype(np.float64))) for k, v in got.items())
    if verdict == "acceptable" and not finite:
        return res("pass", ratio, at, "non-finite outputs, acceptable here: " + spec.get("note", ""))
    return res("fail", ratio, at)


def run(fn, op, precision="f32", framework="auto", ids=None, vectors=None):
    """Run every vector of op through fn at precision; returns a VectorRun.

    fn is called with keyword arguments: the vector's inputs by their manifest names (x,
    gamma, beta; qkv, gamma_q, ...; x, u, a; logits, targets; params, grads, m, v,
    decay_mask) and its parameters (eps, n_head, norm, lr, ...), each only if fn's signature
    names it (or takes **kwargs).  It returns the op's main output (y, out, loss,
    params_out), a tuple (see TUPLES), or a dict of outputs by name, which may include
    gradients (dx, dgamma, ...; a NumPy function then names dy or dout to receive the
    upstream gradient).  framework 'torch' (the default when PyTorch is imported) passes
    tensors of the precision's dtype and takes the gradients from autograd; 'numpy' passes
    arrays (float64, float32; bf16 and f16 values in float32).  ids: only these vectors.
    An invalid vector passes when fn raises; acceptable ones may raise or return non-finite
    numbers."""
    if op not in OPS:
        raise InputError(f"op: '{op}' is not one of {', '.join(OPS)} (the model vectors are "
                         "checked with normref.check)")
    if precision not in PRECISIONS:
        raise InputError(f"precision: '{precision}' is not one of {', '.join(PRECISIONS)}")
    if not callable(fn):
        raise InputError(f"fn: a {type(fn).__name__} is not callable")
    mode = _framework(framework)
    where = vectors or folder()
    man = manifest(where)
    tests = [t for g in man["groups"] if g["op"] == op for t in g["tests"]]
    if ids is not None:
        ids = [ids] if isinstance(ids, str) else list(ids)
        unknown = sorted(set(ids) - {t["id"] for t in tests})
        if unknown:
            raise InputError(f"ids: no vector {', '.join(unknown)} for op {op}")
        tests = [t for t in tests if t["id"] in ids]
    return VectorRun(op, precision, [_one(fn, op, t, where, precision, mode) for t in tests])
