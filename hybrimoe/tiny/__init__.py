"""Write tiny synthetic Mixture-of-Experts GGUF models for tests and demos.

``make_tiny_model(path, arch=...)`` writes a small, valid GGUF file that llama.cpp loads and generates from,
with random (seeded) weights, a real tokenizer (SentencePiece-style ``llama`` vocab with byte fallback, or
byte-level BPE ``gpt2`` with merges) and, optionally, quantized through llama.cpp's own quantizer
(``llama_model_quantize``), including per-tensor mixes for the expert tensors.

Architectures (GGUF ``general.architecture``):

============  ============================================================================================
``qwen3moe``  routed experts only; q/k RMS norms per head; top-k weights normalised
``qwen2moe``  routed experts + one shared expert of width ``n_shared * n_ff_exp`` with its sigmoid gate
              (``ffn_gate_inp_shexp``)
``olmoe``     routed experts only; q/k norms over the whole projection (so ``n_head_kv == n_head``)
``llama``     Mixtral-style: ``feed_forward_length`` is the expert width, softmax routing
``deepseek2`` MLA attention (q/kv low-rank, split ``attn_k_b``/``attn_v_b``), ``n_dense_lead`` leading
              dense FFN layers, ``n_shared`` shared experts, ``expert_weights_scale``,
              ``expert_weights_norm`` and ``expert_gating_func`` (sigmoid by default, as DeepSeek-V3)
``gpt-oss``   OpenAI-MoE: attention sinks, sliding-window layers, router bias and per-expert biases
              (``ffn_{gate,up,down}_exps.bias``), SwiGLU-OAI activation
============  ============================================================================================

Tensor shapes below use ggml order ``{ne0, ne1, ne2}`` (ne0 = contiguous row length); the numpy arrays
handed to the gguf writer have the reversed shape. ``D = n_embd``, ``F = n_ff_exp``, ``E = n_expert``,
``k = n_expert_used``, ``V = N_VOCAB`` = 512 tokens (both tokenizers).
Routed experts: ``ffn_gate_exps``/``ffn_up_exps`` ``{D, F, E}``, ``ffn_down_exps`` ``{F, D, E}``; router
``ffn_gate_inp`` ``{D, E}`` (llama.cpp's quantizer never quantizes it; it stays F32).

Wide router margins (``router_margin``)
---------------------------------------
Routing must not be decided by rounding (a hybrid CPU/GPU run and an upstream run must pick the same experts),
so the router is designed, not random. There are ``E`` unit "expert key" vectors ``K[e]`` in R^D:
orthonormal when ``E <= D``; for ``D < E <= 2 D``, ``ceil(E/2)`` orthonormal directions and their negations
(an expert whose key is the negation of an assigned one gets a strongly negative logit, so no cross-talk).
Each token ``v`` of the vocabulary is assigned ``k`` experts ``S_v`` with distinct key directions (seeded) and
distinct strengths ``w_0 > ... > w_{k-1}`` (1.0 down to 0.6). Its embedding is
``u_v = sum_j w_j K[S_v[j]] + 0.5 r_v`` rescaled to unit RMS, with ``r_v`` a random token-identity vector
orthogonal to all keys (zero when the keys span all ``D`` dims). Router row ``e`` of MoE layer ``l`` is
``gamma * K[pi_l(e)]`` (``pi_l`` a seeded per-layer permutation, so each layer picks different experts for
the same token). For the nominal hidden state ``x = rmsnorm(emb_v)`` the assigned experts' logits are
``gamma * sqrt(D) * w_j / |u_v|`` and all others are <= 0; ``gamma`` makes the gap between the k-th and the
(k+1)-th largest logit, minimum over the vocabulary, equal to ``router_margin`` (router-logit units, before
softmax/sigmoid). The real hidden state also carries attention and earlier layers' outputs; their output
projections are scaled by ``residual_scale`` so the realised gap stays close to the design: measured through
llama.cpp's eval callback on 120-token prompts over 3-4 layers, the smallest gap is 1.2-3.8 and the median
3-3.9 for a designed 4.0, and the chosen experts are the designed ones for every token. Routing thus depends
mostly on the current token; a prompt uses many different experts. With ``E > 2 D`` the keys are random unit
vectors (per-token best of 64 candidate sets, ``gamma`` from the median gap): no margin guarantee, so keep
``n_expert <= 2 * n_embd`` for oracle tests.

The output head is random for text-piece tokens and zero for byte, control and unused tokens, so greedy
generation produces readable text pieces and never a lone byte token (invalid UTF-8 keeps llama-cpp-python's
``create_completion`` generating past ``max_tokens``) nor EOS.

Quantization
------------
``quant`` is ``None``/``"F32"`` (written directly), a llama.cpp file type name (``"F16"``, ``"Q8_0"``,
``"Q4_0"``, ``"Q4_K_M"``, ``"Q6_K"``, ...; see ``FTYPES``), the preset ``"mix"`` (base Q8_0 with
``ffn_gate_exps`` Q4_K, ``ffn_up_exps`` Q8_0, ``ffn_down_exps`` Q6_K) or a dict mapping tensor-name patterns
(regular expressions searched in the tensor name, e.g. ``"ffn_gate_exps"``) to ggml type names, with an
optional ``"base"`` entry naming the file type for all other tensors (default ``"Q8_0"``). The model is first
written as F32 to a temporary file next to ``path`` and then quantized through ``llama_model_quantize``
(per-tensor types via its ``tt_overrides``). Types with 256-wide blocks (K-quants) need ``n_embd`` and
``n_ff_exp`` to be multiples of 256 (otherwise upstream silently falls back to another type); 32-wide types
need multiples of 32; ``make_tiny_model`` raises ``ValueError`` instead of writing an unexpected type.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

ARCHS = ("qwen3moe", "qwen2moe", "olmoe", "llama", "deepseek2", "gpt-oss")
TOKENIZERS = ("spm", "bpe")
N_VOCAB = 512  # vocabulary size of both tokenizers (padded with unused tokens)

# llama.cpp file types reachable by name (value: suffix of llama_cpp.LLAMA_FTYPE_*).
FTYPES = {
    "F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16",
    "Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q5_0": "MOSTLY_Q5_0",
    "Q5_1": "MOSTLY_Q5_1", "Q2_K": "MOSTLY_Q2_K", "Q3_K_S": "MOSTLY_Q3_K_S", "Q3_K_M": "MOSTLY_Q3_K_M",
    "Q3_K_L": "MOSTLY_Q3_K_L", "Q4_K_S": "MOSTLY_Q4_K_S", "Q4_K_M": "MOSTLY_Q4_K_M",
    "Q5_K_S": "MOSTLY_Q5_K_S", "Q5_K_M": "MOSTLY_Q5_K_M", "Q6_K": "MOSTLY_Q6_K",
}
# ggml types each file type may produce for the (large, 2-D/3-D) weights, used for the row-size check
_FTYPE_BLOCK = {"F32": 1, "F16": 1, "BF16": 1, "Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32}
MIX_PRESETS = {
    "mix": {"base": "Q8_0", "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q6_K"},
}

_DEFAULTS = {
    # arch: (n_expert, n_expert_used, n_shared)
    "qwen3moe": (8, 2, 0), "qwen2moe": (8, 2, 1), "olmoe": (8, 2, 0), "llama": (8, 2, 0),
    "deepseek2": (8, 2, 1), "gpt-oss": (8, 2, 0),
}


def _llama_cpp():
    """Return the ``llama_cpp`` module: hybrimoe's (patched libllama) when built, else plain llama_cpp.

    Raises:
        ImportError: llama-cpp-python is not installed, or llama_cpp was imported before hybrimoe while
            hybrimoe's libllama exists (see ``hybrimoe._lib.llama_cpp_module``).
    """
    from hybrimoe import _lib

    try:
        return _lib.llama_cpp_module()
    except _lib.HybrimoeImportError:
        if (_lib.LIB_DIR / "libllama.so").exists():
            raise
        import llama_cpp  # development fallback: hybrimoe's native part is not built yet

        return llama_cpp


# --------------------------------------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------------------------------------

_WORDS = ("the", "and", "is", "of", "to", "in", "a", "it", "was", "hello", "world", "once", "upon", "time",
          "there", "little", "model", "expert", "mixture", "cat", "dog", "run", "fast", "slow", "one", "two")


def _spm_vocab():
    """SentencePiece-style vocab: (tokens, scores, token_types); ids 0/1/2 = <unk>/<s>/</s>, then 256 byte
    tokens ``<0xXX>`` (byte fallback), then single characters and ``▁``-prefixed word pieces with all their
    prefixes (the SPM tokenizer only reaches a piece through pieces already in the vocab)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces: list[str] = ["▁"]
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;()"
    pieces += list(chars)
    for w in _WORDS:
        for i in range(1, len(w) + 1):
            pieces.append("▁" + w[:i])
        for i in range(2, len(w) + 1):
            pieces.append(w[:i])
    seen = set(tokens)
    for p in pieces:
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(1)
    while len(tokens) < N_VOCAB:  # pad to a fixed size with unused tokens
        tokens.append(f"<unused{len(tokens)}>")
        types.append(5)
    scores = [0.0] * 259 + [float(len(t)) - 1e-4 * i for i, t in enumerate(tokens[259:])]
    return tokens, scores, types


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _bpe_vocab():
    """GPT-2 byte-level BPE vocab: (tokens, token_types, merges); 256 byte symbols, merged word pieces
    (``Ġ`` marks a leading space), then ``<|endoftext|>`` (bos/eos)."""
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges: list[str] = []
    seen = set(tokens)
    for w in _WORDS:
        for word in ("Ġ" + w, w):
            cur = word[0]
            for ch in word[1:]:
                new = cur + ch
                if new not in seen:
                    merges.append(f"{cur} {ch}")
                    seen.add(new)
                    tokens.append(new)
                cur = new
    types = [1] * len(tokens)
    tokens.append("<|endoftext|>")
    types.append(3)
    while len(tokens) < N_VOCAB:
        tokens.append(f"<|unused{len(tokens)}|>")
        types.append(5)
    return tokens, types, merges


