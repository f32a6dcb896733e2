"""The model (load, convert, run) and check(): another implementation's results judged as
``normref check`` judges them."""
import ctypes
import json
import os
import shutil
import tempfile
from ctypes import c_char, c_char_p, c_double, c_int, c_size_t, c_void_p, POINTER

import numpy as np

from ._lib import lib, call, raise_last, free, real, integers, number, ptr, iptr, to_numpy, \
    InputError, Error, _sig, c_double_p, c_int_p
from ._files import MemFile, safetensors_bytes

PLACEMENTS = ("none", "post", "pre", "peri", "sandwich", "deepnorm", "mixln", "hybrid",
              "hybrid_star", "geonorm", "ngpt")
PRECISIONS = ("f64", "f32", "bf16", "f16")


class _ModelConfig(ctypes.Structure):
    """ModelConfig of model.h (a public structure: a change to it changes the library's
    version, section Versions of the chapter on the library)."""
    _fields_ = [("placement", c_int), ("norm", c_int), ("n_layer", c_size_t),
                ("n_embd", c_size_t), ("n_head", c_size_t), ("vocab_size", c_size_t),
                ("block_size", c_size_t), ("dt", c_double), ("eps", c_double),
                ("qk_norm", c_int), ("qkv_norm", c_int), ("emb_norm", c_int),
                ("geo_schedule", c_int), ("geo_alpha_attn", c_double),
                ("geo_alpha_mlp", c_double), ("ngpt_alpha", c_double)]


class _ModelTensor(ctypes.Structure):
    _fields_ = [("name", c_char * 48), ("ndim", c_size_t), ("shape", c_size_t * 2),
                ("n", c_size_t), ("offset", c_size_t), ("value", c_double_p),
                ("grad", c_double_p)]


_sig("Model_load", c_int, c_char_p, POINTER(c_void_p))
_sig("Model_save", c_int, c_void_p, c_char_p, c_int)
_sig("Model_new", c_void_p, POINTER(_ModelConfig), ctypes.c_ulong)
_sig("Model_free", None, POINTER(c_void_p))
_sig("Model_config", POINTER(_ModelConfig), c_void_p)
_sig("ModelConfig_to_json", c_void_p, POINTER(_ModelConfig))
_sig("ModelConfig_from_json", c_int, c_char_p, c_char_p, POINTER(_ModelConfig))
_sig("Model_n_params", c_size_t, c_void_p)
_sig("Model_params", c_double_p, c_void_p)
_sig("Model_grads", c_double_p, c_void_p)
_sig("Model_zero_grad", None, c_void_p)
_sig("Model_n_tensors", c_size_t, c_void_p)
_sig("Model_tensor", POINTER(_ModelTensor), c_void_p, c_size_t)
_sig("Model_forward", c_int, c_void_p, c_double_p, c_int_p, c_int_p, c_size_t, c_size_t)
_sig("Model_backward", c_int, c_void_p, c_double)
_sig("Model_logits", c_double_p, c_void_p)
_sig("Model_stream", c_double_p, c_void_p, c_size_t)
_sig("Model_branch", c_double_p, c_void_p, c_size_t)
_sig("Hf_read", c_int, c_char_p, c_char_p, c_size_t, POINTER(c_void_p), POINTER(c_int))
_sig("ByteBatch_read", c_int, c_char_p, c_size_t, c_size_t, c_size_t, c_int_p, c_int_p)
_sig("SafeTensors_read", c_int, c_char_p, POINTER(c_void_p))
_sig("SafeTensors_free", None, POINTER(c_void_p))
_sig("Precision_parse", c_int, c_char_p, POINTER(c_int))
_sig("CheckReference_new", c_int, c_void_p, c_int_p, c_int_p, c_size_t, c_size_t, POINTER(c_void_p))
_sig("CheckReference_free", None, POINTER(c_void_p))
_sig("Check_compare", c_int, c_void_p, c_void_p, c_int, POINTER(c_void_p))
_sig("Check_misfits", c_int, c_void_p, c_size_t, c_size_t, c_void_p, c_int, POINTER(c_void_p))
_sig("CheckReport_record_inputs", None, c_void_p, c_void_p, ctypes.c_char_p, ctypes.c_char_p,
     c_int_p, c_int_p, c_size_t, c_size_t)
