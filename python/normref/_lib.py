"""The C library under the package: loading it, its errors, and arrays on their way in and out.

Every call into libnormref goes through this module.  The library is loaded once; its error
handler is set to the quiet one, so that a failure is a return code and a reason, which
``call`` turns into :class:`Error`.  The C functions assert their preconditions (non-NULL
pointers, sizes that agree); the functions here check those in Python first, so that a wrong
argument is a :class:`InputError` naming it and never an abort of the interpreter.
"""
import ctypes
import ctypes.util
import os
import sys

import numpy as np

c_double_p = ctypes.POINTER(ctypes.c_double)
c_int_p = ctypes.POINTER(ctypes.c_int)


class Error(Exception):
    """An error reported by the C library: ``code`` (its NR_E* number), ``name``, ``reason``."""

    NAMES = {1: "NR_EINVAL", 2: "NR_ENONFINITE", 3: "NR_ENOMEM", 4: "NR_EIO",
             5: "NR_EFORMAT", 6: "NR_EDIVERGED", 7: "NR_ECHECK"}

    def __init__(self, code, reason):
        self.code, self.reason = code, reason
        self.name = self.NAMES.get(code, f"error {code}")
        super().__init__(f"{reason} ({self.name})")


class InputError(ValueError):
    """An argument refused before any C code ran: its name, and what is wrong with it."""


def _library_candidates():
    """Where libnormref.so.0 is looked for, in order."""
    env = os.environ.get("NORMREF_LIBRARY")
    if env:
        return [env]
    out = []
    try:
        from . import _build
        out.append(os.path.join(_build.LIBDIR, "libnormref.so.0"))
    except ImportError:
        pass
    out.append("libnormref.so.0")
    found = ctypes.util.find_library("normref")
    if found:
        out.append(found)
    return out


def _load():
    tried = []
    for path in _library_candidates():
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            tried.append(f"{path}: {e}")
    raise ImportError("normref: cannot load the C library libnormref.so.0 (install normref with "
                      "'make install', or name the file in NORMREF_LIBRARY); tried:\n  "
                      + "\n  ".join(tried))


lib, LIBRARY_PATH = _load()


def _sig(name, restype, *argtypes):
    f = getattr(lib, name)
    f.restype, f.argtypes = restype, list(argtypes)
    return f


_sig("Error_set_handler", ctypes.c_void_p, ctypes.c_void_p)
_sig("Error_last_reason", ctypes.c_char_p)
_sig("Error_last_code", ctypes.c_int)
_sig("Error_clear", None)
lib.Error_set_handler(ctypes.cast(lib.Error_handler_quiet, ctypes.c_void_p))

_libc = ctypes.CDLL(None)
_libc.free.argtypes, _libc.free.restype = [ctypes.c_void_p], None


def free(p):
    _libc.free(p)


def call(f, *args):
    """Call f; a non-zero return raises Error with the library's reason."""
    lib.Error_clear()
    rc = f(*args)
    if rc != 0:
        raise Error(rc, (lib.Error_last_reason() or b"").decode("utf-8", "replace"))
    return rc


def raise_last(default_code=3):
    """Raise the library's last error after a function that returns NULL."""
    code = lib.Error_last_code() or default_code
    raise Error(code, (lib.Error_last_reason() or b"(no reason given)").decode("utf-8", "replace"))


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


def to_numpy(x, name):
    """Any array-like (NumPy, PyTorch, JAX, anything with __array__ or __dlpack__) as a NumPy
    array, without copying where the framework allows it.  A PyTorch bfloat16 tensor, which
    NumPy cannot hold, becomes float32 (every bfloat16 is a float32)."""
    if isinstance(x, np.ndarray):
        return x
    if _is_torch(x):
        import torch
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.numpy()
    if hasattr(x, "__array__") or isinstance(x, (list, tuple, int, float)):
        return np.asarray(x)
    if hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)
    raise InputError(f"{name}: a {type(x).__name__} is not an array (expected a NumPy array, a "
                     "tensor of PyTorch or JAX, or anything with __array__ or __dlpack__)")


def _shape(a, name, shape):
    """Refuse an array a of another shape than shape (None: any length on that axis), or empty."""
    if shape is not None:
        if a.ndim != len(shape) or any(w is not None and w != s for w, s in zip(shape, a.shape)):
            want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
            raise InputError(f"{name}: shape {list(a.shape)}, expected {want}")
    if a.size == 0:
        raise InputError(f"{name}: the array is empty (shape {list(a.shape)})")


def real(x, name, shape=None, ndim=None, finite=True):
    """x as a C-contiguous float64 array for the reference, checked: a real floating type
    (float16, bfloat16, float32 and float64 are widened exactly), the shape (a tuple in which
    None matches any extent), contiguity, finiteness.  A float64 C-contiguous array is passed
    to C as it is, not copied."""
    a = to_numpy(x, name)
    if a.dtype.kind != "f":
        raise InputError(f"{name}: dtype {a.dtype} is not a real floating type (float64, float32, "
                         "float16 or bfloat16)")
    if not a.flags.c_contiguous and a.ndim > 0:
        raise InputError(f"{name}: the array is not contiguous (strides {a.strides} for shape "
                         f"{a.shape}); pass np.ascontiguousarray({name}) or {name}.contiguous()")
    if ndim is not None and a.ndim != ndim:
        raise InputError(f"{name}: {a.ndim} axes (shape {list(a.shape)}), expected {ndim}")
    _shape(a, name, shape)
    a = np.ascontiguousarray(a, dtype=np.float64)
    if finite and not np.all(np.isfinite(a)):
        i = int(np.argmin(np.isfinite(a).ravel()))
        raise InputError(f"{name}: element {i} (index {list(np.unravel_index(i, a.shape))}) is "
                         f"{a.ravel()[i]}, not finite")
    return a


def integers(x, name, shape=None, low=0, high=None):
    """x as a C-contiguous int32 array (tokens, targets): an integer type, in [low, high)."""
    a = to_numpy(x, name)
    if a.dtype.kind not in "iu":
        raise InputError(f"{name}: dtype {a.dtype} is not an integer type")
    if not a.flags.c_contiguous and a.ndim > 0:
        raise InputError(f"{name}: the array is not contiguous (strides {a.strides}); pass "
                         f"np.ascontiguousarray({name})")
    _shape(a, name, shape)
    bad = (a < low) | ((a >= high) if high is not None else False)
    if np.any(bad):
        i = int(np.argmax(bad.ravel()))
        raise InputError(f"{name}: element {i} is {a.ravel()[i]}, outside {low}.."
                         f"{'' if high is None else high - 1}")
    return np.ascontiguousarray(a, dtype=np.int32)


def ptr(a):
    """The data pointer of a float64 array (None for None)."""
    return None if a is None else a.ctypes.data_as(c_double_p)


def iptr(a):
    return None if a is None else a.ctypes.data_as(c_int_p)


def number(x, name, low=None, high=None, integer=False):
    """A Python number from x (a scalar or 0-d array), finite, in [low, high]."""
    try:
        v = float(np.asarray(to_numpy(x, name)).reshape(()))
    except (TypeError, ValueError):
        raise InputError(f"{name}: {x!r} is not a number")
    if not np.isfinite(v):
        raise InputError(f"{name}: {v} is not finite")
    if integer and v != int(v):
        raise InputError(f"{name}: {v} is not an integer")
    if (low is not None and v < low) or (high is not None and v > high):
        raise InputError(f"{name}: {v} is outside [{low}, {high}]")
    return int(v) if integer else v