def _write_tokenizer(w, tokenizer: str) -> np.ndarray:
    """Write the tokenizer keys; return a bool mask (V,) of normal (text piece) tokens."""
    if tokenizer == "spm":
        tokens, scores, types = _spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(True)
    elif tokenizer == "bpe":
        tokens, types, merges = _bpe_vocab()
        eot = tokens.index("<|endoftext|>")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(eot)
        w.add_eos_token_id(eot)
        w.add_add_bos_token(False)
    else:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; valid: {', '.join(TOKENIZERS)}")
    return np.array(types) == 1


# --------------------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------------------

def _router_design(rng, n_vocab, n_embd, n_expert, k, n_moe_layers, router_margin):
    """Token embeddings (V, D) and per-MoE-layer router matrices (E, D) with a designed top-k gap.

    Returns (emb, routers, assigned) with ``assigned[v]`` the k keys of token v (strongest first).
    With ``E <= 2 D`` the keys are orthonormal directions and their negations and every token gets the same
    gap; with more experts they overlap and each token's key set is the best of 64 random draws (wide but less
    uniform gaps)."""
    D, E = n_embd, n_expert
    strengths = np.linspace(1.0, 0.6, k) if k > 1 else np.ones(1)
    n_dir = E if E <= D else (E + 1) // 2
    exact = E <= 2 * D and k <= n_dir
    if exact:
        # orthonormal directions; with E > D the experts beyond n_dir use the negated directions, whose
        # logits are then strongly negative for any token assigned the positive one (no cross-talk)
        q, _ = np.linalg.qr(rng.standard_normal((D, n_dir)))
        basis = q.T  # (n_dir, D)
        keys = np.concatenate([basis, -basis[: E - n_dir]])
        assigned = []
        for _ in range(n_vocab):
            dirs = rng.choice(n_dir, size=k, replace=False)
            flip = rng.integers(0, 2, size=k).astype(bool) & (dirs < E - n_dir)
            assigned.append(np.where(flip, dirs + n_dir, dirs))
        assigned = np.stack(assigned)
    else:
        # more experts than 2 * n_embd: keys overlap; per token keep the best of 64 candidate expert sets
        # (largest nominal top-k gap), so cross-talk between keys blurs the top-k boundary less
        keys = rng.standard_normal((E, D))
        keys /= np.linalg.norm(keys, axis=1, keepdims=True)
        rows = []
        for _ in range(n_vocab):
            cand = np.stack([rng.choice(E, size=k, replace=False) for _ in range(64)])
            u = (strengths[None, :, None] * keys[cand]).sum(axis=1)
            lg = (u / np.linalg.norm(u, axis=1, keepdims=True)) @ keys.T
            srt = -np.sort(-lg, axis=1)
            inset = np.take_along_axis(lg, cand, axis=1).min(axis=1)
            ok = inset >= srt[:, k - 1] - 1e-9  # the designed set really is the top-k
            score = np.where(ok, (srt[:, k - 1] - srt[:, k]) if E > k else 1.0, -np.inf)
            rows.append(cand[int(np.argmax(score))])
        assigned = np.stack(rows)
    ident = rng.standard_normal((n_vocab, D))
    if exact:  # keep the token-identity part out of the key span: no router cross-talk
        ident -= (ident @ basis.T) @ basis
    nrm = np.linalg.norm(ident, axis=1, keepdims=True)
    ident = np.where(nrm > 1e-6, ident / np.maximum(nrm, 1e-12), 0.0)  # zero when the keys span all of R^D
    emb = (strengths[None, :, None] * keys[assigned]).sum(axis=1) + 0.5 * ident
    # unit RMS per element, so block outputs of RMS ~residual_scale are small next to it
    emb *= np.sqrt(D) / np.linalg.norm(emb, axis=1, keepdims=True)
    # nominal hidden state: rmsnorm(emb) with unit norm weights
    x = emb / np.sqrt((emb ** 2).mean(axis=1, keepdims=True))
    routers = []
    for _ in range(n_moe_layers):
        perm = rng.permutation(E)
        routers.append(keys[perm])
    if E > k:
        srt = np.sort(x @ keys.T, axis=1)[:, ::-1]
        gaps = srt[:, k - 1] - srt[:, k]
        # exact design: the minimum over the vocabulary; overlapping keys: the median (many tokens then have
        # narrower gaps, but the logits keep a sane scale)
        gap = float(gaps.min() if exact else np.median(gaps))
        gamma = router_margin / gap if gap > 0 else router_margin
    else:
        gamma = 1.0
    routers = [(gamma * r).astype(np.float32) for r in routers]
    return emb.astype(np.float32), routers, assigned