_sig("ModelFile_digest", c_int, ctypes.c_char_p, ctypes.c_char_p)
_sig("ByteBatch_digest", None, c_int_p, c_int_p, c_size_t, c_size_t, ctypes.c_char_p)
_sig("SafeTensors_metadata", ctypes.c_char_p, c_void_p, ctypes.c_char_p)
_sig("Check_default_runs", c_size_t, c_int)
_sig("CheckReference_calibrate", c_int, c_void_p, c_void_p, c_int_p, c_int_p, c_size_t, c_size_t,
     c_int, c_size_t, ctypes.c_ulong)
_sig("CheckReport_print", None, c_void_p, c_void_p)
_sig("CheckReport_write_json", c_int, c_void_p, c_char_p)
_sig("CheckReport_free", None, POINTER(c_void_p))

_libc = ctypes.CDLL(None)
_libc.open_memstream.restype = c_void_p
_libc.open_memstream.argtypes = [POINTER(c_void_p), POINTER(c_size_t)]
_libc.fclose.argtypes, _libc.fclose.restype = [c_void_p], c_int


def _path(p, name):
    if not isinstance(p, (str, bytes, os.PathLike)):
        raise InputError(f"{name}: {type(p).__name__} is not a path")
    return os.fsencode(p)


class Model:
    """A normref model in float64: its configuration, parameters, and the forward and backward
    passes of the C library on a batch of tokens."""

    def __init__(self, handle):
        self._m = c_void_p(handle)

    def __del__(self):
        try:
            if self._m.value:
                lib.Model_free(ctypes.byref(self._m))
        except (AttributeError, TypeError):   # a failed constructor, or the interpreter's exit
            pass

    # -------------------------------------------------------------- making one
    @classmethod
    def load(cls, path):
        """A normref model file (safetensors with the configuration in its metadata)."""
        m = c_void_p()
        call(lib.Model_load, _path(path, "path"), ctypes.byref(m))
        return cls(m.value)

    @classmethod
    def new(cls, config=None, seed=0, **fields):
        """A model initialised from seed by the specification; the configuration as the JSON
        object of a model file (``config`` of a model's ``.config``, or keyword fields
        placement=, norm=, n_layer=, n_embd=, n_head=, vocab_size=, block_size=, ...)."""
        cfg = dict(config or {})
        cfg.update(fields)
        c = _ModelConfig()
        call(lib.ModelConfig_from_json, json.dumps(cfg).encode(), b"config", ctypes.byref(c))
        h = lib.Model_new(ctypes.byref(c), number(seed, "seed", low=0, integer=True))
        if not h:
            raise_last()
        return cls(h)

    @classmethod
    def from_hf(cls, state_dict, config=None, n_head=None):
        """A Pre-LN GPT-2 from a Hugging Face GPT2LMHeadModel's state_dict (tensors of PyTorch
        or arrays, float32 or float64), with its config (a GPT2Config, its to_dict(), or None
        with n_head), converted by the library's converter; no file is written.  The causal-mask
        buffers attn.bias and attn.masked_bias, which older state dicts hold, are left out."""
        if not hasattr(state_dict, "items"):
            raise InputError("state_dict: expected a mapping of names to tensors")
        tensors = {k: v for k, v in state_dict.items()
                   if not k.endswith((".attn.bias", ".attn.masked_bias"))}
        if config is not None and not isinstance(config, dict):
            config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        if config is None and n_head is None:
            raise InputError("config: give the model's config (GPT2Config or its dict) or n_head")
        m, dtype = c_void_p(), c_int()
        with MemFile(safetensors_bytes(tensors), "state_dict") as f, \
                MemFile(json.dumps(config).encode() if config else b"", "config.json") as cf:
            call(lib.Hf_read, f.path.encode(), cf.path.encode() if config else None,
                 0 if n_head is None else number(n_head, "n_head", low=1, integer=True),
                 ctypes.byref(m), ctypes.byref(dtype))
        return cls(m.value)

    def save(self, path, dtype="f64"):
        """Write the model file (atomically), float64 or float32."""
        if dtype not in ("f64", "f32"):
            raise InputError(f"dtype: '{dtype}' is neither 'f64' nor 'f32'")
        call(lib.Model_save, self._m, _path(path, "path"), 0 if dtype == "f64" else 1)

    # -------------------------------------------------------------- what it is
    @property
    def config(self):
        """The configuration as the JSON object of a model file."""
        s = lib.ModelConfig_to_json(lib.Model_config(self._m))
        if not s:
            raise_last()
        try:
            return json.loads(ctypes.string_at(s).decode())
        finally:
            free(s)

    def _tensors(self):
        return [lib.Model_tensor(self._m, i).contents for i in range(lib.Model_n_tensors(self._m))]

    @property
    def names(self):
        """The parameters' names (spec section 7), in the model's order."""
        return [t.name.decode() for t in self._tensors()]

    def _view(self, t, which):
        shape = tuple(t.shape[:t.ndim])
        return np.ctypeslib.as_array(getattr(t, which), shape=(t.n,)).reshape(shape)

    def parameters(self):
        """name -> a copy of the parameter"""
        return {t.name.decode(): self._view(t, "value").copy() for t in self._tensors()}

    def set_parameter(self, name, value):
        """Replace one parameter (same shape; finite)."""
        for t in self._tensors():
            if t.name.decode() == name:
                v = self._view(t, "value")
                v[...] = real(value, name, shape=v.shape)
                return
        raise InputError(f"{name}: the model has no such parameter")

    # -------------------------------------------------------------- running it
    def _batch(self, tokens, targets=None):
        V = self.config["vocab_size"]
        tok = integers(tokens, "tokens", high=V)
        if tok.ndim != 2:
            raise InputError(f"tokens: shape {list(tok.shape)}, expected [B, T]")
        tgt = None if targets is None else integers(targets, "targets", shape=tok.shape, high=V)
        B, T = tok.shape
        if T > self.config["block_size"]:
            raise InputError(f"tokens: T = {T} is longer than the model's block_size "
                             f"{self.config['block_size']}")
        return tok, tgt, B, T

    def forward(self, tokens, targets=None):
        """Run the forward pass on tokens [B, T]; with targets return the mean cross-entropy
        loss, else None.  Afterwards logits(), stream(k) and branch(k) read this pass."""
        tok, tgt, B, T = self._batch(tokens, targets)
        loss = c_double(np.nan)
        call(lib.Model_forward, self._m, ctypes.byref(loss), iptr(tok), iptr(tgt), B, T)
        self._BT = (B, T)
        return loss.value if tgt is not None else None

    def loss(self, tokens, targets):
        return self.forward(tokens, targets)

    def _need_pass(self):
        if not hasattr(self, "_BT"):
            raise InputError("no forward pass has run yet: call forward() first")
        return self._BT

    def logits(self, tokens=None):
        """logits [B, T, V] of tokens (or of the last forward pass when tokens is None)"""
        if tokens is not None:
            self.forward(tokens)
        B, T = self._need_pass()
        V = self.config["vocab_size"]
        return np.ctypeslib.as_array(lib.Model_logits(self._m), shape=(B * T * V,)).reshape(
            B, T, V).copy()

    def traces(self):
        """The last pass's traces as check names them: {'stream.k': [B,T,d] for k <= 2L,
        'branch.k': [B,T,d] for k < 2L}"""
        B, T = self._need_pass()
        c = self.config
        L, d = c["n_layer"], c["n_embd"]
        out = {}
        for k in range(2 * L + 1):
            out[f"stream.{k}"] = np.ctypeslib.as_array(lib.Model_stream(self._m, k),
                                                       shape=(B * T * d,)).reshape(B, T, d).copy()
        for k in range(2 * L):
            out[f"branch.{k}"] = np.ctypeslib.as_array(lib.Model_branch(self._m, k),
                                                       shape=(B * T * d,)).reshape(B, T, d).copy()
        return out

    def gradients(self, tokens, targets):
        """(loss, {name: dloss/dparameter}) of one forward and backward pass."""
        loss = self.forward(tokens, targets)
        lib.Model_zero_grad(self._m)
        call(lib.Model_backward, self._m, 1.0)
        return loss, {t.name.decode(): self._view(t, "grad").copy() for t in self._tensors()}

    def results(self, tokens, targets):
        """Everything check() compares, from this model itself: loss, grad.NAME, logits and
        the traces, named as spec section 8 names them."""
        loss, grads = self.gradients(tokens, targets)
        self.forward(tokens, targets)
        out = {"loss": np.float64(loss), "logits": self.logits()}
        out.update(self.traces())
        out.update({"grad." + k: v for k, v in grads.items()})
        return out


