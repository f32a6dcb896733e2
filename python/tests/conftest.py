"""Shared fixtures of the package's tests.  The driver (tests/test_python.sh) points the
package at the build tree: NORMREF_LIBRARY (src/.libs/libnormref.so.0), NORMREF_BINARY
(src/normref) and NORMREF_VECTORS (vectors it wrote)."""
import os

import numpy as np
import pytest

import normref

TEXT = b"The quick brown fox jumps over the lazy dog; 0123456789.\n"


@pytest.fixture
def tool():
    exe = os.environ.get("NORMREF_BINARY")
    if not exe or not os.access(exe, os.X_OK):
        pytest.skip("NORMREF_BINARY does not name the normref command")
    return exe


@pytest.fixture
def model():
    return normref.Model.new(placement="pre", norm="layernorm", n_layer=2, n_embd=8, n_head=2,
                             vocab_size=256, block_size=8, seed=5)


@pytest.fixture
def batch():
    return normref.byte_batch(TEXT, 2, 8)


def torch_or_skip():
    return pytest.importorskip("torch", reason="PyTorch (python3-torch) is not installed")