def _normal(rng, shape, std):
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _check_quant(quant, n_embd, n_ff_exp, extra_rows=()):
    """Normalise ``quant`` to (base_ftype_name, {pattern: ggml type name}) or None for F32; check row sizes."""
    import gguf

    if quant is None:
        return None
    if isinstance(quant, str):
        q = quant.upper() if quant.lower() != "mix" else "mix"
        if q == "F32":
            return None
        if q in MIX_PRESETS or quant in MIX_PRESETS:
            spec = dict(MIX_PRESETS[quant if quant in MIX_PRESETS else q])
        elif q in FTYPES:
            spec = {"base": q}
        else:
            raise ValueError(f"unknown quant {quant!r}; valid: {', '.join(list(FTYPES) + list(MIX_PRESETS))} "
                             "or a dict {tensor pattern: ggml type}")
    elif isinstance(quant, dict):
        spec = {str(k): str(v).upper() for k, v in quant.items()}
        spec.setdefault("base", "Q8_0")
    else:
        raise ValueError(f"quant must be None, a name or a dict, not {type(quant).__name__}")
    base = spec.pop("base").upper()
    if base not in FTYPES:
        raise ValueError(f"unknown base file type {base!r}; valid: {', '.join(FTYPES)}")
    blocks = [_FTYPE_BLOCK.get(base, 256)]
    for pat, tname in spec.items():
        try:
            re.compile(pat)
        except re.error as e:
            raise ValueError(f"bad tensor pattern {pat!r}: {e}") from None
        try:
            t = gguf.GGMLQuantizationType[tname]
        except KeyError:
            raise ValueError(f"unknown ggml type {tname!r} for {pat!r}") from None
        blocks.append(gguf.GGML_QUANT_SIZES[t][0])
    blk = max(blocks)
    for name, rows in (("n_embd", n_embd), ("n_ff_exp", n_ff_exp)) + tuple(extra_rows):
        if rows % blk:
            raise ValueError(f"quant {quant!r} uses {blk}-wide blocks but {name}={rows} is not a multiple of "
                             f"{blk}; llama.cpp would silently write another type. Use multiples of {blk}.")
    return base, spec