def byte_batch(data, batch, seq, vocab_size=256):
    """(tokens, targets) [B, T] from bytes as normref check --data reads them: row b is bytes
    b(T+1) .. b(T+1)+T."""
    if isinstance(data, str):
        data = data.encode()
    B = number(batch, "batch", low=1, integer=True)
    T = number(seq, "seq", low=1, integer=True)
    tok, tgt = np.empty((B, T), np.int32), np.empty((B, T), np.int32)
    with MemFile(bytes(data), "data") as f:
        call(lib.ByteBatch_read, f.path.encode(), B, T, vocab_size, iptr(tok), iptr(tgt))
    return tok, tgt


class Report:
    """The verdict of check(): ``passed``, ``first_failure`` (the first failing tensor in
    forward order, else the first identity of the gradient that fails, or None), ``table``
    (a dict per tensor, the fields of ``normref check --json``), ``identities`` (a dict per
    identity of the gradient judged: name, verdict, skew, tolerance, ratio), ``summary``,
    ``json`` (the whole report), ``text`` (the table the command prints, which repr
    shows)."""

    def __init__(self, text, report):
        self.text, self.json = text, report
        self.summary = report["summary"]
        self.table = report["tensors"]
        self.identities = report.get("identities", [])
        self.precision = report["precision"]
        self.first_failure = (self.summary.get("first_failure")
                              or self.summary.get("first_identity_failure"))
        self.passed = self.summary.get("verdict") == "pass"

    def __getitem__(self, name):
        """the row of a tensor, or of an identity of the gradient, by its name"""
        for row in self.table + self.identities:
            if row["name"] == name:
                return row
        raise KeyError(name)

    def __bool__(self):
        return self.passed

    def __repr__(self):
        return self.text

    def __str__(self):
        return self.text


