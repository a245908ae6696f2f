"""Patch 0011's multi-row kernels in hybrimoe's ggml-cpu, called directly (ctypes) on seeded random blocks.

Oracle: upstream's single-row kernel of the same type on the same bytes, one activation row at a time (the type's
``ggml_vec_dot_*`` for plain Q5_0, Q8_0, Q4_K and Q6_K rows, ``ggml_gemv_q4_K_8x8_q8_K`` with one row for the repacked
Q4_K 8x8 layout): every output bit for bit, for 1 to 19 rows (the kernels take 8 or 4 rows per pass: several passes
and every remainder), and nothing written outside the outputs asked for. Random bytes are valid blocks
of these types apart from their fp16 scales, which are drawn as small finite halves. Skipped where the build has no
multi-row kernels (not x86 with AVX2): the fused op then keeps the single-row kernels.
"""
from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest

from hybrimoe._lib import LIB_DIR, preload_ggml

Q = gguf.GGMLQuantizationType
F = ctypes.POINTER(ctypes.c_float)
VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, F, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                           ctypes.c_size_t, ctypes.c_int)
VEC_DOT_ROWS = ctypes.CFUNCTYPE(None, ctypes.c_int, F, ctypes.c_size_t, ctypes.c_void_p,
                                ctypes.POINTER(ctypes.c_void_p), ctypes.c_int)
GEMV = ctypes.CFUNCTYPE(None, ctypes.c_int, F, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                        ctypes.c_int)
GEMV_ROWS = ctypes.CFUNCTYPE(None, ctypes.c_int, F, ctypes.c_size_t, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                             ctypes.c_int, ctypes.c_int)

# block sizes in bytes (ggml-common.h): block_q5_0 (fp16 d, qh[4], qs[16]), block_q8_0 (fp16 d, qs[32]),
# block_q4_K (fp16 d, dmin, scales[12], qs[128]), block_q6_K (ql[128], qh[64], int8 scales[16], fp16 d),
# block_q8_K (float d, qs[256], int16 bsums[16]), block_q4_Kx8 (fp16 d[8], dmin[8], scales[96], qs[1024])
Q5_0_BYTES, Q8_0_BYTES, Q4_K_BYTES, Q6_K_BYTES, Q8_K_BYTES, Q4_KX8_BYTES = 22, 34, 144, 210, 292, 1152
# plain weight type -> (block bytes, elements per block, byte offsets of its fp16 scales, activation type)
PLAIN = {Q.Q5_0: (Q5_0_BYTES, 32, (0,), "q8_0"), Q.Q8_0: (Q8_0_BYTES, 32, (0,), "q8_0"),
         Q.Q4_K: (Q4_K_BYTES, 256, (0, 2), "q8_K"), Q.Q6_K: (Q6_K_BYTES, 256, (208,), "q8_K")}


@pytest.fixture(scope="module")
def cpu():
    preload_ggml()
    lib = ctypes.CDLL(str(LIB_DIR / "libggml-cpu.so.0"))
    lib.ggml_cpu_vec_dot_rows_of.restype = ctypes.c_void_p
    lib.ggml_cpu_vec_dot_rows_of.argtypes = [ctypes.c_int]
    if not lib.ggml_cpu_vec_dot_rows_of(int(Q.Q8_0)):
        pytest.skip("this build of ggml-cpu has no multi-row kernels (x86 with AVX2 only)")
    return lib


def _halves(rng, n) -> np.ndarray:
    """n small finite fp16 scales, as bytes [n, 2]."""
    return (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint8).reshape(n, 2)


def _act_rows(rng, kind, n_rows, nb) -> np.ndarray:
    """n_rows activation rows of nb blocks each, ``kind`` "q8_0" (fp16 scale first) or "q8_K" (float32 scale
    first): bytes [n_rows, nb * block bytes]."""
    size = Q8_0_BYTES if kind == "q8_0" else Q8_K_BYTES
    b = rng.integers(0, 256, size=(n_rows * nb, size), dtype=np.uint8)
    if kind == "q8_0":
        b[:, :2] = _halves(rng, n_rows * nb)
    else:
        b[:, :4] = (rng.standard_normal(n_rows * nb) * 0.01).astype(np.float32).view(np.uint8).reshape(-1, 4)
    return b.reshape(n_rows, nb * size)


