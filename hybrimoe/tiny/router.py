"""The designed router of the tiny models: token embeddings and router matrices with a wide top-k margin.

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
"""
from __future__ import annotations

import numpy as np


def router_design(rng: np.random.Generator, n_vocab: int, n_embd: int, n_expert: int, k: int, n_moe_layers: int,
                  router_margin: float) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """Token embeddings and per-MoE-layer router matrices with a designed top-k gap (module doc).

    Args:
        rng: the generator every random draw comes from, in a fixed order (the same state gives the same arrays).
        n_vocab: tokens V; n_embd: hidden size D; n_expert: experts E; k: experts per token (top-k);
        n_moe_layers: router matrices to make; router_margin: designed k-th to (k+1)-th logit gap (> 0).

    Returns:
        ``(emb, routers, assigned)``: ``emb`` float32 (V, D), unit RMS per row; ``routers`` n_moe_layers float32
        (E, D) arrays (numpy order: ggml's ``ffn_gate_inp`` ``{D, E}``); ``assigned`` int (V, k), the expert keys
        of each token, strongest first. With ``E <= 2 D`` the keys are orthonormal directions and their negations
        and every token gets the same gap; with more experts they overlap and each token's key set is the best
        of 64 random draws (wide but less uniform gaps).
    """
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
