"""The weight table: one row per weight name, everything the repo knows about a weight.

parallel.py reads each row's split (how a weight is stored and computed over the mesh),
optimizers.py its Muon matrix dims and whether it is trained and decayed,
flops.count_params whether it belongs to the routed experts, and hf_interop.py its
Hugging Face tensor. A weight of the model with no row is an error wherever it is
looked up (`row`), and tests/test_weights.py checks that every parameter of the presets
has a row and every row a parameter. This module imports nothing from the project, so
everything can import it.

Names end in their shape letters (model.py legend): `wq_up_QHK` is [Q, H, K]. Weights
inside the stacked blocks get a leading N dim (split over pp), which the names leave out;
the dense prefix's layers (model.Transformer.prefix) are not stacked and have none.
"""

import dataclasses

# The mesh axes, named once (parallel.py builds the mesh from them). AXES are those
# within one TPU slice (ICI), the only ones weights are split over; CP (context
# parallel) splits every sequence: its ranks hold the same weights, so, as torchtitan
# does, their storage is FSDP-sharded over dp x cp (an FSDP weight is split over every
# axis in AXES that does not split it for compute); SLICE, outermost,
# is data parallelism across slices over the data-center network (10-100x slower), so
# only the once-per-step gradient all-reduce crosses it (step_core.reduce_over_slices).
DP, CP, PP, TP = "dp", "cp", "pp", "tp"
SLICE = "slice"
AXES = (DP, CP, PP, TP)
MESH_AXES = (SLICE,) + AXES
BATCH_AXES = (SLICE, DP)  # the batch's rows, slice-major: a global row index stays meaningful
# Per dim of a weight, how it is split (`Weight.dims`):
#   TP     split over tp for compute (Megatron): each device uses its slice
#   EXPERT split over dp when expert parallelism is on (each device owns E/dp experts)
#   FSDP   split for storage only (ZeRO-3) over every mesh axis that does not split
#          the weight for compute; all-gathered just before use
#   None   whole on every device
# So a weight that every tp device needs whole (wq_down_DQ) is stored over dp x tp, the
# embedding (needed by every stage) over dp x pp, and each weight is held once.
FSDP, EXPERT = "fsdp", "expert"

# The config field that sets each shape letter, for errors about sizes.
SHAPE_LETTER_FLAGS = {"V": "vocab (padded; --model.vocab_multiple)", "D": "--model.d_model", "Q": "--model.q_latent",
                      "A": "--model.kv_latent", "R": "--model.rope_dim", "H": "--model.n_heads", "K": "--model.head_dim",
                      "F": "--model.d_ff / --model.d_expert", "E": "--model.n_experts", "N": "--model.n_blocks"}