def _pointers(rows: np.ndarray):
    return (ctypes.c_void_p * len(rows))(*[r.ctypes.data for r in rows])


def _fp(a: np.ndarray):
    return a.ctypes.data_as(F)


@pytest.mark.parametrize("wtype", list(PLAIN), ids=lambda t: t.name)
def test_plain_rows_are_vec_dot_bit_for_bit(cpu, wtype):
    rng = np.random.default_rng(int(wtype))
    block, per_block, scales, act = PLAIN[wtype]
    n = 1408 if per_block == 32 else 1536  # DeepSeek-V2-Lite's expert width (44 blocks of 32); 6 super blocks
    nb = n // per_block
    w = rng.integers(0, 256, size=(nb, block), dtype=np.uint8)
    for off in scales:
        w[:, off:off + 2] = _halves(rng, nb)
    name = f"ggml_vec_dot_{wtype.name.lower().replace('_k', '_K')}_{act}"
    single = VEC_DOT(ctypes.cast(getattr(cpu, name), ctypes.c_void_p).value)
    rows_fn = VEC_DOT_ROWS(cpu.ggml_cpu_vec_dot_rows_of(int(wtype)))
    for nr in range(1, 20):
        acts = _act_rows(rng, act, nr, nb)
        want = np.empty(nr, np.float32)
        for r in range(nr):
            single(n, _fp(want[r:]), 0, w.ctypes.data, 0, acts[r].ctypes.data, 0, 1)
        bs = 3  # outputs strided, the floats between them untouched
        got = np.full(nr * bs, np.nan, np.float32)
        rows_fn(n, _fp(got), bs, w.ctypes.data, _pointers(acts), nr)
        assert np.array_equal(got[::bs].view(np.uint32), want.view(np.uint32)), nr
        assert np.isnan(got.reshape(nr, bs)[:, 1:]).all(), nr


def test_no_multi_row_kernel_for_other_plain_types(cpu):
    for t in (Q.F16, Q.Q4_1, Q.Q5_K, Q.IQ4_NL):
        assert not cpu.ggml_cpu_vec_dot_rows_of(int(t)), t.name


def test_repacked_q4_k_rows_are_gemv_bit_for_bit(cpu):
    rng = np.random.default_rng(12)
    n, nc = 1024, 32  # 4 super blocks, 4 groups of 8 interleaved columns
    nb = n // 256
    w = rng.integers(0, 256, size=(nc // 8 * nb, Q4_KX8_BYTES), dtype=np.uint8)
    w[:, :32] = _halves(rng, 16 * len(w)).reshape(len(w), 32)  # d[8] and dmin[8]
    gemv = GEMV(ctypes.cast(cpu.ggml_gemv_q4_K_8x8_q8_K, ctypes.c_void_p).value)
    rows_fn = GEMV_ROWS(ctypes.cast(cpu.ggml_gemv_q4_K_8x8_q8_K_rows, ctypes.c_void_p).value)
    for nr in range(1, 12):
        acts = _act_rows(rng, "q8_K", nr, nb)
        want = np.empty((nr, nc), np.float32)
        for r in range(nr):
            gemv(n, _fp(want[r]), nc, w.ctypes.data, acts[r].ctypes.data, 1, nc)
        ld = nc + 8  # row stride past the outputs: the 8 floats after each row untouched
        got = np.full((nr, ld), np.nan, np.float32)
        rows_fn(n, _fp(got), ld, w.ctypes.data, _pointers(acts), nr, nc)
        assert np.array_equal(got[:, :nc].view(np.uint32), want.view(np.uint32)), nr
        assert np.isnan(got[:, nc:]).all(), nr