def make_tiny_model(path, arch: str = "qwen3moe", *, seed: int = 0, n_layer: int = 2, n_embd: int = 64,
                    n_expert: int | None = None, n_expert_used: int | None = None, n_ff_exp: int = 32,
                    n_shared: int | None = None, n_head: int = 4, n_dense_lead: int = 1, n_ff_dense: int | None = None,
                    quant=None, tokenizer: str = "spm", router_margin: float = 4.0,
                    residual_scale: float = 0.15, n_ctx_train: int = 512) -> Path:
    """Write a tiny MoE GGUF model to ``path`` and return it as a ``Path``.

    Args:
        path: output file (parent directories are created; an existing file is replaced).
        arch: one of ``ARCHS`` (``qwen3moe``, ``qwen2moe``, ``olmoe``, ``llama``, ``deepseek2``, ``gpt-oss``).
        seed: RNG seed; the same arguments and seed give a byte-identical file.
        n_layer: transformer blocks (for deepseek2, including the ``n_dense_lead`` leading dense ones).
        n_embd: hidden size D (elements); must be a multiple of ``n_head`` (and of 256 for K-quants).
        n_expert: routed experts E per MoE layer (any value >= 1, e.g. 6 or 60; default 8).
        n_expert_used: experts selected per token k (1 <= k <= E; default 2).
        n_ff_exp: routed expert FFN width F (elements; multiple of 32 for Q8_0/Q4_0, 256 for K-quants).
        n_shared: shared experts. qwen2moe: one shared FFN of width ``n_shared * n_ff_exp`` (default 1, >= 1);
            deepseek2: ``expert_shared_count`` (default 1, >= 1); other archs: must be 0/None.
        n_head: attention heads (head dim D / n_head; deepseek2 uses its own MLA sizes, see below).
        n_dense_lead: deepseek2 only: leading dense FFN layers (``leading_dense_block_count``, < n_layer).
        n_ff_dense: deepseek2 only: dense FFN width (default ``2 * n_ff_exp``).
        quant: None/"F32", a file-type name (``FTYPES``), ``"mix"`` or a {pattern: ggml type} dict (module doc).
        tokenizer: ``"spm"`` (llama SPM with byte fallback) or ``"bpe"`` (gpt2 byte-level BPE).
        router_margin: designed minimum gap (router-logit units) between the k-th and (k+1)-th router logit
            for the nominal hidden state of every vocabulary token (module doc). Must be > 0.
        residual_scale: RMS (relative to the embedding's) that each attention / FFN block adds to the residual
            stream; smaller keeps routing closer to the design.
        n_ctx_train: ``context_length`` written to the file.

    deepseek2 MLA sizes (fixed): q_lora_rank 32 (none with 26 or 27 blocks: llama.cpp reads those as
    DeepSeek-V2-Lite, whose queries have no low-rank projection), kv_lora_rank 32, qk_rope 16, qk_nope 16, v_head 16,
    ``head_count_kv`` 1 (``key_length`` = kv_lora_rank + rope = 48, ``value_length`` = kv_lora_rank = 32,
    ``key_length_mla`` 32, ``value_length_mla`` 16), sigmoid gating, ``expert_weights_norm`` true,
    ``expert_weights_scale`` 2.5.

    Raises:
        ValueError: unknown arch, tokenizer or quant; inconsistent sizes (k > E, n_embd % n_head, rows not a
            multiple of the quant block, shared experts on an arch without them, ...).
        RuntimeError: llama.cpp's quantizer failed.
    """
    import gguf

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(ARCHS)}")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; valid: {', '.join(TOKENIZERS)}")
    d_e, d_k, d_s = _DEFAULTS[arch]
    E = d_e if n_expert is None else int(n_expert)
    k = d_k if n_expert_used is None else int(n_expert_used)
    ns = d_s if n_shared is None else int(n_shared)
    D, F, L = int(n_embd), int(n_ff_exp), int(n_layer)
    if L < 1 or D < 1 or F < 1:
        raise ValueError("n_layer, n_embd and n_ff_exp must be >= 1")
    if not 1 <= E <= 256:
        raise ValueError(f"n_expert must be in 1..256, got {E}")
    if not 1 <= k <= E:
        raise ValueError(f"n_expert_used must be in 1..n_expert ({E}), got {k}")
    if n_head < 1:
        raise ValueError(f"n_head must be >= 1, got {n_head}")
    if D % n_head:
        raise ValueError(f"n_embd ({D}) must be a multiple of n_head ({n_head})")
    if not np.isfinite(router_margin) or router_margin <= 0:
        raise ValueError(f"router_margin must be a finite number > 0, got {router_margin}")
    if not np.isfinite(residual_scale) or residual_scale < 0:
        raise ValueError(f"residual_scale must be a finite number >= 0, got {residual_scale}")
    if arch in ("qwen2moe", "deepseek2"):
        if ns < 1:
            raise ValueError(f"{arch} needs n_shared >= 1")
    elif ns:
        raise ValueError(f"{arch} has no shared experts (n_shared must be 0); qwen2moe and deepseek2 have them")
    n_dense = 0
    if arch == "deepseek2":
        n_dense = int(n_dense_lead)
        if not 0 <= n_dense < L:
            raise ValueError(f"n_dense_lead must be in 0..n_layer-1 ({L - 1}), got {n_dense}")
    n_ff_d = int(n_ff_dense) if n_ff_dense is not None else 2 * F
    qspec = _check_quant(quant, D, F)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hd = D // n_head
    n_head_kv = n_head if arch == "olmoe" else max(1, n_head // 2)
    s = float(residual_scale)

    # write next to the target and rename at the end: a failure never leaves a damaged file at `path`
    fd, out_tmp = tempfile.mkstemp(suffix=".tmp.gguf", dir=str(path.parent))
    os.close(fd)
    try:
        if qspec is None:
            _write(Path(out_tmp), gguf, arch, rng, D, F, E, k, ns, L, n_head, n_head_kv, hd, n_dense, n_ff_d,
                   tokenizer, router_margin, s, n_ctx_train)
        else:
            fd, tmp = tempfile.mkstemp(suffix=".f32.gguf", dir=str(path.parent))
            os.close(fd)
            try:
                _write(Path(tmp), gguf, arch, rng, D, F, E, k, ns, L, n_head, n_head_kv, hd, n_dense, n_ff_d,
                       tokenizer, router_margin, s, n_ctx_train)
                quantize_gguf(tmp, out_tmp, qspec[0], qspec[1])
            finally:
                os.unlink(tmp)
        os.replace(out_tmp, path)
    finally:
        if os.path.exists(out_tmp):
            os.unlink(out_tmp)
    return path


def _write(path, gguf, arch, rng, D, F, E, k, ns, L, n_head, n_head_kv, hd, n_dense, n_ff_d, tokenizer,
           router_margin, s, n_ctx_train):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"hybrimoe-tiny-{arch}")
    normal = _write_tokenizer(w, tokenizer)
    n_vocab = len(normal)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(D)
    w.add_block_count(L)
    w.add_head_count(n_head)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_expert_count(E)
    w.add_expert_used_count(k)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch in ("llama", "olmoe"):
        w.add_feed_forward_length(F)
    else:
        w.add_feed_forward_length(n_ff_d if arch == "deepseek2" else F)
        w.add_expert_feed_forward_length(F)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(ns * F)
    mla = dict(q_lora=32, kv_lora=32, rope=16, nope=16, v=16)
    # llama.cpp takes a deepseek2 model with 26 or 27 blocks for DeepSeek-V2-Lite, whose queries have no
    # low-rank projection (src/models/deepseek2.cpp, is_lite): write attn_q then, like that model
    lite = arch == "deepseek2" and L in (26, 27)
    if arch == "deepseek2":
        w.add_head_count_kv(1)
        w.add_leading_dense_block_count(n_dense)
        if not lite:
            w.add_q_lora_rank(mla["q_lora"])
        w.add_kv_lora_rank(mla["kv_lora"])
        w.add_key_length(mla["kv_lora"] + mla["rope"])
        w.add_value_length(mla["kv_lora"])
        w.add_key_length_mla(mla["nope"] + mla["rope"])
        w.add_value_length_mla(mla["v"])
        w.add_rope_dimension_count(mla["rope"])
        w.add_expert_shared_count(ns)
        w.add_expert_weights_scale(2.5)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    else:
        w.add_head_count_kv(n_head_kv)
        w.add_rope_dimension_count(hd)
    if arch == "gpt-oss":
        w.add_sliding_window(64)
        w.add_expert_weights_scale(1.0)

    n_moe = L - n_dense
    emb, routers, _ = _router_design(rng, n_vocab, D, E, k, n_moe, router_margin)
    t = {}
    t["token_embd.weight"] = emb
    t["output_norm.weight"] = np.ones(D, np.float32)
    # output head: rows of byte, control and unused tokens are zero (logit 0), so greedy decoding emits
    # text pieces (a lone byte token is invalid UTF-8 and llama-cpp-python then never stops generating)
    t["output.weight"] = _normal(rng, (n_vocab, D), 1.0 / np.sqrt(D)) * normal[:, None].astype(np.float32)
    for il in range(L):
        p = f"blk.{il}."
        t[p + "attn_norm.weight"] = np.ones(D, np.float32)
        if arch == "deepseek2":
            qk = mla["nope"] + mla["rope"]
            t[p + "attn_kv_a_norm.weight"] = np.ones(mla["kv_lora"], np.float32)
            if lite:
                t[p + "attn_q.weight"] = _normal(rng, (n_head * qk, D), 1 / np.sqrt(D))
            else:
                t[p + "attn_q_a_norm.weight"] = np.ones(mla["q_lora"], np.float32)
                t[p + "attn_q_a.weight"] = _normal(rng, (mla["q_lora"], D), 1 / np.sqrt(D))
                t[p + "attn_q_b.weight"] = _normal(rng, (n_head * qk, mla["q_lora"]),
                                                   1 / np.sqrt(mla["q_lora"]))
            t[p + "attn_kv_a_mqa.weight"] = _normal(rng, (mla["kv_lora"] + mla["rope"], D), 1 / np.sqrt(D))
            t[p + "attn_k_b.weight"] = _normal(rng, (n_head, mla["kv_lora"], mla["nope"]), 1 / np.sqrt(mla["nope"]))
            t[p + "attn_v_b.weight"] = _normal(rng, (n_head, mla["v"], mla["kv_lora"]), 1 / np.sqrt(mla["kv_lora"]))
            t[p + "attn_output.weight"] = _normal(rng, (D, n_head * mla["v"]), s / np.sqrt(n_head * mla["v"]))
        else:
            t[p + "attn_q.weight"] = _normal(rng, (n_head * hd, D), 1 / np.sqrt(D))
            t[p + "attn_k.weight"] = _normal(rng, (n_head_kv * hd, D), 1 / np.sqrt(D))
            t[p + "attn_v.weight"] = _normal(rng, (n_head_kv * hd, D), 1 / np.sqrt(D))
            t[p + "attn_output.weight"] = _normal(rng, (D, n_head * hd), s / np.sqrt(n_head * hd))
            if arch == "qwen3moe":
                t[p + "attn_q_norm.weight"] = np.ones(hd, np.float32)
                t[p + "attn_k_norm.weight"] = np.ones(hd, np.float32)
            elif arch == "olmoe":
                t[p + "attn_q_norm.weight"] = np.ones(D, np.float32)
                t[p + "attn_k_norm.weight"] = np.ones(D, np.float32)
            elif arch == "gpt-oss":
                t[p + "attn_output.bias"] = np.zeros(D, np.float32)
                t[p + "attn_sinks.weight"] = _normal(rng, (n_head,), 0.5)
        if arch == "gpt-oss":
            t[p + "post_attention_norm.weight"] = np.ones(D, np.float32)
        else:
            t[p + "ffn_norm.weight"] = np.ones(D, np.float32)
        if il < n_dense:
            t[p + "ffn_gate.weight"] = _normal(rng, (n_ff_d, D), 1 / np.sqrt(D))
            t[p + "ffn_up.weight"] = _normal(rng, (n_ff_d, D), 1 / np.sqrt(D))
            t[p + "ffn_down.weight"] = _normal(rng, (D, n_ff_d), 2 * s / np.sqrt(n_ff_d))
            continue
        t[p + "ffn_gate_inp.weight"] = routers[il - n_dense]
        t[p + "ffn_gate_exps.weight"] = _normal(rng, (E, F, D), 1 / np.sqrt(D))
        t[p + "ffn_up_exps.weight"] = _normal(rng, (E, F, D), 1 / np.sqrt(D))
        t[p + "ffn_down_exps.weight"] = _normal(rng, (E, D, F), 2 * s / np.sqrt(F))
        if arch == "gpt-oss":
            t[p + "ffn_gate_inp.bias"] = np.zeros(E, np.float32)
            t[p + "ffn_gate_exps.bias"] = _normal(rng, (E, F), 0.05)
            t[p + "ffn_up_exps.bias"] = _normal(rng, (E, F), 0.05)
            t[p + "ffn_down_exps.bias"] = _normal(rng, (E, D), 0.05 * s)
        if arch in ("qwen2moe", "deepseek2"):
            fs = ns * F
            if arch == "qwen2moe":
                t[p + "ffn_gate_inp_shexp.weight"] = _normal(rng, (D,), 1 / np.sqrt(D))
            t[p + "ffn_gate_shexp.weight"] = _normal(rng, (fs, D), 1 / np.sqrt(D))
            t[p + "ffn_up_shexp.weight"] = _normal(rng, (fs, D), 1 / np.sqrt(D))
            t[p + "ffn_down_shexp.weight"] = _normal(rng, (D, fs), 2 * s / np.sqrt(fs))
    for name, arr in t.items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize_gguf(src, dst, base: str = "Q8_0", overrides: dict | None = None, nthread: int = 2,
                  verbose: bool = False) -> Path:
    """Quantize GGUF ``src`` into ``dst`` with llama.cpp's ``llama_model_quantize``.

    Args:
        base: llama.cpp file type name (key of ``FTYPES``) for all tensors not matched by ``overrides``.
        overrides: {regex searched in tensor names: ggml type name} (llama's ``tt_overrides``).
        nthread: quantizer threads (the output does not depend on it).
        verbose: also print llama.cpp's quantizer log (per-tensor types, fallbacks) to stderr; it is
            captured otherwise and its last lines go into the error message on failure.

    Raises:
        ValueError: unknown type names. RuntimeError: the quantizer returned non-zero.
    """
    import gguf

    llama_cpp = _llama_cpp()
    if base not in FTYPES:
        raise ValueError(f"unknown file type {base!r}; valid: {', '.join(FTYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_" + FTYPES[base])
    params.nthread = nthread
    keep = []
    if overrides:
        arr = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()
        for i, (pat, tname) in enumerate(overrides.items()):
            try:
                ttype = int(gguf.GGMLQuantizationType[tname.upper()])
            except KeyError:
                raise ValueError(f"unknown ggml type {tname!r}") from None
            b = pat.encode()
            keep.append(b)
            arr[i].pattern = b
            arr[i].type = ttype
        arr[len(overrides)].pattern = None
        keep.append(arr)
        params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    with _captured_output() as log:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if verbose:
        sys.stderr.write(log.text)
    if rc != 0:
        tail = " | ".join(log.text.strip().splitlines()[-3:])
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {base}) failed with {rc}: {tail}")
    return Path(dst)


