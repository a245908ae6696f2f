"""Synthetic Mixture-of-Experts GGUF models written locally, for tests, demos and benchmarks.

Two model makers:

- :func:`make_tiny_model`: a small model of one of ten MoE architectures (``ARCHS``) that llama.cpp loads and
  generates from, with seeded random weights, a real tokenizer, a router designed for wide top-k margins and,
  optionally, quantized through llama.cpp's own quantizer; :func:`fixture_set` lists the recipes the test suite
  uses. ``hybrimoe make-tiny-model`` is its command line.
- :func:`make_synthetic_model`: a full-size model of a real MoE shape (``SYNTHETIC_SHAPES``:
  DeepSeek-V2-Lite, Qwen3-30B-A3B, gpt-oss-20b) in Q4_K_M, Q4_0 or MXFP4 (``SYNTHETIC_QUANTS``) for
  benchmarks, its quantized blocks written directly (random, valid) instead of quantized from floats.

Modules, one concept each:

===================  ===========================================================================================
``tiny_model``       :func:`make_tiny_model`, ``ARCHS``, :func:`default_widths`: architectures, tensors, writer
``router``           the designed router: embeddings and router matrices with a top-k logit margin
``tokenizers``       the SPM (``llama``) and byte-level BPE (``gpt2``) vocabularies of ``N_VOCAB`` tokens
``quantize``         quant arguments (``FTYPES``, ``MIX_PRESETS``), :func:`quantize_gguf` through
                     ``llama_model_quantize``, :func:`q4_k_m_type` (upstream's Q4_K_M types restated)
``rows``             :func:`random_quant_rows`: random valid Q4_0/Q4_K/Q5_0/Q6_K/Q8_0/MXFP4 blocks
``synthetic``        :func:`make_synthetic_model`, :func:`synthetic_tensor_plan`, ``SYNTHETIC_SHAPES``
                     (``DSV2_LITE_SHAPE``, ``QWEN3_30B_A3B_SHAPE``, ``GPT_OSS_20B_SHAPE``), ``SYNTHETIC_QUANTS``
``fixtures``         :func:`fixture_set`
``split``            :func:`split_gguf`: a model as llama.cpp's shard files (``-00001-of-0000N.gguf``)
===================  ===========================================================================================

``hybrimoe make-tiny-model`` (:mod:`hybrimoe.commands.make_tiny_model`) is the command line of
:func:`make_tiny_model`. Every name below is importable from ``hybrimoe.tiny`` itself.
"""
from __future__ import annotations

from hybrimoe.tiny.fixtures import fixture_set
from hybrimoe.tiny.quantize import FTYPES, MIX_PRESETS, QuantSpec, parse_quant, q4_k_m_type, quantize_gguf
from hybrimoe.tiny.rows import random_quant_rows
from hybrimoe.tiny.split import split_gguf
from hybrimoe.tiny.synthetic import (
    DSV2_LITE_SHAPE,
    GPT_OSS_20B_SHAPE,
    QWEN3_30B_A3B_SHAPE,
    SYNTHETIC_QUANTS,
    SYNTHETIC_SHAPES,
    make_synthetic_model,
    synthetic_tensor_plan,
)
from hybrimoe.tiny.tiny_model import ARCHS, DEFAULT_N_EMBD, DEFAULT_N_FF_EXP, default_widths, make_tiny_model
from hybrimoe.tiny.tokenizers import N_VOCAB, TOKENIZERS, WORDS

__all__ = [
    "ARCHS", "DEFAULT_N_EMBD", "DEFAULT_N_FF_EXP", "DSV2_LITE_SHAPE", "FTYPES", "GPT_OSS_20B_SHAPE", "MIX_PRESETS",
    "N_VOCAB", "QWEN3_30B_A3B_SHAPE", "QuantSpec", "SYNTHETIC_QUANTS", "SYNTHETIC_SHAPES", "TOKENIZERS", "WORDS",
    "default_widths", "fixture_set", "make_synthetic_model", "make_tiny_model", "parse_quant", "q4_k_m_type",
    "quantize_gguf", "random_quant_rows", "split_gguf", "synthetic_tensor_plan",
]
