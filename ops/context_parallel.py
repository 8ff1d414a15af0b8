"""Context parallelism (--mesh.cp): every sequence cut into 2 cp chunks of L = T / (2 cp) tokens, rank i holding
chunks i and 2cp-1-i (the same causal work on every rank). Per attention layer one all-gather of the MLA latent and
the shared RoPE key crosses cp (its transpose reduce-scatters their gradient); everything per token runs on the rank's
2L tokens at their global positions, so the numbers are one device's. Every cp rank gets whole rows and reads its
chunks' inputs and targets out of them. What cp needs of a config: utils.context_parallel_checks; the measurements:
docs/parallelism.md."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ops.collectives import live_axes


def chunk_positions(seq_len, cp, rank, xp=jnp):
    """The global positions [2L] of rank `rank`'s tokens: chunk rank, then chunk 2cp-1-rank.
    (xp = np for a rank known when tracing.)"""
    L = seq_len // (2 * cp)
    return xp.concatenate([rank * L + xp.arange(L), (2 * cp - 1 - rank) * L + xp.arange(L)])


def gathered_positions(seq_len, cp):
    """The global positions [T] of the keys in the order all_gather over cp puts them: rank-major."""
    return np.concatenate([chunk_positions(seq_len, cp, rank, np) for rank in range(cp)])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SequenceChunks:
    """What attention needs under cp, passed down where the RoPE angles go: the angles of this rank's tokens, their
    global positions q_pos_T [2L], those of the gathered keys k_pos_S [T], and the cp axis. Under the automatic
    executor (a global program, every rank's chunks in rank order) nothing is gathered by hand: `whole` asks the
    compiler for the latent whole over cp. Packed rows (ops/packing.py): their whole rows' document ids [b, T]."""
    angles: jax.Array
    q_pos_T: jax.Array
    k_pos_S: jax.Array
    axis: str = dataclasses.field(metadata=dict(static=True))
    whole: P | None = dataclasses.field(default=None, metadata=dict(static=True))
    segments_bT: jax.Array | None = None

    def gather(self, kv_BTA, k_rope_BTR):
        """The latent and RoPE key of every rank's tokens: [B, T, A], [B, T, R], one
        all-gather over cp of A + R numbers per token."""
        A = kv_BTA.shape[-1]
        latent_BTW = jnp.concatenate([kv_BTA, k_rope_BTR.astype(kv_BTA.dtype)], axis=-1)
        if live_axes(self.axis):
            latent_BTW = jax.lax.all_gather(latent_BTW, self.axis, axis=1, tiled=True)
        elif self.whole is not None:
            latent_BTW = jax.lax.with_sharding_constraint(latent_BTW, self.whole)
        return latent_BTW[..., :A], latent_BTW[..., A:].astype(k_rope_BTR.dtype)


def sequence_axis(angles):
    """The cp axis when attention runs on sequence chunks (angles is a SequenceChunks), else None."""
    return angles.axis if isinstance(angles, SequenceChunks) else None


def held_positions(angles):
    """The global positions [2L] of this rank's tokens when it holds chunks of each
    sequence (angles a SequenceChunks); None when it holds whole rows."""
    return angles.q_pos_T if isinstance(angles, SequenceChunks) else None


def token_positions(angles, T):
    """The global positions [T] of the tokens a layer holds: 0..T-1, or this rank's chunks'."""
    return angles.q_pos_T if isinstance(angles, SequenceChunks) else jnp.arange(T)


def tokens_at(tokens_xTn, positions_T, k, T):
    """Each row's tokens at positions p + k: a slice for the positions 0..T-1 of whole
    rows (positions_T None, no cp), gathered at this rank's positions under cp."""
    # Without cp a slice, not a gather: XLA:CPU aborts compiling the gather per microbatch
    # under accumulation (test_executors).
    return tokens_xTn[..., k:k + T] if positions_T is None else tokens_xTn[..., positions_T + k]


def local_inputs(tokens_xT1, positions_T):
    """The input tokens at this rank's positions (all of them without cp: positions None)."""
    return tokens_at(tokens_xT1, positions_T, 0, tokens_xT1.shape[-1] - 1)


def local_targets(tokens_xT1, positions_T):
    """The next tokens of this rank's positions."""
    return tokens_at(tokens_xT1, positions_T, 1, tokens_xT1.shape[-1] - 1)