class _captured_output:
    """Context manager collecting what llama.cpp prints (through llama_cpp's Python log callback, or
    straight to file descriptors 1/2) into ``.text`` instead of the terminal."""

    def __enter__(self):
        import io

        self.text = ""
        self._buf = io.StringIO()
        self._old = sys.stdout, sys.stderr
        sys.stdout.flush()
        sys.stderr.flush()
        self._tmp = tempfile.TemporaryFile(mode="w+b")
        self._saved = [os.dup(1), os.dup(2)]
        os.dup2(self._tmp.fileno(), 1)
        os.dup2(self._tmp.fileno(), 2)
        sys.stdout = sys.stderr = self._buf
        return self

    def __exit__(self, *exc):
        sys.stdout, sys.stderr = self._old
        for fd, saved in zip((1, 2), self._saved):
            os.dup2(saved, fd)
            os.close(saved)
        self._tmp.seek(0)
        self.text = self._buf.getvalue() + self._tmp.read().decode(errors="replace")
        self._tmp.close()
        return False


def fixture_set() -> dict:
    """Recommended knob sets: ``{(arch, quant): kwargs for make_tiny_model}`` for the five MoE archs with
    ``"Q8_0"`` (small: D=64, F=32) and ``"Q4_K_M"`` (K-quant rows: D=256, F=256). They cover non-power-of-two
    expert counts (6, 60), top-1 routing and shared experts. Use as ``make_tiny_model(p, **kw)``."""
    q8 = {
        "qwen3moe": dict(n_expert=8, n_expert_used=2),
        "qwen2moe": dict(n_expert=60, n_expert_used=4, n_shared=1),
        "olmoe": dict(n_expert=6, n_expert_used=2),
        "llama": dict(n_expert=8, n_expert_used=1),
        "deepseek2": dict(n_layer=3, n_expert=6, n_expert_used=2, n_shared=1, n_dense_lead=1),
    }
    q4 = {
        "qwen3moe": dict(n_expert=8, n_expert_used=2),
        "qwen2moe": dict(n_expert=6, n_expert_used=2, n_shared=1),
        "olmoe": dict(n_expert=6, n_expert_used=1),
        "llama": dict(n_expert=4, n_expert_used=2),
        "deepseek2": dict(n_layer=3, n_expert=6, n_expert_used=2, n_shared=1, n_dense_lead=1),
    }
    out = {}
    for arch, kw in q8.items():
        out[(arch, "Q8_0")] = dict(arch=arch, n_embd=64, n_ff_exp=32, quant="Q8_0", **kw)
    for arch, kw in q4.items():
        out[(arch, "Q4_K_M")] = dict(arch=arch, n_embd=256, n_ff_exp=256, quant="Q4_K_M", **kw)
    return out


