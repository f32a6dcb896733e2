"""Assertions for a test suite: an op held against the test vectors, or a model's results
against the reference, failing with the first failing vector or tensor and its tolerance."""
from . import vectors as _vectors
from .model import check as _check


def _fields(row):
    """a failing tensor's numbers, as many of the report's fields as it has (the report's
    JSON may gain fields; none is assumed but the name)"""
    names = (("max_abs_error", "max abs error"), ("rel_error", "relative"), ("skew", "skew"),
             ("tolerance", "tolerance"), ("ratio", "ratio"))
    parts = [f"{label} {row[k]:.3g}" for k, label in names if isinstance(row.get(k), (int, float))]
    return ", ".join(parts) or ", ".join(f"{k} {v}" for k, v in row.items() if k != "name")


class ReferenceMismatch(AssertionError):
    """An assertion of assert_matches_reference that failed; ``run`` or ``report`` holds the
    whole verdict."""


def assert_matches_reference(fn_or_results, op=None, precision="f32", model=None, batch=None,
                             **options):
    """Fail unless the implementation agrees with the reference.

    assert_matches_reference(fn, op="rmsnorm", precision="bf16"): every test vector of op
    run through fn (vectors.run; options framework=, ids=, vectors= pass on to it).

    assert_matches_reference(results, model=model, batch=(tokens, targets), precision="f32"):
    a model's results judged by check().

    The message names the first failing vector (its id, what it probes, the worst element
    with its value, the reference's and the tolerance) or the first failing tensor (its
    error, tolerance and ratio), then the whole table."""
    __tracebackhide__ = True     # pytest shows the caller's line, not this function's
    if callable(fn_or_results):
        if op is None:
            raise TypeError("assert_matches_reference(fn, op=...): say which op fn computes")
        run = _vectors.run(fn_or_results, op=op, precision=precision, **options)
        if not run.passed:
            f = run.first_failure
            err = ReferenceMismatch(
                f"{getattr(fn_or_results, '__name__', 'the function')} does not match the "
                f"reference on vector {f.id} ({f.comment}) at {precision}: "
                + (f"{f.where}, {f.ratio:.3g} times the tolerance" if f.where else f.message)
                + f"\n{len(run.failures)} of {len(run)} vectors fail:\n{run!r}")
            err.run = run
            raise err
        return run
    if model is None or batch is None:
        raise TypeError("assert_matches_reference(results, model=..., batch=..., precision=...)")
    report = _check(fn_or_results, model, batch, precision, **options)
    if not report.passed:
        name = report.first_failure
        row = report[name]
        what = row.get("problem") or _fields(row)
        kind = "identity of the gradient" if "skew" in row else "tensor"
        err = ReferenceMismatch(f"the results do not match the reference at {precision}: first "
                                f"failing {kind} {name}: {what}\n{report!r}")
        err.report = report
        raise err
    return report
