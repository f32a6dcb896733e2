"""normref from Python: the float64 reference of Transformer normalization, its checker of
another implementation's results, and its test vectors run through a user's own functions.

    import normref
    y, mean, rstd = normref.layernorm_forward(x, gamma, beta)
    report = normref.check(results, model, (tokens, targets), precision="bf16")
    verdicts = normref.vectors.run(my_rmsnorm, op="rmsnorm", precision="f32")

The package is a thin layer of ctypes over the installed C library libnormref.so.0, which
stays the one implementation.
"""
from ._lib import Error, InputError, LIBRARY_PATH
from .ops import (layernorm_forward, layernorm_backward, rmsnorm_forward, rmsnorm_backward,
                  attention_forward, attention_backward, AttentionCache, geonorm_forward,
                  geonorm_backward, geonorm_step_size, gelu_forward, gelu_backward,
                  cross_entropy_forward, cross_entropy_backward, adamw_step, SCHEDULES,
                  EPS_DEFAULT)

__version__ = "0.1.0"
from .model import Model, Report, check, byte_batch, hf_results, PLACEMENTS, PRECISIONS
from . import vectors
from .testing import assert_matches_reference, ReferenceMismatch
