"""Blockwise causal attention with an online softmax (--model.attention blockwise):
FlashAttention's algorithm (Dao et al. 2022, arXiv:2205.14135; the backward of
FlashAttention-2, arXiv:2307.08691) in plain JAX, for MLA's scores. Shape legend:
model.py's docstring; here t and s are the queries and keys of one block.

The plain attention (model.py) holds the scores [B, H, T, S] of every head at once,
and autodiff keeps the probabilities of the same size for the backward pass: memory
that grows with T^2. Here queries are taken in blocks of `block`, and each query block
walks over the key blocks with a running max m, a running sum of exponentials l and a
running weighted sum of values (the online softmax), so only one [B, H, t, s] block of
scores exists at a time. The backward pass is written by hand (custom_vjp): it keeps
only the output and the log-sum-exp per query, recomputes each block's scores, and
accumulates the gradients block by block. So neither pass holds anything [T, S].

MLA's score is a content part and a RoPE part: q_nope . k_nope per head plus q_rope .
k_rope, the RoPE key shared by every head (decoupled RoPE). The mask is causal over
GLOBAL positions (q_pos_T, k_pos_S): a query sees the keys at or before its position.
Under context parallelism a device's queries are two chunks of the sequence and its
keys the whole sequence, so the positions are not 0..T-1. Packed rows (ops/packing.py)
also hide every key of another document (segments_bT: each row's document ids). A block
pair in which every key comes after every query is skipped (lax.cond): its probabilities
are exactly 0, so skipping it changes no number.
"""

import functools
import math

import jax
import jax.numpy as jnp

from ops.collectives import varying_like

ACC_DTYPE = jnp.float32  # scores, softmax statistics and accumulators


def blockwise_attention(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, k_pos_S, scale, block,
                        segments_bT=None):
    """Causal softmax(scale (q_nope . k_nope + q_rope . k_rope)) v over key blocks: out [B, T, H, K].
    q_pos_T / k_pos_S: the global positions of the queries / keys; segments_bT: packed rows'
    document ids at every position of the whole rows, or None. `block` must divide T and S
    (utils.validate_model checks --model.attention_block); one longer than T or S is cut to it."""
    return blockwise_attention_and_max_logits(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, k_pos_S,
                                              scale, block, segments_bT)[0]


def blockwise_attention_and_max_logits(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, k_pos_S, scale, block,
                                       segments_bT=None):
    """(blockwise_attention's output, each head's largest scaled score [H]): the online
    softmax's running max, which the forward keeps anyway (no gradient flows through it)."""
    block = min(block, q_pos_T.shape[0], k_pos_S.shape[0])
    # The positions are constants (arange, or cp's chunk positions), so without this tie
    # the partial evaluation of an enclosing loop (apply_blocks' scan over blocks) computes
    # everything that depends on them alone ahead of the loop: every block pair's causal
    # mask and -inf fill, broadcast to [B, H, t, s] and stacked [T/block, S/block, ...],
    # kept for the backward pass: at T = 32768 and cp 8, 4 GiB of float32 and 1 GiB of
    # masks per device in the compiled TPU step (docs/planning.md, "Long sequences").
    q_pos_T, k_pos_S, q_nope_BTHK = jax.lax.optimization_barrier((q_pos_T, k_pos_S, q_nope_BTHK))
    out_BTHK, max_nBHt = _attention(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, k_pos_S, segments_bT,
                                    scale, block)
    return out_BTHK, jnp.max(jax.lax.stop_gradient(max_nBHt), axis=(0, 1, 3))


def max_logits(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, q_pos_T, k_pos_S, scale, block, segments_bT=None):
    """Each head's largest scaled score [H], a block of queries at a time against every
    key (for an attention that does not hand its scores out: [B, H, block, S] at once)."""
    block = math.gcd(block, q_pos_T.shape[0])
    k_nope_BHSK = k_nope_BSHK.transpose(0, 2, 1, 3)

    keys_at = (k_pos_S, None if segments_bT is None else segments_bT[:, k_pos_S])  # (one block: every key)

    def one_query_block(query):
        q_nope_BHtK, q_rope_BHtR, q_at = query
        scores_BHtS = block_scores(q_nope_BHtK, q_rope_BHtR, q_at, k_nope_BHSK, k_rope_BSR, keys_at, scale)
        return jnp.max(scores_BHtS, axis=(0, 2, 3))

    queries = (query_blocks(q_nope_BTHK, block), query_blocks(q_rope_BTHR, block), position_blocks(q_pos_T, segments_bT, block))
    return jnp.max(jax.lax.map(one_query_block, queries), axis=0)


# ---- Blocks: heads-major, so each product is a batch of plain 2-D matmuls


