"""Packed rows (ops/packing.py, --train.objective sft): several documents in one row, each
computed as if it ran alone. Attention over a packed row equals each document's attention
alone under every kernel (output, max logits, the gradients of the weights and the input,
float32), and data/conversations.packed_rows lays conversations out as the step reads them.
The whole step on packed rows against the conversations one per row: tests/test_sft.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_blockwise_attention import small_attention_config

from data.conversations import packed_rows
from model import MLAttention, rope_angles, unmasked
from ops.packing import Packed, document_positions, document_starts, segment_ids
from utils import SEGMENT_START

T = 256  # two blocks of 128 (splash's smallest)
LENGTHS = ([100, 90, 66], [128, 60, 68])  # documents per row: boundaries inside a block, and on one


def documents(lengths_per_row, seed=0):
    """(ids, trained) documents of these lengths, every target counted but the first."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 200, n).astype(np.int32), np.arange(n) > 0) for lengths in lengths_per_row for n in lengths]


@pytest.mark.parametrize("implementation", ["matmul", "dot_product_attention", "blockwise", "splash"])
def test_attention_over_a_packed_row_equals_each_document_alone(implementation):
    cfg = small_attention_config(attention="matmul", seq_len=T)
    graphdef, params = nnx.split(MLAttention(cfg, nnx.Rngs(0)))
    rows_bT = packed_rows(documents(LENGTHS), T, eot_id=0)
    assert rows_bT.shape == (2, T)  # premise: each row holds its three documents exactly
    x_BTD = jax.random.normal(jax.random.key(1), (2, T, cfg.d_model))
    w_BTD = jax.random.normal(jax.random.key(2), x_BTD.shape)  # a loss that weighs every output differently

    @jax.jit
    def grads(params, x_BTD, w_BTD, angles):
        def loss(params, x_BTD):
            module = nnx.merge(graphdef, params)
            module.implementation, module.block = (implementation, 128) if angles.__class__ is Packed else ("matmul", 128)
            y_BTD, max_logit_H = module.with_max_logits(x_BTD, angles)
            return jnp.sum(y_BTD * w_BTD), (y_BTD, max_logit_H)
        return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x_BTD)

    packed = Packed(rope_angles(document_positions(rows_bT), cfg), segment_ids(rows_bT))
    (d_params, d_x), (y, max_logit) = grads(params, x_BTD, w_BTD, packed)
    ref_y, ref_d_x = np.zeros_like(y), np.zeros_like(d_x)
    ref_d_params, ref_max_logit = jax.tree.map(np.zeros_like, d_params), np.full_like(max_logit, -np.inf)
    for b, lengths in enumerate(LENGTHS):  # the plain matmul attention, one document at a time
        for start, n in zip(np.cumsum([0] + lengths[:-1]), lengths):
            alone = slice(start, start + n)
            (g, g_x), (y_n, max_n) = grads(params, x_BTD[b:b + 1, alone], w_BTD[b:b + 1, alone], rope_angles(jnp.arange(n)[None], cfg))
            ref_y[b, alone], ref_d_x[b, alone], ref_max_logit = y_n[0], g_x[0], np.maximum(ref_max_logit, max_n)
            ref_d_params = jax.tree.map(np.add, ref_d_params, g)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
    assert np.abs(ref_y).mean() > 1e-2
    np.testing.assert_allclose(max_logit, ref_max_logit, rtol=1e-5)
    for (path, g), ref_g in zip(jax.tree_util.tree_flatten_with_path((d_x, d_params))[0], jax.tree.leaves((ref_d_x, ref_d_params))):
        # (sums of a few hundred terms, in another order: 1e-5 of the largest)
        np.testing.assert_allclose(g, ref_g, rtol=1e-5, atol=1e-5 * np.abs(ref_g).max(), err_msg=jax.tree_util.keystr(path))


def test_packed_rows_hold_every_conversation_in_order_flagged_at_its_first_token():
    """Greedy in-order packing: each row takes the next conversation while it fits; a
    conversation's first token carries SEGMENT_START and is a skipped target; the rest of a
    row is skipped end-of-text padding; the views the step takes (document ids and
    positions) follow."""
    rng = np.random.default_rng(3)
    conversations = [(rng.integers(0, 200, n).astype(np.int32), np.arange(n) >= rng.integers(1, n))
                     for n in rng.integers(2, 18, 40)]
    rows_NT = packed_rows(conversations, 17, eot_id=7)
    pieces = []
    for row_T in rows_NT:
        starts = list(np.flatnonzero(document_starts(row_T))) + [len(row_T)]
        assert starts[0] == 0 and np.all(row_T[starts[:-1]] < 0)
        pieces += [row_T[a:b] for a, b in zip(starts[:-1], starts[1:])]
        np.testing.assert_array_equal(segment_ids(row_T), np.repeat(np.arange(1, len(starts)), np.diff(starts)))
        np.testing.assert_array_equal(document_positions(row_T), np.concatenate([np.arange(b - a) for a, b in zip(starts[:-1], starts[1:])]))
    assert len(pieces) == len(conversations)
    for k, ((ids, trained), piece) in enumerate(zip(conversations, pieces)):
        n = len(ids)
        assert piece[0] == ~(ids[0] | SEGMENT_START)
        np.testing.assert_array_equal(piece[1:n], np.where(trained, ids, ~ids)[1:])
        np.testing.assert_array_equal(unmasked(piece[:n]), ids)
        np.testing.assert_array_equal(piece[n:], ~7)  # padding, the row's last conversation only
        assert len(piece) == n or k + 1 == len(conversations) or (len(piece) - n) < len(conversations[k + 1][0])
    assert len(rows_NT) < 0.8 * len(conversations)  # premise: rows hold several
