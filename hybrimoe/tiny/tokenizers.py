"""The two tiny tokenizers of the tiny models: a SentencePiece-style ``llama`` vocab with byte fallback and a
GPT-2 byte-level BPE ``gpt2`` vocab with merges, both padded to ``N_VOCAB`` tokens.

Both hold the same word pieces (``WORDS`` and all their prefixes), so prompts made of those words tokenize into
whole words rather than bytes; the rest of the vocabulary is single characters (SPM) or byte symbols (BPE),
and unused padding tokens. Token types are gguf's ``TokenType`` values (llama.cpp's ``llama_token_type``).
"""
from __future__ import annotations

import gguf
import numpy as np

TOKENIZERS = ("spm", "bpe")
N_VOCAB = 512  # vocabulary size of both tokenizers (padded with unused tokens)

# the words whose pieces both vocabularies hold (hybrimoe.bench builds its prompts from them)
WORDS = ("the", "and", "is", "of", "to", "in", "a", "it", "was", "hello", "world", "once", "upon", "time",
          "there", "little", "model", "expert", "mixture", "cat", "dog", "run", "fast", "slow", "one", "two")


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """SentencePiece-style vocab: ``(tokens, scores, token_types)``, each of length ``N_VOCAB``.

    Ids 0/1/2 are ``<unk>``/``<s>``/``</s>``, then the 256 byte tokens ``<0xXX>`` (byte fallback), then single
    characters and ``▁``-prefixed word pieces with all their prefixes (the SPM tokenizer only reaches a piece
    through pieces already in the vocab), then ``<unusedN>`` padding. Scores are 0 for the special and byte
    tokens and grow with the piece length otherwise (longer pieces win), with a tiny id-ordered tie-break.
    """
    tt = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [tt.UNKNOWN, tt.CONTROL, tt.CONTROL] + [tt.BYTE] * 256
    pieces: list[str] = ["▁"]
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;()"
    pieces += list(chars)
    for w in WORDS:
        for i in range(1, len(w) + 1):
            pieces.append("▁" + w[:i])
        for i in range(2, len(w) + 1):
            pieces.append(w[:i])
    seen = set(tokens)
    for p in pieces:
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(tt.NORMAL)
    while len(tokens) < N_VOCAB:  # pad to a fixed size with unused tokens
        tokens.append(f"<unused{len(tokens)}>")
        types.append(tt.UNUSED)
    scores = [0.0] * 259 + [float(len(t)) - 1e-4 * i for i, t in enumerate(tokens[259:])]
    return tokens, scores, [int(t) for t in types]


def _bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    """GPT-2 byte-level BPE vocab: ``(tokens, token_types, merges)``, tokens and types of length ``N_VOCAB``.

    The 256 byte symbols (GPT-2's byte-to-unicode table, ``gguf.vocab.bytes_to_unicode``), then the word pieces
    reached by merging left to right (``Ġ`` marks a leading space; one merge ``"a b"`` per new piece), then
    ``<|endoftext|>`` (bos and eos), then ``<|unusedN|>`` padding.
    """
    from gguf.vocab import bytes_to_unicode

    tt = gguf.TokenType
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges: list[str] = []
    seen = set(tokens)
    for w in WORDS:
        for word in ("Ġ" + w, w):
            cur = word[0]
            for ch in word[1:]:
                new = cur + ch
                if new not in seen:
                    merges.append(f"{cur} {ch}")
                    seen.add(new)
                    tokens.append(new)
                cur = new
    types = [tt.NORMAL] * len(tokens)
    tokens.append("<|endoftext|>")
    types.append(tt.CONTROL)
    while len(tokens) < N_VOCAB:
        tokens.append(f"<|unused{len(tokens)}|>")
        types.append(tt.UNUSED)
    return tokens, [int(t) for t in types], merges


def _write_tokenizer(w, tokenizer: str) -> np.ndarray:
    """Write the ``tokenizer.ggml.*`` keys of ``tokenizer`` (``"spm"`` or ``"bpe"``) with gguf writer ``w``.

    Returns:
        bool array ``(N_VOCAB,)``: True for normal (text piece) tokens, False for byte, control and unused ones.

    Raises:
        ValueError: unknown ``tokenizer``.
    """
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
    return np.array(types) == int(gguf.TokenType.NORMAL)
