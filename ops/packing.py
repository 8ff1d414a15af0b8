"""Packed rows (--train.objective sft): several documents (conversations) in one row of seq_len + 1 tokens, none
attending to another, each at its own positions 0, 1, ... as if it ran alone in a row of its own.

The rows say where each document starts: its first token carries SEGMENT_START (a bit above every vocabulary,
stripped by model.unmasked) and, never a target when the document runs alone, is stored as a skipped target
(~id, data/conversations.packed_rows), so no target crosses from one document into the next. From the flags the step's
prologue (parallel/step_core.split_microbatches) works out each row's document ids and each token's position in its
document, and hands attention a Packed (under cp, a SequenceChunks carrying the ids) where the RoPE angles go;
every attention kernel then lets a query see the keys of its own document only (document_mask, or the kernel's own
segment ids). Padding after a row's last document belongs to that document: its targets are skipped, and causal
attention keeps it out of every earlier token.
"""

import dataclasses

import jax
import jax.numpy as jnp

from ops.context_parallel import SequenceChunks
from utils import SEGMENT_START


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packed:
    """Attention's view of packed whole rows (no cp), passed where the RoPE angles go: the angles of each token's
    position in its document [b, T, R/2] and the rows' document ids [b, T] (packed_views: every microbatch's, [M, ...])."""
    angles: jax.Array
    segments_bT: jax.Array


def document_starts(tokens_xT):
    """Does each token begin a document? (bool, tokens as the rows store them: ~id for a skipped target)"""
    return (jnp.maximum(tokens_xT, ~tokens_xT) & SEGMENT_START) != 0


def segment_ids(tokens_xT):
    """Each token's document in its row: 0 before the first flagged token, then 1, 2, ..."""
    return jnp.cumsum(document_starts(tokens_xT), axis=-1, dtype=jnp.int32)


def document_positions(tokens_xT):
    """Each token's position in its document: its index less its document's first token's."""
    index_T = jnp.arange(tokens_xT.shape[-1], dtype=jnp.int32)
    return index_T - jax.lax.cummax(jnp.where(document_starts(tokens_xT), index_T, 0), axis=tokens_xT.ndim - 1)


def packed_views(tokens_MbT1, rope_angles, angles):
    """Attention's view of every microbatch's packed rows [M, ...], where the step's `angles` (RoPE angles of
    positions 0..T-1, or under cp this rank's SequenceChunks) would go: the angles of each token's position in its
    document (rope_angles(positions)), at this rank's 2L positions under cp, and the rows' document ids (whole rows:
    every cp rank holds them). of_microbatch takes microbatch m's."""
    inputs_MbT = tokens_MbT1[..., :-1]
    positions_MbT, segments_MbT = document_positions(inputs_MbT), segment_ids(inputs_MbT)
    if isinstance(angles, SequenceChunks):
        return dataclasses.replace(angles, angles=rope_angles(positions_MbT[..., angles.q_pos_T]), segments_bT=segments_MbT)
    return Packed(rope_angles(positions_MbT), segments_MbT)


def of_microbatch(view, m):
    """Microbatch m's packed view (a Packed or SequenceChunks of packed_views)."""
    return dataclasses.replace(view, angles=view.angles[m], segments_bT=view.segments_bT[m])


def document_mask(q_pos_T, k_pos_S, segments_bT):
    """Which keys each query sees [b, T', S]: those at or before it (global positions q_pos_T, k_pos_S) in its own
    document (segments_bT: whole rows' ids, read at those positions)."""
    causal_TS = k_pos_S[None, :] <= q_pos_T[:, None]
    return causal_TS[None] & (segments_bT[:, q_pos_T][:, :, None] == segments_bT[:, k_pos_S][:, None, :])


def targets_in_document(tokens_bT1, positions_T, k):
    """MTP depth k: does the target k + 1 tokens after each position [b, T'] lie in that position's document? (a
    target past the row's end: no). positions_T: the global positions held (None: 0..T-1)."""
    T = tokens_bT1.shape[-1] - 1
    positions_T = jnp.arange(T) if positions_T is None else positions_T
    segments_bT1 = segment_ids(tokens_bT1)
    ahead_T = jnp.minimum(positions_T + k + 1, T)
    return segments_bT1[:, positions_T] == segments_bT1[:, ahead_T]