def _report_text(rep):
    buf, size = c_void_p(), c_size_t()
    f = _libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not f:
        raise MemoryError("open_memstream failed")
    lib.CheckReport_print(rep, f)
    _libc.fclose(f)
    try:
        return ctypes.string_at(buf, size.value).decode("utf-8", "replace")
    finally:
        free(buf)


def _report_json(rep):
    """CheckReport_write_json writes a file beside its path and renames it over the path, so
    the JSON goes to a private folder in memory (/dev/shm where there is one), read back and
    removed at once."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="normref-check-", dir=base)
    try:
        path = os.path.join(d, "report.json")
        call(lib.CheckReport_write_json, rep, path.encode())
        with open(path) as f:
            return json.load(f)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def check(results, model, batch, precision, runs=None):
    """Judge another implementation's results as ``normref check`` does.

    results: a dict name -> array or tensor (spec section 8: loss, grad.NAME, and optionally
    stream.K, branch.K, logits; float64, float32, float16 or bfloat16, each kept in its own
    format), or the path of a safetensors file; model: a Model or a model file's path; batch:
    (tokens, targets), each [B, T] (byte_batch() reads the command's --data); precision: the
    claim, 'f64', 'f32', 'bf16' or 'f16'; runs: the runs of the emulation of that precision
    that calibrate the tolerances, as the command's --runs (None: the command's default, 16 at
    f32, 64 at bf16 and f16).  Returns a Report."""
    model_path = None
    if not isinstance(model, Model):
        model_path = model
        model = Model.load(model)
    if isinstance(batch, dict):
        batch = (batch.get("tokens"), batch.get("targets"))
    if not isinstance(batch, (tuple, list)) or len(batch) != 2 or batch[1] is None:
        raise InputError("batch: expected (tokens, targets), each [B, T]")
    tok, tgt, B, T = model._batch(batch[0], batch[1])
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise InputError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    p = c_int()
    call(lib.Precision_parse, precision.encode(), ctypes.byref(p))
    res, ref, rep = c_void_p(), c_void_p(), c_void_p()
    try:
        if isinstance(results, (str, bytes, os.PathLike)):
            call(lib.SafeTensors_read, _path(results, "results"), ctypes.byref(res))
        else:
            if not hasattr(results, "items"):
                raise InputError("results: expected a dict of name -> array, or a file's path")
            with MemFile(safetensors_bytes(dict(results), {"precision": precision,
                                                           "batch": f"[{B},{T}]"}),
                         "results") as f:
                call(lib.SafeTensors_read, f.path.encode(), ctypes.byref(res))
        # the inputs the results were computed from, where they say so: another model file or
        # another batch is named, as the command names it (exit 2 there)
        name = os.fspath(model_path) if model_path is not None else "the model"
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        digests = [None, ctypes.create_string_buffer(17)]
        if model_path is not None:
            digests[0] = ctypes.create_string_buffer(17)
            call(lib.ModelFile_digest, _path(model_path, "model"), digests[0])
        lib.ByteBatch_digest(iptr(tok), iptr(tgt), B, T, digests[1])
        for key, mine, what in (("model_fnv1a64", digests[0], "another model file"),
                                ("batch_fnv1a64", digests[1], "another batch")):
            got = lib.SafeTensors_metadata(res, key.encode())
            if got is not None and mine is not None and got != mine.value:
                raise InputError(f"results: computed from {what}: their {key} is "
                                 f"{got.decode()}, this one's is {mine.value.decode()}")
        digests[0] = digests[0].value if digests[0] is not None else None
        if runs is None:
            runs = max(1, lib.Check_default_runs(p.value))
        if not isinstance(runs, int) or isinstance(runs, bool) or not 1 <= runs <= 1024:
            raise InputError(f"runs: {runs!r} is not a whole number in 1..1024")
        # what fails whatever the reference says is reported before it is computed
        call(lib.Check_misfits, model._m, B, T, res, p.value, ctypes.byref(rep))
        if not rep.value:
            call(lib.CheckReference_new, model._m, iptr(tok), iptr(tgt), B, T,
                 ctypes.byref(ref))
            call(lib.CheckReference_calibrate, ref, model._m, iptr(tok), iptr(tgt), B, T,
                 p.value, runs, 1)
            call(lib.Check_compare, ref, res, p.value, ctypes.byref(rep))
        lib.CheckReport_record_inputs(rep, model._m, name.encode(), digests[0], iptr(tok),
                                      iptr(tgt), B, T)
        return Report(_report_text(rep), _report_json(rep))
    finally:
        if rep.value:
            lib.CheckReport_free(ctypes.byref(rep))
        if ref.value:
            lib.CheckReference_free(ctypes.byref(ref))
        if res.value:
            lib.SafeTensors_free(ctypes.byref(res))


def hf_results(model, tokens, targets):
    """Run a Hugging Face GPT2LMHeadModel (PyTorch) forward and backward on tokens and targets
    [B, T] and return its results named as check() wants them: loss (the mean cross-entropy of
    the logits against the targets, as normref defines it; the model's own labels= would
    shift them), logits, stream.2l for the input of every block (the model's hidden states
    but the last, which has the final norm applied), and grad.NAME for every parameter.  The
    gradients are renamed and transposed by the library's own converter: they are read as if
    they were a state dict, so the Python side holds no table of names.  The model's
    gradients are overwritten; it runs in eval mode (no dropout), and is left in the mode it
    was in."""
    import torch
    import torch.nn.functional as F
    tok = torch.as_tensor(np.asarray(to_numpy(tokens, "tokens")), dtype=torch.long)
    tgt = torch.as_tensor(np.asarray(to_numpy(targets, "targets")), dtype=torch.long)
    if tok.ndim != 2 or tgt.shape != tok.shape:
        raise InputError(f"tokens, targets: shapes {list(tok.shape)} and {list(tgt.shape)}, "
                         "expected the same [B, T]")
    model.zero_grad(set_to_none=True)
    training = model.training
    model.eval()                 # no dropout: the reference has none
    try:
        out = model(tok, output_hidden_states=True)
        logits = out.logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1))
        loss.backward()
    finally:
        model.train(training)
    res = {"loss": loss.detach(), "logits": logits.detach()}
    for l, h in enumerate(out.hidden_states[:-1]):
        res[f"stream.{2 * l}"] = h.detach()
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
             for name, p in model.named_parameters()}
    g = Model.from_hf(grads, model.config)
    res.update({"grad." + k: v for k, v in g.parameters().items()})
    return res