@dataclasses.dataclass(frozen=True)
class Hf:
    """A weight's tensor in a Hugging Face DeepseekV3 checkpoint.

    name: under the HF module that holds it (hf_interop.HF_MODULES maps our module path
      to it: attn -> self_attn, ffn -> mlp, ...); `{e}` is the expert's index for the
      routed experts, which DeepSeek's checkpoints store one tensor per expert. Rows
      with the same name in one module are one HF tensor: ours concatenated along their
      last dim, in this table's order (q_b_proj: per head, K content dims then R RoPE).
    fused: the routed experts' name when all experts are one [E, out, in] tensor
      (transformers' Mistral4 class).
    Orientation follows the row's fan_in: a weight with fan-in dims is transposed to
    torch's [out, in] (its fan-in dims flattened into `in`, the rest into `out`); one
    without (embedding, norm scales, biases) is stored as it is."""
    name: str
    fused: str | None = None


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight's facts.

    dims: per shape letter, its split (TP, EXPERT, FSDP or None; see above).
    fan_in: how many dims, after the routed experts' leading E, a matmul contracts
      (x @ w): the rest are the output dims. None for weights that are no matmul's
      right-hand side (the embedding lookup, norm scales, the routing bias).
    muon: Muon orthogonalizes it (--train.optimizer muon) as matrices of
      fan-in x fan-out dims, one per expert for the routed experts; AdamW trains the rest.
    trained: the optimizer updates it. An untrained weight (the balancing bias, moved by
      its own rule outside the optimizer) stays float32 in the forward pass (a bias step
      of 0.001 is below bfloat16's resolution near 0.5), has no gradient, and no decay.
    decay: AdamW's / Muon's weight decay applies (not to norm scales).
    routed: one of the routed experts' weights, [E, ...]: a token uses top_k of the E
      (count_params' active count), and E is a batch dim for Muon.
    hf: its Hugging Face tensor; None: not exported (multi-token prediction)."""
    dims: tuple
    fan_in: int | None = None
    muon: bool = False
    trained: bool = True
    decay: bool = True
    routed: bool = False
    hf: Hf | None = None

    @property
    def muon_dims(self):
        """(batch dims, fan-in dims) counts, leading; the remaining dims are fan-out."""
        return int(self.routed), self.fan_in


def _matrix(dims, hf, fan_in=1, **kw):
    return Weight(dims, fan_in=fan_in, muon=True, hf=Hf(hf), **kw)


def _expert(dims, hf, fused):
    return Weight(dims, fan_in=1, muon=True, routed=True, hf=Hf(hf, fused))


WEIGHTS = {
    "embed_VD": Weight((TP, FSDP), hf=Hf("embed_tokens.weight")),     # vocab rows over tp (vocab-parallel); tied output layer
    # The untied output layer (--model.tie_embeddings false): laid out as the embedding, so the logits
    # stay vocab-parallel; no fan-in dims (x @ head^T contracts its last dim, D), so it is exported
    # as it is, torch's [V, D]; AdamW, not Muon, as DeepSeek and Moonlight train embedding and head.
    "head_VD": Weight((TP, FSDP), hf=Hf("lm_head.weight")),
    "scale_D": Weight((None,), decay=False, hf=Hf("weight")),         # RMSNorm scales: small, replicated everywhere
    # MLA attention. Latent down-projections: every tp device needs them whole.
    "wq_down_DQ": _matrix((FSDP, None), "q_a_proj.weight"),
    "wq_up_QHK": _matrix((FSDP, TP, None), "q_b_proj.weight"),      # heads over tp
    "wq_rope_QHR": _matrix((FSDP, TP, None), "q_b_proj.weight"),
    "wq_DHK": _matrix((FSDP, TP, None), "q_proj.weight"),           # full-rank queries (--model.q_latent 0), as q_b_proj
    "wq_rope_DHR": _matrix((FSDP, TP, None), "q_proj.weight"),
    "wkv_down_DA": _matrix((FSDP, None), "kv_a_proj_with_mqa.weight"),
    "wk_rope_DR": _matrix((FSDP, None), "kv_a_proj_with_mqa.weight"),  # the shared RoPE key
    "wk_up_AHK": _matrix((FSDP, TP, None), "kv_b_proj.weight"),
    "wv_up_AHK": _matrix((FSDP, TP, None), "kv_b_proj.weight"),
    "wo_HKD": _matrix((TP, None, FSDP), "o_proj.weight", fan_in=2),   # row-parallel output: psum over tp in model.py
    # Dense FFN and shared experts: hidden units over tp.
    "w_gate_DF": _matrix((FSDP, TP), "gate_proj.weight"),
    "w_up_DF": _matrix((FSDP, TP), "up_proj.weight"),
    "w_down_FD": _matrix((TP, FSDP), "down_proj.weight"),
    # MoE: every tp device routes identically; the balancing bias is train state (not
    # trained), the same on every device.
    "router_DE": Weight((FSDP, None), fan_in=1, hf=Hf("gate.weight")),
    "router_bias_E": Weight((None,), trained=False, hf=Hf("gate.e_score_correction_bias")),
    "w_gate_EDF": _expert((EXPERT, FSDP, TP), "experts.{e}.gate_proj.weight", "experts.gate_up_proj"),  # expert hidden units over tp
    "w_up_EDF": _expert((EXPERT, FSDP, TP), "experts.{e}.up_proj.weight", "experts.gate_up_proj"),
    "w_down_EFD": _expert((EXPERT, TP, FSDP), "experts.{e}.down_proj.weight", "experts.down_proj"),
    # Multi-token prediction: the two halves of V3's projection M_k (not exported).
    "w_hidden_DD": Weight((FSDP, None), fan_in=1, muon=True),
    "w_embed_DD": Weight((FSDP, None), fan_in=1, muon=True),
}


def row(name):
    """The table's row for weight `name`; an unknown weight is an error, never a guess."""
    if name not in WEIGHTS:
        raise KeyError(f"no row for weight {name!r} in weights.WEIGHTS: add one to weights.py "
                       f"(its split, fan-in dims, Muon / trained / routed flags and Hugging Face name)")
    return WEIGHTS[name]


def is_trained(name):
    return row(name).trained


def shape_letters(name):
    return name.rsplit("_", 1)[1]


def weight_name(path):
    """The weight name of a params-tree path (its last string key)."""
    return next(k.key for k in reversed(path) if isinstance(getattr(k, "key", None), str))


def is_stacked(path):
    """Inside the stacked blocks, so with a leading N dim."""
    return any(getattr(k, "key", None) == "blocks" for k in path)


# ----------------------------------------------------------------------------
# The table as README text (tests/test_weights.py checks the README holds it)


def markdown_table():
    """The sharding table: one line per weight."""
    lines = ["| weight | split per dim | Muon matrices | trained | routed | Hugging Face tensor (in its module) |",
             "|---|---|---|---|---|---|"]
    for name, w in WEIGHTS.items():
        letters = shape_letters(name)
        split = ", ".join(f"{letter} {d or '-'}" for letter, d in zip(letters, w.dims))
        muon = "-"
        if w.muon:  # e.g. "E x D -> F": E matrices of D x F
            batch, fan_in = w.muon_dims
            muon = (f"{letters[:batch]} x " if batch else "") + f"{letters[batch:batch + fan_in]} -> {letters[batch + fan_in:]}"
        trained = ("yes" if w.decay else "yes, no decay") if w.trained else "no"
        hf = "-" if w.hf is None else f"`{w.hf.name}`" + (f" (fused: `{w.hf.fused}`)" if w.hf.fused else "")
        lines.append(f"| `{name}` | {split} | {muon} | {trained} | {'yes' if w.routed else 'no'} | {hf} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
