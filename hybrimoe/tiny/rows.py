"""Random but valid rows of quantized weights, written as raw ggml blocks (no float weights, no quantizer).

:func:`random_quant_rows` fills whole blocks of Q4_0, Q4_K, Q5_0, Q6_K, Q8_0 or MXFP4 with random quants and
finite scales chosen so that the dequantized weights have mean ~0 and a given standard deviation: a multi-GB
benchmark model (``hybrimoe.tiny.synthetic``) is written in seconds, without tens of GB of floats. Block layouts
are ggml's (``ggml-common.h``: ``block_q4_0``, ``block_q4_K``, ``block_q5_0``, ``block_q6_K``, ``block_q8_0``,
``block_mxfp4``; gguf-py's ``gguf.quants`` reads the same layouts back); block widths and byte sizes come from
``gguf.GGML_QUANT_SIZES``.
"""
from __future__ import annotations

import gguf
import numpy as np

#: the 16 values an MXFP4 nibble stands for: FP4 E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) doubled, as
#: ggml's ``kvalues_mxfp4``; the block's E8M0 exponent ``e`` scales them by ``2^(e - 128)`` (half of ``2^(e - 127)``)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float64)

_TYPES = ("Q4_0", "Q4_K", "Q5_0", "Q6_K", "Q8_0", "MXFP4")


def _rms(values: np.ndarray) -> float:
    """Root mean square of ``values`` (computed in float64)."""
    return float(np.sqrt(np.mean(values.astype(np.float64) ** 2)))


def random_quant_rows(rng: np.random.Generator, type_name: str, n_rows: int, row_len: int,
                      std: float) -> np.ndarray:
    """``n_rows`` rows of ``row_len`` weights of ggml type ``type_name`` with random but valid content.

    Quantized types come back as raw blocks, uint8 ``[n_rows, row_len / block * type_size]``: random quants,
    finite scales, arranged so that the dequantized weights have mean ~0 and standard deviation ~``std``.
    The fp16 scales ``d`` are jittered by 0.75-1.25x per block, with a random sign: Q4_K: ``d`` and
    ``dmin = 7.5 d`` with equal 6-bit scale and min per sub-block (16..63), so ``w = d * sc * (q - 7.5)``; Q6_K:
    int8 sub-block scales 16..127, ``w = d * sc * (q - 32)``; Q4_0 (fp16 ``d``, 16 bytes of nibbles per 32
    weights): ``w = d * (q - 8)``; Q5_0: ``w = d * (q - 16)``; Q8_0: ``w = d * q``. MXFP4 (one E8M0 exponent
    byte ``e``, 16 bytes of nibbles per 32 weights): ``w = MXFP4_VALUES[q] * 2^(e - 128)``, symmetric, so mean 0;
    a power-of-two scale cannot be jittered continuously, so each block takes one of the two exponents around
    the target, the larger with the probability that makes the expected variance ``std^2``. F32/F16 come back as
    float arrays ``[n_rows, row_len]`` of normal values.

    Args:
        rng: the generator all values are drawn from (the same state gives the same bytes).
        type_name: ``"Q4_0"``, ``"Q4_K"``, ``"Q5_0"``, ``"Q6_K"``, ``"Q8_0"``, ``"MXFP4"``, ``"F16"`` or ``"F32"``.
        n_rows: rows; row_len: weights per row (elements, ggml's ne0); std: target standard deviation (> 0 for
            the quantized types).

    Raises:
        ValueError: a type this writer does not make, ``row_len`` not a multiple of its block size, or (quantized
            types) a ``std`` that is not a finite number > 0 or, for MXFP4, beyond the E8M0 exponent's range.
    """
    if type_name in ("F32", "F16"):
        a = rng.standard_normal((n_rows, row_len), dtype=np.float32) * np.float32(std)
        return a if type_name == "F32" else a.astype(np.float16)
    if type_name not in _TYPES:
        raise ValueError(f"random_quant_rows: no writer for type {type_name!r} ({', '.join(_TYPES)}, F16, F32)")
    blk, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    if row_len % blk:
        raise ValueError(f"{type_name} needs rows that are a multiple of {blk}, got {row_len}")
    if not (np.isfinite(std) and std > 0):
        raise ValueError(f"random_quant_rows: std must be a finite number > 0 for {type_name}, got {std!r}")
    nb = n_rows * (row_len // blk)
    b = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    # per-block scale jitter, and a random sign: quants like Q5_0's (q - 16) have mean -0.5, not 0
    jitter = rng.uniform(0.75, 1.25, size=nb) * rng.choice(np.array([-1.0, 1.0]), size=nb)

    def fp16(x):
        return np.asarray(x, dtype=np.float16).reshape(-1, 1).view(np.uint8)

    if type_name == "Q8_0":   # d, qs[32] int8
        d = std / _rms(np.arange(-128, 128)) * jitter
        b[:, 0:2] = fp16(d)
    elif type_name == "Q4_0":  # d, qs[16]: element j in the low nibble of byte j, element j + 16 in its high one
        d = std / _rms(np.arange(16) - 8.0) * jitter
        b[:, 0:2] = fp16(d)
    elif type_name == "MXFP4":  # e, qs[16] (nibbles as Q4_0's)
        scale = std / _rms(MXFP4_VALUES)  # the wanted 2^(e - 128)
        lo = int(np.floor(np.log2(scale)))
        # the larger exponent with probability p: p 4^(lo+1) + (1 - p) 4^lo = scale^2
        p = (scale * scale - 4.0 ** lo) / (4.0 ** (lo + 1) - 4.0 ** lo)
        e = lo + 128 + (rng.random(nb) < p)
        if lo + 128 < 2 or lo + 129 > 254:  # below 2, E8M0's half-scale is subnormal; 255 is NaN
            raise ValueError(f"random_quant_rows: std {std!r} is beyond MXFP4's exponent range")
        b[:, 0] = e.astype(np.uint8)
    elif type_name == "Q5_0":  # d, qh[4], qs[16]: q = low nibble | high bit << 4, 0..31
        d = std / _rms(np.arange(32) - 16.0) * jitter
        b[:, 0:2] = fp16(d)
    elif type_name == "Q4_K":  # d, dmin, scales[12] (8 x 6-bit scale + 8 x 6-bit min), qs[128]
        sc = rng.integers(16, 64, size=(nb, 8), dtype=np.uint8)
        d = std / (_rms(np.arange(16, 64)) * _rms(np.arange(16) - 7.5)) * jitter
        b[:, 0:2] = fp16(d)
        b[:, 2:4] = fp16(7.5 * d)
        m = sc  # equal scale and min per sub-block: zero-mean weights with dmin = 7.5 d
        lo, hi = sc[:, :4], sc[:, 4:]
        b[:, 4:8] = lo | ((hi >> 4) << 6)
        b[:, 8:12] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
        b[:, 12:16] = (hi & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    else:  # Q6_K: ql[128], qh[64], scales[16] int8, d
        sc = rng.integers(16, 128, size=(nb, 16), dtype=np.int8)
        d = std / (_rms(np.arange(16, 128)) * _rms(np.arange(64) - 32.0)) * jitter
        b[:, 192:208] = sc.view(np.uint8)
        b[:, 208:210] = fp16(d)
    return b.reshape(n_rows, -1)