def query_blocks(x_BTHx, block):
    """[B, T, H, X] -> [T/block, B, H, block, X]."""
    B, T, H, X = x_BTHx.shape
    return x_BTHx.reshape(B, T // block, block, H, X).transpose(1, 0, 3, 2, 4)


def key_blocks(k_nope_BSHK, k_rope_BSR, v_BSHK, k_pos_S, segments_bT, block):
    B, S, H, K = k_nope_BSHK.shape
    return (query_blocks(k_nope_BSHK, block), k_rope_BSR.reshape(B, S // block, block, -1).transpose(1, 0, 2, 3),
            query_blocks(v_BSHK, block), position_blocks(k_pos_S, segments_bT, block))


def position_blocks(pos_T, segments_bT, block):
    """What the mask reads of each block of positions: (positions [T/block, block], their document ids
    [T/block, b, block], or None when rows are not packed)."""
    if segments_bT is None:
        return pos_T.reshape(-1, block), None
    b, n = segments_bT.shape[0], pos_T.shape[0] // block
    return pos_T.reshape(n, block), segments_bT[:, pos_T].reshape(b, n, block).transpose(1, 0, 2)


def unblock(x_nBHtX):
    """[T/block, B, H, block, X] -> [B, T, H, X]."""
    n, B, H, t, X = x_nBHtX.shape
    return x_nBHtX.transpose(1, 0, 3, 2, 4).reshape(B, n * t, H, X)


def block_scores(q_nope_BHtK, q_rope_BHtR, q_at, k_nope_BHsK, k_rope_BsR, k_at, scale):
    """Scaled scores of one block pair [B, H, t, s], float32, -inf where the key comes after the query
    or (packed rows) lies in another document. q_at, k_at: position_blocks' of the block."""
    scores = jnp.matmul(q_nope_BHtK, k_nope_BHsK.swapaxes(-1, -2), preferred_element_type=ACC_DTYPE)
    scores += jnp.einsum("bhtr,bsr->bhts", q_rope_BHtR, k_rope_BsR, preferred_element_type=ACC_DTYPE)
    return jnp.where(visible_keys(q_at, k_at), scores * scale, -jnp.inf)


def visible_keys(q_at, k_at):
    """[t, s] (packed rows: [B, 1, t, s]): does the query see the key, at or before it
    (and in its document)? q_at, k_at: (positions, document ids or None) of a block."""
    (q_pos_t, q_seg_Bt), (k_pos_s, k_seg_Bs) = q_at, k_at
    visible = k_pos_s[None, :] <= q_pos_t[:, None]
    if q_seg_Bt is not None:
        visible = visible & (q_seg_Bt[:, :, None] == k_seg_Bs[:, None, :])[:, None]
    return visible


def max_joined_scores(q_BHTW, k_BHSW, q_pos_T, k_pos_S, block, segments=None):
    """Each head's largest score [H], float32, of queries and keys that carry the whole
    score in one head dim, the queries already scaled (splash's operands: [content |
    RoPE]), a block of queries at a time against every key. One matmul per block, which
    the TPU compiler fuses with the mask and the max: no [t, S] scores are written
    (max_logits, with the content and RoPE parts apart, writes the first's for the second
    to add to).
    segments: packed rows' document ids, (the queries' [B, T], the keys' [B, S]), or None."""
    B, H, T, W = q_BHTW.shape
    block = math.gcd(block, T)
    n = T // block
    q_nBHtW = q_BHTW.reshape(B, H, n, block, W).transpose(2, 0, 1, 3, 4)
    q_seg_nBt, k_seg_BS = (None, None) if segments is None else (segments[0].reshape(B, n, block).transpose(1, 0, 2), segments[1])

    def one_query_block(query):
        q_BHtW, q_pos_t, q_seg_Bt = query
        scores_BHtS = jnp.matmul(q_BHtW, k_BHSW.swapaxes(-1, -2), preferred_element_type=ACC_DTYPE)
        visible = visible_keys((q_pos_t, q_seg_Bt), (k_pos_S, k_seg_BS))
        return jnp.max(jnp.where(visible, scores_BHtS, -jnp.inf), axis=(0, 2, 3))

    return jnp.max(jax.lax.map(one_query_block, (q_nBHtW, q_pos_T.reshape(n, block), q_seg_nBt)), axis=0)


def max_causal_scores(q_BHTW, k_BHSW, block):
    """max_joined_scores where query t sees keys 0..t of the same T positions (no context
    parallelism, no packed rows): a block of queries meets only the keys up to its own
    end, the block on the diagonal masked and those before it not. Slices with static
    bounds, unrolled (2 T/block - 1 matmuls): no relayout of the queries into blocks,
    about half the score FLOPs, and a mask only where the diagonal runs (on a TPU the
    masking, not the matmul, is most of the time: docs/pods.md)."""
    T = q_BHTW.shape[2]
    block = math.gcd(block, T)
    visible_tt = jnp.tril(jnp.ones((block, block), bool))
    maxima_H = []
    for start in range(0, T, block):
        q_BHtW = q_BHTW[:, :, start:start + block]
        diagonal_BHtt = jnp.matmul(q_BHtW, k_BHSW[:, :, start:start + block].swapaxes(-1, -2), preferred_element_type=ACC_DTYPE)
        maxima_H.append(jnp.max(jnp.where(visible_tt, diagonal_BHtt, -jnp.inf), axis=(0, 2, 3)))
        if start:
            before_BHts = jnp.matmul(q_BHtW, k_BHSW[:, :, :start].swapaxes(-1, -2), preferred_element_type=ACC_DTYPE)
            maxima_H.append(jnp.max(before_BHts, axis=(0, 2, 3)))
    return jnp.max(jnp.stack(maxima_H), axis=0)


def any_visible(q_at, k_at):
    """Does any query of the block come at or after any key of the block? (Else the pair is skipped.)"""
    return jnp.min(k_at[0]) <= jnp.max(q_at[0])


# ---- Forward: the online softmax


def forward(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, k_pos_S, segments_bT, scale, block):
    """(out [B, T, H, K], log-sum-exp of each query's scores [T/block, B, H, block], and
    their max, the same shape)."""
    keys = key_blocks(k_nope_BSHK, k_rope_BSR, v_BSHK, k_pos_S, segments_bT, block)

    def one_query_block(query):
        q_nope_BHtK, q_rope_BHtR, q_at = query

        def visit(carry, key):
            def update(carry):
                max_BHt, sum_BHt, acc_BHtK = carry
                k_nope_BHsK, k_rope_BsR, v_BHsK, k_at = key
                scores_BHts = block_scores(q_nope_BHtK, q_rope_BHtR, q_at, k_nope_BHsK, k_rope_BsR, k_at, scale)
                new_max_BHt = jnp.maximum(max_BHt, jnp.max(scores_BHts, axis=-1))
                # A row that has seen no key yet keeps max -inf: subtract 0 there, not -inf (nan).
                shift_BHt = jnp.where(jnp.isfinite(new_max_BHt), new_max_BHt, 0.0)
                probs_BHts = jnp.exp(scores_BHts - shift_BHt[..., None])
                rescale_BHt = jnp.exp(max_BHt - shift_BHt)  # the earlier blocks' share, under the new max
                acc_BHtK = acc_BHtK * rescale_BHt[..., None] + jnp.matmul(
                    probs_BHts.astype(v_BHsK.dtype), v_BHsK, preferred_element_type=ACC_DTYPE)
                return new_max_BHt, sum_BHt * rescale_BHt + jnp.sum(probs_BHts, axis=-1), acc_BHtK
            return jax.lax.cond(any_visible(q_at, key[3]), update, lambda c: c, carry), None

        B, H, t, K = q_nope_BHtK.shape
        init = (jnp.full((B, H, t), -jnp.inf, ACC_DTYPE), jnp.zeros((B, H, t), ACC_DTYPE), jnp.zeros((B, H, t, K), ACC_DTYPE))
        init = varying_like(init, q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, k_pos_S,
                            *jax.tree.leaves(segments_bT))
        max_BHt, sum_BHt, acc_BHtK = jax.lax.scan(visit, init, keys)[0]
        return acc_BHtK / sum_BHt[..., None], max_BHt + jnp.log(sum_BHt), max_BHt

    queries = (query_blocks(q_nope_BTHK, block), query_blocks(q_rope_BTHR, block), position_blocks(q_pos_T, segments_bT, block))
    out_nBHtK, lse_nBHt, max_nBHt = jax.lax.map(one_query_block, queries)
    return unblock(out_nBHtK).astype(q_nope_BTHK.dtype), lse_nBHt, max_nBHt


# ---- The gradient, block by block (FlashAttention-2's backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _attention(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, k_pos_S, segments_bT, scale, block):
    """(out, the max of each query's scores [T/block, B, H, block]: a metric, no cotangent)."""
    out_BTHK, _, max_nBHt = forward(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, k_pos_S, segments_bT,
                                    scale, block)
    return out_BTHK, max_nBHt


def _attention_fwd(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, k_pos_S, segments_bT, scale, block):
    out_BTHK, lse_nBHt, max_nBHt = forward(q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, k_pos_S,
                                           segments_bT, scale, block)
    return (out_BTHK, max_nBHt), (q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, k_pos_S, segments_bT,
                                  out_BTHK, lse_nBHt)


def _attention_bwd(scale, block, saved, cotangents):
    """Per key block (outer loop) and query block (inner loop), with P the block's
    probabilities recomputed from the saved log-sum-exp: dV += P^T dO,
    dS = P (dO V^T - rowsum(dO * O)) scale, dQ += dS K, dK += dS^T Q. The key block's
    dK, dV are the inner loop's carry; dQ of every query block is the outer loop's."""
    q_nope_BTHK, q_rope_BTHR, k_nope_BSHK, k_rope_BSR, v_BSHK, q_pos_T, k_pos_S, segments_bT, out_BTHK, lse_nBHt = saved
    d_out_BTHK = cotangents[0]  # (the max logits are a metric: their cotangent is zero)
    dtype = q_nope_BTHK.dtype
    delta_nBHt = query_blocks(jnp.sum(d_out_BTHK.astype(ACC_DTYPE) * out_BTHK.astype(ACC_DTYPE), axis=-1, keepdims=True), block)[..., 0]
    queries = (query_blocks(q_nope_BTHK, block), query_blocks(q_rope_BTHR, block), position_blocks(q_pos_T, segments_bT, block),
               query_blocks(d_out_BTHK.astype(dtype), block), lse_nBHt, delta_nBHt)

    def one_key_block(d_queries, key):
        k_nope_BHsK, k_rope_BsR, v_BHsK, k_at = key

        def visit(carry, query_and_index):
            query, i = query_and_index
            q_nope_BHtK, q_rope_BHtR, q_at, d_out_BHtK, lse_BHt, delta_BHt = query

            def update(carry):
                (d_q_nope_nBHtK, d_q_rope_nBHtR), (d_k_nope_BHsK, d_k_rope_BsR, d_v_BHsK) = carry
                scores_BHts = block_scores(q_nope_BHtK, q_rope_BHtR, q_at, k_nope_BHsK, k_rope_BsR, k_at, scale)
                probs_BHts = jnp.exp(scores_BHts - lse_BHt[..., None])  # 0 where masked
                d_v_BHsK += jnp.matmul(probs_BHts.astype(dtype).swapaxes(-1, -2), d_out_BHtK, preferred_element_type=ACC_DTYPE)
                d_probs_BHts = jnp.matmul(d_out_BHtK, v_BHsK.swapaxes(-1, -2), preferred_element_type=ACC_DTYPE)
                d_scores_BHts = (probs_BHts * (d_probs_BHts - delta_BHt[..., None]) * scale).astype(dtype)
                d_q_nope_nBHtK = d_q_nope_nBHtK.at[i].add(jnp.matmul(d_scores_BHts, k_nope_BHsK, preferred_element_type=ACC_DTYPE))
                d_q_rope_nBHtR = d_q_rope_nBHtR.at[i].add(
                    jnp.einsum("bhts,bsr->bhtr", d_scores_BHts, k_rope_BsR, preferred_element_type=ACC_DTYPE))
                d_k_nope_BHsK += jnp.matmul(d_scores_BHts.swapaxes(-1, -2), q_nope_BHtK, preferred_element_type=ACC_DTYPE)
                d_k_rope_BsR += jnp.einsum("bhts,bhtr->bsr", d_scores_BHts, q_rope_BHtR, preferred_element_type=ACC_DTYPE)
                return (d_q_nope_nBHtK, d_q_rope_nBHtR), (d_k_nope_BHsK, d_k_rope_BsR, d_v_BHsK)
            return jax.lax.cond(any_visible(q_at, k_at), update, lambda c: c, carry), None

        zeros = lambda x: jnp.zeros(x.shape, ACC_DTYPE)  # noqa: E731
        init = (d_queries, varying_like((zeros(k_nope_BHsK), zeros(k_rope_BsR), zeros(v_BHsK)), *jax.tree.leaves(saved), d_out_BTHK))
        d_queries, d_key = jax.lax.scan(visit, init, (queries, jnp.arange(queries[0].shape[0])))[0]
        return d_queries, d_key

    keys = key_blocks(k_nope_BSHK, k_rope_BSR, v_BSHK, k_pos_S, segments_bT, block)
    d_queries = varying_like((jnp.zeros(queries[0].shape, ACC_DTYPE), jnp.zeros(queries[1].shape, ACC_DTYPE)),
                             *jax.tree.leaves(saved), d_out_BTHK)
    (d_q_nope_nBHtK, d_q_rope_nBHtR), (d_k_nope_nBHsK, d_k_rope_nBsR, d_v_nBHsK) = jax.lax.scan(one_key_block, d_queries, keys)
    B, S, R = k_rope_BSR.shape
    d_k_rope_BSR = d_k_rope_nBsR.transpose(1, 0, 2, 3).reshape(B, S, R)
    return (unblock(d_q_nope_nBHtK).astype(dtype), unblock(d_q_rope_nBHtR).astype(q_rope_BTHR.dtype),
            unblock(d_k_nope_nBHsK).astype(k_nope_BSHK.dtype), d_k_rope_BSR.astype(k_rope_BSR.dtype),
            unblock(d_v_nBHsK).astype(v_BSHK.dtype), None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)
