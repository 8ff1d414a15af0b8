"""Context parallelism (--mesh.cp): every sequence split over the cp axis, load-balanced
for the causal mask, with attention gathering the MLA latent over cp. Shape legend:
model.py's docstring; L = T / (2 cp), the length of one chunk.

Which tokens a rank holds: the sequence is cut into 2 cp chunks of L tokens, and rank
i holds chunks i and 2cp-1-i (the scheme of MaxText and torchtitan). Under the causal
mask a query at position p attends to p + 1 keys, so an early chunk is cheap and a late
one dear; pairing chunk i with chunk 2cp-1-i gives every rank the same work,
(2cp - 1 + 2) L / 2 keys per query on average, where contiguous chunks would give the
last rank 2cp - 1 times the first's.

What crosses cp: only attention needs other ranks' tokens, and of them only what MLA
makes keys and values from: the latent c_KV [A] and the shared RoPE key [R], A + R
numbers per token (576 for DeepSeek-V3), all-gathered over cp once per attention
layer. Keys and values [H, K] are up-projected from the gathered latent on every rank:
a small repeated matmul instead of moving 2 H K numbers per token (32,768 for V3).
An all-gather rather than a ring: the latent of the whole sequence is T (A + R) numbers
per row (37 MB at T = 32,768 for V3 in bfloat16 per row), small beside the activations,
and one gather is one collective per layer that XLA can overlap with the query
projections, where a ring needs cp - 1 dependent steps. Autodiff turns the all-gather
into a reduce-scatter of the latent's gradient.

Everything per token (norms, FFN, MoE, the loss) runs on the rank's 2L tokens. The
positions that RoPE and the causal mask use are global ones, so the numbers are those of
one device. MoE routing groups of --model.routing_group tokens must divide L, so that
a group is one global group and never straddles two chunks (utils.validate_model).

The tokens themselves are not split: every cp rank receives the whole rows of its
(slice, dp) share of the batch and reads its chunks' inputs and targets out of them
(local_inputs, local_targets; MTP reads a few tokens past a chunk's end). A token is 4
bytes per position where the activations a rank keeps are kilobytes per position per
layer, so whole rows cost nothing that matters, and chunk-wise reads stay simple.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from layers import live_axes


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
    """What attention needs under context parallelism, passed down where the RoPE angles
    go (MLAttention.__call__ takes either): the angles of this rank's tokens, their
    global positions q_pos_T [2L], the global positions k_pos_S [T] of the gathered
    keys, and the cp axis to gather over.

    Under the automatic executor (--mesh.sharding auto) the program is global: the
    tokens are every rank's chunks in rank order, [T] of them, their sequence dim split
    over cp by a sharding constraint (executor_auto), so that rank i holds chunks i and
    2cp-1-i as here. There no collective is written: `whole` is the spec that asks the
    compiler for the latent whole over cp where keys and values are made from it. What
    it then moves is its choice. In the dp2 x cp2 x tp2 step of test_context_parallel it
    all-gathers the latent once per attention layer, as the manual executors do, and the
    residual stream [b, T, D] 8 times per step; before layers.project kept the rows [B, T]
    apart under auto cp (sequence_split_by_the_compiler) it gathered the residual stream
    37 times instead of the latent: the sequence was not split. Constraining the latent
    to be split over cp before the gather only added collectives.
    """
    angles: jax.Array
    q_pos_T: jax.Array
    k_pos_S: jax.Array
    axis: str = dataclasses.field(metadata=dict(static=True))
    whole: P | None = dataclasses.field(default=None, metadata=dict(static=True))

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


def token_positions(angles, T):
    """The global positions [T] of the tokens a layer holds: 0..T-1, or this rank's chunks'."""
    return angles.q_pos_T if isinstance(angles, SequenceChunks) else jnp.arange(T)


def tokens_at(tokens_xTn, positions_T, k, T):
    """Each row's tokens at positions p + k: a slice for the positions 0..T-1 of whole
    rows (positions_T None, no cp), gathered at this rank's positions under cp.
    (A gather in place of the slice without cp made XLA:CPU abort compiling
    test_executors' accumulation case with the gather per microbatch.)"""
    return tokens_xTn[..., k:k + T] if positions_T is None else tokens_xTn[..., positions_T + k]


def local_inputs(tokens_xT1, positions_T):
    """The input tokens at this rank's positions (all of them without cp: positions None)."""
    return tokens_at(tokens_xT1, positions_T, 0, tokens_xT1.shape[-1] - 1)


def local_targets(tokens_xT1, positions_T):
    """The next tokens of this rank's positions."""
    return tokens_at(tokens_xT1, positions_T, 1, tokens_xT1.shape[-1] - 1)
