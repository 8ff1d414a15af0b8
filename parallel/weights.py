"""The weight table (one row per weight name: all the repo knows about a weight), the
storage layout it gives each weight on the mesh, and the params created in it.

Readers: weight_layout (the split), parallel/optimizers.py (Muon dims, trained, decay),
runtime/flops.count_params (routed), hf/convert.py (the Hugging Face tensor). A weight with
no row is an error wherever it is looked up (`row`; tests/test_weights.py checks both ways).

Names end in their shape letters (model.py legend): `wq_up_QHK` is [Q, H, K]; weights in the
stacked blocks (not the dense prefix) also get a leading N dim, split over pp.
"""

import dataclasses
import math

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from model import Transformer
from parallel.mesh import axes_of, named
from utils import AXES, DP, PP, TP, ConfigError

# Per dim of a weight, its split (`Weight.dims`): TP over tp for compute (Megatron); EXPERT over dp under expert
# parallelism (E/dp experts each); FSDP for storage only (ZeRO-3), over every axis that does not split the weight for
# compute, all-gathered before use; None whole. So each weight is held once: wq_down_DQ (whole on every tp device)
# over dp x tp, the embedding (used by every stage) over dp x pp.
FSDP, EXPERT = "fsdp", "expert"

# The config field that sets each shape letter, for errors about sizes.
SHAPE_LETTER_FLAGS = {"V": "vocab (padded; --model.vocab_multiple)", "D": "--model.d_model", "Q": "--model.q_latent",
                      "A": "--model.kv_latent", "R": "--model.rope_dim", "H": "--model.n_heads", "K": "--model.head_dim",
                      "F": "--model.d_ff / --model.d_expert", "E": "--model.n_experts", "N": "--model.n_blocks"}


@dataclasses.dataclass(frozen=True)
class Hf:
    """A weight's tensor in a Hugging Face DeepseekV3 checkpoint.

    name: under its HF module (convert.HF_MODULES: attn -> self_attn, ...); `{e}`: the
      routed expert's index (one tensor per expert). Rows of one name in one module are one
      HF tensor, ours concatenated on their last dim in table order (q_b_proj: per head, K
      content dims then R RoPE).
    fused: the routed experts' name when all experts are one [E, out, in] tensor (transformers' Mistral4).
    A weight with fan-in dims is exported as torch's [out, in] (fan-in dims flattened into
    `in`); one without (embedding, norm scales, biases) as it is."""
    name: str
    fused: str | None = None


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight's facts.

    dims: per shape letter, its split (TP, EXPERT, FSDP or None; see above).
    fan_in: how many dims after a routed weight's leading E a matmul (x @ w) contracts; the
      rest are outputs. None: no matmul's right-hand side (embedding, norm scales, bias).
    muon: Muon orthogonalizes it (--train.optimizer muon) as fan-in x fan-out matrices, one
      per expert if routed; AdamW trains the rest.
    trained: the optimizer updates it. An untrained weight (the balancing bias, moved by its
      own rule) has no gradient nor decay and stays float32 in the forward pass (a bias step
      of 0.001 is below bfloat16's resolution near 0.5).
    decay: weight decay applies (not to norm scales).
    routed: a routed expert's weight [E, ...]: a token uses top_k of E; E is a Muon batch dim.
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
    # Untied output layer (--model.tie_embeddings false): laid out as the embedding (vocab-parallel
    # logits); no fan-in dims (x @ head^T contracts D): exported as torch's [V, D]; AdamW, as in DeepSeek.
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
    # MoE: every tp device routes identically; the balancing bias is untrained state, alike everywhere.
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
        raise KeyError(f"no row for weight {name!r} in weights.WEIGHTS: add one to parallel/weights.py "
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


# ---- The storage layout on a mesh


def weight_layout(name, stacked, expert_parallel):
    """(dims, fsdp_axes, fsdp_dim): each dim's mesh axes (None, an axis or a tuple; PP first if
    stacked), the axes splitting the FSDP dim for storage only, and its index. Unknown: raises."""
    dims = tuple({EXPERT: DP if expert_parallel else None}.get(d, d) for d in row(name).dims)
    if stacked:
        dims = (PP,) + dims
    compute_axes = {d for d in dims if d not in (None, FSDP)}
    # AXES, not MESH_AXES: split within a slice only, so no per-layer collective crosses slices.
    fsdp_axes = tuple(a for a in AXES if a not in compute_axes) if FSDP in dims else ()
    dims = tuple((fsdp_axes or None) if d == FSDP else d for d in dims)
    return dims, fsdp_axes, fsdp_axes and dims.index(fsdp_axes)


def param_specs(params, expert_parallel):
    """PartitionSpec (storage layout) for every weight of a params tree."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: P(*weight_layout(weight_name(path), is_stacked(path), expert_parallel)[0]), params)


def check_divisible(params, specs, mesh):
    """Every split dim must divide evenly; say which config field to change."""
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        name = weight_name(path)
        letters = ("N" if is_stacked(path) else "") + name.rsplit("_", 1)[1]
        for size, entry, letter in zip(leaf.shape, spec, letters):
            ways = math.prod(mesh.shape[a] for a in axes_of(entry))
            if size % ways:
                split = " x ".join(f"--mesh.{a} = {mesh.shape[a]}" for a in axes_of(entry))
                raise ConfigError(f"{SHAPE_LETTER_FLAGS.get(letter, letter)} = {size} is not divisible by {split} "
                                  f"(weight {name} splits its {letter} dim {ways} ways); change one of them")


# ---- Init: same values on every mesh


def init_params(model_cfg, mesh, expert_parallel, seed):
    """(graphdef, params), params created in their shards (each device computes its own),
    the same values on every mesh: partitionable threefry depends on (seed, position) alone."""
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(seed)))
    graphdef, abstract_state = nnx.split(abstract)
    shapes = abstract_state.to_pure_dict()
    specs = param_specs(shapes, expert_parallel)
    check_divisible(shapes, specs, mesh)

    def create():
        return nnx.split(Transformer(model_cfg, nnx.Rngs(seed)))[1].to_pure_dict()

    params = jax.jit(create, out_shardings=named(mesh, specs))()
    return graphdef, params


# ---- The table as README text (tests/test_weights.py checks the README holds it)


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
