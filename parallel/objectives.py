"""Objectives other than next-token prediction over every token (--train.objective lm): their
step-level arithmetic, imported only when one is chosen.

sft: rows of conversations (data/conversations.py) whose targets the loss skips (the
prompt's tokens, padding) are stored as ~id < 0; the model's loss head sums the
cross-entropy of the other targets only (model.unmasked). The step core divides that sum by
every target of the batch (B x T, as lm does); per_target rescales the step's loss and
gradients by B x T / (trained targets in the batch), so the loss is the mean over the
assistant's tokens. The rescale is of the whole loss: the balance losses and MTP are scaled
by the same factor (their weights are relative to the mean reply-token loss).
"""

import jax
import jax.numpy as jnp

from ops.collectives import psum
from utils import BATCH_AXES


def target_scale(tokens_bT1, cfg):
    """B x T / (trained targets in the global batch): from this device's rows, summed over the
    axes that split rows (cp, pp and tp ranks hold the same rows); at least one target counts."""
    trained = psum(jnp.sum(tokens_bT1[:, 1:] >= 0, dtype=jnp.float32), BATCH_AXES)
    return cfg.train.batch_size * cfg.model.seq_len / jnp.maximum(trained, 1.0)


def per_target(metrics, grads, tokens_bT1, cfg):
    """(metrics, grads) of a step whose losses are divided by all B x T targets -> divided
    by the trained targets only: loss (and mtp_loss) the mean over the assistant's tokens."""
    scale = target_scale(tokens_bT1, cfg)
    metrics = dict(metrics, loss=metrics["loss"] * scale)
    if "mtp_loss" in metrics:
        metrics["mtp_loss"] = metrics["mtp_loss"] * scale
    return metrics, jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
