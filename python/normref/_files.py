"""Files that never touch a disk: safetensors bytes made in Python and handed to the C library
through an anonymous in-memory file (memfd), whose name /proc/self/fd/N the library opens as
it opens any path."""
import json
import os
import struct

import numpy as np

from ._lib import InputError, to_numpy

# dtype of the safetensors file for each NumPy kind of float
_ST = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}


def _tensor_bytes(name, x):
    """(dtype, shape, little-endian bytes) of one tensor, keeping the implementation's own
    format: float64, float32, float16, and PyTorch's bfloat16 as BF16 bit for bit."""
    if type(x).__module__.split(".")[0] == "torch":
        import torch
        t = x.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return "BF16", list(t.shape), t.view(torch.int16).numpy().astype("<i2").tobytes()
        x = t
    if isinstance(x, (int, float)):
        x = np.float64(x)
    a = to_numpy(x, name)
    if a.dtype not in _ST:
        raise InputError(f"{name}: dtype {a.dtype} cannot be checked (float64, float32, float16 "
                         "or bfloat16)")
    return _ST[a.dtype], list(a.shape), np.ascontiguousarray(a).astype(
        a.dtype.newbyteorder("<"), copy=False).tobytes()


def safetensors_bytes(tensors, metadata=None):
    """The bytes of a safetensors file holding tensors (name -> array), in the order given."""
    header, blobs, at = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, x in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise InputError(f"results: {name!r} is not a tensor name")
        dtype, shape, data = _tensor_bytes(name, x)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


class MemFile:
    """An anonymous file holding data; ``path`` names it for open(2) while the object lives."""

    def __init__(self, data=b"", name="normref"):
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.path = f"/proc/self/fd/{self.fd}"

    def read(self):
        os.lseek(self.fd, 0, os.SEEK_SET)
        chunks = []
        while True:
            b = os.read(self.fd, 1 << 20)
            if not b:
                return b"".join(chunks)
            chunks.append(b)

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