# --------------------------------------------------------------------------------------------------------
# full-size synthetic models: quantized blocks written directly
# --------------------------------------------------------------------------------------------------------

# DeepSeek-V2-Lite's shape (config.json of deepseek-ai/DeepSeek-V2-Lite): the defaults of make_synthetic_model,
# except n_layer (27 there; fewer here, so a benchmark model fits a short GPU session)
DSV2_LITE_SHAPE = dict(n_embd=2048, n_ff_exp=1408, n_ff_dense=10944, n_expert=64, n_expert_used=6, n_shared=2,
                       n_head=16, kv_lora_rank=512, qk_rope=64, qk_nope=128, v_head=128, n_dense_lead=1)

# fallback of a 256-wide type when a row length is not a multiple of 256 (llama-quant.cpp, tensor_type_fallback)
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def q4_k_m_type(name: str, ne0: int, n_layer: int) -> str:
    """The ggml type upstream's ``Q4_K_M`` file type gives tensor ``name`` (row length ``ne0`` elements) of a
    deepseek2 model with ``n_layer`` blocks; the rules of llama.cpp's ``llama_tensor_get_type`` that apply to
    that architecture, restated:

    - not quantized (F32): 1-D tensors, ``*_norm.weight``, the router ``ffn_gate_inp``;
    - ``output.weight``: Q6_K; every other tensor Q4_K, except
    - ``ffn_down*`` (dense, ``_exps`` and ``_shexp``) of the layers where ``use_more_bits(il, n_layer)`` holds
      (``il < n/8``, ``il >= 7n/8`` or ``(il - n/8) % 3 == 2``): Q6_K;
    - then the row-length fallback: a 256-wide type on rows that are not a multiple of 256 becomes Q4_K -> Q5_0,
      Q6_K -> Q8_0 (DeepSeek-V2-Lite's ``ffn_down_exps``, rows of 1408), and F16 if even 32 does not divide.

    Not restated: upstream's special case for models with exactly 8 experts (``attn_output`` Q5_K);
    ``make_synthetic_model`` refuses ``n_expert == 8`` with Q4_K_M.
    """
    if name.endswith("_norm.weight") or "ffn_gate_inp" in name or not name.endswith(".weight"):
        return "F32"
    if name == "output.weight":
        t = "Q6_K"
    elif "ffn_down" in name:
        il = int(name.split(".")[1])
        n8 = n_layer // 8
        t = "Q6_K" if (il < n8 or il >= 7 * n_layer // 8 or (il - n8) % 3 == 2) else "Q4_K"
    else:
        t = "Q4_K"
    if ne0 % 256:
        t = _FALLBACK.get(t, t)
        if ne0 % 32:
            t = "F16"
    return t


def _rms(values: np.ndarray) -> float:
    return float(np.sqrt(np.mean(values.astype(np.float64) ** 2)))


def random_quant_rows(rng: np.random.Generator, type_name: str, n_rows: int, row_len: int,
                      std: float) -> np.ndarray:
    """``n_rows`` rows of ``row_len`` weights of ggml type ``type_name`` with random but valid content.

    Quantized types come back as raw blocks, uint8 ``[n_rows, row_len / block * type_size]``: random quants,
    finite fp16 scales, arranged so that the dequantized weights have mean ~0 and standard deviation ~``std``
    (each block's scale jittered by 0.75-1.25x, with a random sign). Q4_K: ``d`` and ``dmin = 7.5 d`` with equal 6-bit scale and
    min per sub-block (16..63), so ``w = d * sc * (q - 7.5)``; Q6_K: int8 sub-block scales 16..127,
    ``w = d * sc * (q - 32)``; Q5_0: ``w = d * (q - 16)``; Q8_0: ``w = d * q``. F32/F16 come back as float arrays
    ``[n_rows, row_len]`` of normal values.

    Raises:
        ValueError: a type this writer does not make, or ``row_len`` not a multiple of its block size.
    """
    import gguf

    if type_name in ("F32", "F16"):
        a = rng.standard_normal((n_rows, row_len), dtype=np.float32) * np.float32(std)
        return a if type_name == "F32" else a.astype(np.float16)
    if type_name not in ("Q4_K", "Q5_0", "Q6_K", "Q8_0"):
        raise ValueError(f"random_quant_rows: no writer for type {type_name!r} (Q4_K, Q5_0, Q6_K, Q8_0, F16, F32)")
    blk, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    if row_len % blk:
        raise ValueError(f"{type_name} needs rows that are a multiple of {blk}, got {row_len}")
    nb = n_rows * (row_len // blk)
    b = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    # per-block scale jitter, and a random sign: quants like Q5_0's (q - 16) have mean -0.5, not 0
    jitter = rng.uniform(0.75, 1.25, size=nb) * rng.choice(np.array([-1.0, 1.0]), size=nb)

    def fp16(x):
        return np.asarray(x, dtype=np.float16).reshape(-1, 1).view(np.uint8)

    if type_name == "Q8_0":   # d, qs[32] int8
        d = std / _rms(np.arange(-128, 128)) * jitter
        b[:, 0:2] = fp16(d)
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


def synthetic_tensor_plan(*, n_layer: int, n_embd: int, n_ff_exp: int, n_ff_dense: int, n_expert: int,
                          n_shared: int, n_head: int, kv_lora_rank: int, qk_rope: int, qk_nope: int, v_head: int,
                          n_dense_lead: int, n_vocab: int = N_VOCAB, quant: str = "Q4_K_M",
                          residual_scale: float = 0.15) -> list[tuple[str, tuple, str, float]]:
    """The tensors of a deepseek2 model (MLA attention without a query low-rank projection, like
    DeepSeek-V2-Lite), in file order: ``(name, ggml shape {ne0, ne1, ne2}, ggml type name, weight std)``.
    ``quant`` ``"Q4_K_M"`` takes the types of :func:`q4_k_m_type`, ``"F32"`` writes every tensor as F32."""
    D, F, E, H = n_embd, n_ff_exp, n_expert, n_head
    s = residual_scale
    qk = qk_nope + qk_rope

    def ty(name, shape):
        return "F32" if quant == "F32" or len(shape) == 1 else q4_k_m_type(name, shape[0], n_layer)

    plan = []

    def add(name, shape, std):
        plan.append((name, tuple(int(x) for x in shape), ty(name, shape), float(std)))

    add("token_embd.weight", (D, n_vocab), 1.0)
    add("output_norm.weight", (D,), 0.0)
    add("output.weight", (D, n_vocab), 1 / np.sqrt(D))
    for il in range(n_layer):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", (D,), 0.0)
        add(p + "attn_q.weight", (D, H * qk), 1 / np.sqrt(D))
        add(p + "attn_kv_a_mqa.weight", (D, kv_lora_rank + qk_rope), 1 / np.sqrt(D))
        add(p + "attn_kv_a_norm.weight", (kv_lora_rank,), 0.0)
        add(p + "attn_k_b.weight", (qk_nope, kv_lora_rank, H), 1 / np.sqrt(qk_nope))
        add(p + "attn_v_b.weight", (kv_lora_rank, v_head, H), 1 / np.sqrt(kv_lora_rank))
        add(p + "attn_output.weight", (H * v_head, D), s / np.sqrt(H * v_head))
        add(p + "ffn_norm.weight", (D,), 0.0)
        if il < n_dense_lead:
            add(p + "ffn_gate.weight", (D, n_ff_dense), 1 / np.sqrt(D))
            add(p + "ffn_up.weight", (D, n_ff_dense), 1 / np.sqrt(D))
            add(p + "ffn_down.weight", (n_ff_dense, D), 2 * s / np.sqrt(n_ff_dense))
            continue
        add(p + "ffn_gate_inp.weight", (D, E), 1 / np.sqrt(D))
        add(p + "ffn_gate_exps.weight", (D, F, E), 1 / np.sqrt(D))
        add(p + "ffn_up_exps.weight", (D, F, E), 1 / np.sqrt(D))
        add(p + "ffn_down_exps.weight", (F, D, E), 2 * s / np.sqrt(F))
        add(p + "ffn_gate_shexp.weight", (D, F * n_shared), 1 / np.sqrt(D))
        add(p + "ffn_up_shexp.weight", (D, F * n_shared), 1 / np.sqrt(D))
        add(p + "ffn_down_shexp.weight", (F * n_shared, D), 2 * s / np.sqrt(F * n_shared))
    return plan


def make_synthetic_model(path, *, quant: str = "Q4_K_M", seed: int = 0, n_layer: int = 8,
                         n_embd: int = 2048, n_ff_exp: int = 1408, n_ff_dense: int = 10944, n_expert: int = 64,
                         n_expert_used: int = 6, n_shared: int = 2, n_head: int = 16, kv_lora_rank: int = 512,
                         qk_rope: int = 64, qk_nope: int = 128, v_head: int = 128, n_dense_lead: int = 1,
                         residual_scale: float = 0.15, n_ctx_train: int = 4096, progress: bool = False) -> Path:
    """Write a full-size deepseek2 MoE GGUF (DeepSeek-V2-Lite's shape by default, ``n_layer`` blocks) with random
    weights whose quantized blocks are written directly (:func:`random_quant_rows`), not quantized from floats:
    a model of several GB is written in seconds without tens of GB of floats. For benchmarks (speed, memory,
    cache behaviour with routing replay), not for text: the router is random, so without replay routing is
    arbitrary, and the tokenizer is the tiny 512-token one of :func:`make_tiny_model`.

    Args:
        path: output file (parent directories are created; written to a temporary file, then renamed).
        quant: ``"Q4_K_M"``: each tensor gets the type upstream's Q4_K_M gives it (:func:`q4_k_m_type`; e.g.
            ``ffn_gate_exps``/``ffn_up_exps`` Q4_K, ``ffn_down_exps`` Q5_0 or, in Q6_K layers, Q8_0 when
            ``n_ff_exp`` is not a multiple of 256); ``"F32"``: every tensor F32 (small models, e.g. to check
            the type plan against llama.cpp's quantizer).
        seed: RNG seed; the same arguments give a byte-identical file.
        n_layer: blocks, the first ``n_dense_lead`` with a dense FFN of width ``n_ff_dense``, the others MoE.
        n_embd: hidden size D; n_ff_exp: routed (and each shared) expert width F; n_expert: routed experts E;
        n_expert_used: top-k; n_shared: shared experts (one FFN of width ``n_shared * F`` per MoE layer).
        n_head, kv_lora_rank, qk_rope, qk_nope, v_head: MLA attention (queries without low-rank projection:
            ``attention.q_lora_rank`` 0).
        residual_scale: weight scale of the projections into the residual stream (as ``make_tiny_model``).
        progress: print one line per written layer to stderr.

    Sizes: with the defaults each MoE layer holds 64 x (2 x 2048 x 1408 Q4_K + 1408 x 2048 Q5_0/Q8_0) expert
    weights, 334-396 MiB, so 8 blocks come to about 2.5 GiB.

    Raises:
        ValueError: unknown ``quant``, inconsistent sizes (k > E, n_dense_lead >= n_layer, rows that fit no
            block size), or a shape whose type this writer cannot make.
    """
    import gguf

    if quant not in ("Q4_K_M", "F32"):
        raise ValueError(f"make_synthetic_model: quant must be 'Q4_K_M' or 'F32', got {quant!r}")
    if not 1 <= n_expert_used <= n_expert:
        raise ValueError(f"n_expert_used must be in 1..n_expert ({n_expert}), got {n_expert_used}")
    if not 0 <= n_dense_lead < n_layer:
        raise ValueError(f"n_dense_lead must be in 0..n_layer-1 ({n_layer - 1}), got {n_dense_lead}")
    if n_shared < 1:
        raise ValueError("deepseek2 needs n_shared >= 1")
    if quant == "Q4_K_M" and n_expert == 8:
        raise ValueError("n_expert 8: upstream's Q4_K_M has a special case for 8-expert models that "
                         "q4_k_m_type does not restate; use another expert count")
    plan = synthetic_tensor_plan(n_layer=n_layer, n_embd=n_embd, n_ff_exp=n_ff_exp, n_ff_dense=n_ff_dense,
                                 n_expert=n_expert, n_shared=n_shared, n_head=n_head, kv_lora_rank=kv_lora_rank,
                                 qk_rope=qk_rope, qk_nope=qk_nope, v_head=v_head, n_dense_lead=n_dense_lead,
                                 quant=quant, residual_scale=residual_scale)
    for name, shape, t, _ in plan:
        if t not in ("F32", "F16") and shape[0] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0]:
            raise ValueError(f"{name}: rows of {shape[0]} do not fit {t} blocks")
        if t == "F16" and quant == "Q4_K_M":
            raise ValueError(f"{name}: rows of {shape[0]} are not a multiple of 32 (upstream would write F16)")

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".tmp.gguf", dir=str(path.parent))
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, "deepseek2")
        w.add_name("hybrimoe-synthetic-deepseek2")
        _write_tokenizer(w, "spm")
        w.add_context_length(n_ctx_train)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff_dense)
        w.add_expert_feed_forward_length(n_ff_exp)
        w.add_head_count(n_head)
        w.add_head_count_kv(1)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(10000.0)
        w.add_rope_dimension_count(qk_rope)
        w.add_leading_dense_block_count(n_dense_lead)
        w.add_q_lora_rank(0)
        w.add_kv_lora_rank(kv_lora_rank)
        w.add_key_length(kv_lora_rank + qk_rope)
        w.add_value_length(kv_lora_rank)
        w.add_key_length_mla(qk_nope + qk_rope)
        w.add_value_length_mla(v_head)
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_shared_count(n_shared)
        w.add_expert_weights_scale(1.0)
        w.add_expert_weights_norm(False)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if quant == "Q4_K_M" else gguf.LlamaFileType.ALL_F32)
        for name, shape, t, _ in plan:  # tensor infos first; the data follows tensor by tensor (streamed)
            qt = gguf.GGMLQuantizationType[t]
            blk, size = gguf.GGML_QUANT_SIZES[qt]
            rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
            nbytes = rows * shape[0] // blk * size
            np_shape = tuple(reversed(shape))
            if t in ("F32", "F16"):
                w.add_tensor_info(name, np_shape, np.dtype(np.float32 if t == "F32" else np.float16), nbytes)
            else:
                w.add_tensor_info(name, np_shape[:-1] + (shape[0] // blk * size,), np.dtype(np.uint8), nbytes,
                                  raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (name, shape, t, std) in enumerate(plan):
            rng = np.random.default_rng([seed, i])
            rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
            if len(shape) == 1:  # norm weights
                data = np.ones(shape[0], np.float32)
            else:
                data = random_quant_rows(rng, t, rows, shape[0], std)
            w.write_tensor_data(data)
            if progress and name.endswith("ffn_down_shexp.weight"):
                print(f"make_synthetic_model: wrote {name.split('.')[0]}.{name.split('.')[1]}", file=sys.stderr)
        w.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


# --------------------------------------------------------------------------------------------------------
# CLI: hybrimoe make-tiny-model
# --------------------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``make-tiny-model`` arguments to ``parser``."""
    parser.add_argument("out", metavar="OUT.gguf", help="output GGUF file")
    parser.add_argument("--arch", default="qwen3moe", help=f"architecture: {', '.join(ARCHS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--n-embd", type=int, default=64, help="hidden size")
    parser.add_argument("--n-expert", type=int, default=None, help="routed experts per MoE layer")
    parser.add_argument("--n-expert-used", type=int, default=None, help="experts per token (top-k)")
    parser.add_argument("--n-ff-exp", type=int, default=32, help="expert FFN width")
    parser.add_argument("--n-shared", type=int, default=None, help="shared experts (qwen2moe, deepseek2)")
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-dense-lead", type=int, default=1, help="deepseek2: leading dense layers")
    parser.add_argument("--quant", default=None,
                        help="F32 (default), F16, Q8_0, Q4_K_M, ... or mix (gate Q4_K, up Q8_0, down Q6_K)")
    parser.add_argument("--tokenizer", default="spm", choices=TOKENIZERS)
    parser.add_argument("--router-margin", type=float, default=4.0, help="designed top-k router logit gap")


def run(args) -> int:
    """Run ``make-tiny-model``; returns 0, or 2 with a one-line error on stderr for bad input."""
    try:
        p = make_tiny_model(args.out, args.arch, seed=args.seed, n_layer=args.layers, n_embd=args.n_embd,
                            n_expert=args.n_expert, n_expert_used=args.n_expert_used, n_ff_exp=args.n_ff_exp,
                            n_shared=args.n_shared, n_head=args.n_head, n_dense_lead=args.n_dense_lead,
                            quant=args.quant, tokenizer=args.tokenizer, router_margin=args.router_margin)
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        print(f"hybrimoe make-tiny-model: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {p} ({p.stat().st_size} bytes)")
    return 0
