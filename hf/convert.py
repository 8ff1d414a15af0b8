"""Hugging Face interop: this model <-> a transformers checkpoint directory (weights;
config.json is hf/config.py's, the tokenizer hf/tokenizer.py's).

The model here is arithmetically a DeepSeek-V3 (MLA attention with decoupled RoPE,
shared + routed SwiGLU experts, RMSNorm), so a run leaves the repo as a directory that
`AutoModelForCausalLM.from_pretrained` loads: with transformers' own, built-in classes
where one computes the model, else with a short subclass of its DeepseekV3 that the
export writes beside the weights (modeling_meshformer.py, loaded with
trust_remote_code=True; config.json's auto_map points at it):

  dense layers first only (D...DM...M), and
    router_score sigmoid (or no MoE layer)                      -> deepseek_v3 (DeepseekV3ForCausalLM)
    router_score softmax, raw gates (no renormalisation or top 1),
      no expert groups, no selection bias                       -> deepseek_v2 (DeepseekV2ForCausalLM)
  anything else (the default run's DM x 2 with a softmax top-2 router; moe1b's
  DDDDDM x 8)                                                   -> meshformer  (MeshformerForCausalLM, remote code)

And back: DeepSeek-V3, DeepSeek-V2-Lite and Moonlight checkpoints import
(`--train.init_from hf:DIR`, HFSource), streamed: HFSource.load reads, for every shard of every
param that this process's devices hold, only that shard's slice of the HF tensors
(safetensors_reader.py), never the whole model into one host's memory.

How the pieces map (ours -> HF, per layer l = first_dense + block n x len(pattern) +
position i, or l = i for the dense prefix's layer i; the names and layouts are the rows
of weights.WEIGHTS, under HF_MODULES):

  wq_down_DQ                    q_a_proj [Q, D]            (transposed: torch stores [out, in])
  wq_up_QHK | wq_rope_QHR       q_b_proj [H (K + R), Q]    per head: K content dims, then R RoPE dims
  wq_DHK | wq_rope_DHR          q_proj [H (K + R), D]      (q_latent 0: no query latent)
  wkv_down_DA | wk_rope_DR      kv_a_proj_with_mqa [A + R, D]
  wk_up_AHK | wv_up_AHK         kv_b_proj [H (K + K), A]   per head: K key dims, then K value dims
  wo_HKD                        o_proj [D, H K]
  router_bias_E                 gate.e_score_correction_bias (zeros when ours has none)
  final_norm / sqrt(D)          model.norm                 (our logits are scaled by 1/sqrt(D); a model
                                                           imported from HF keeps HF's weight: final_norm_folded)
  embed_VD (padded rows too)    embed_tokens
  head_VD                       lm_head                    (tie_embeddings false; tied: embed_tokens is both)

RoPE: ours rotates pairs (x[2i], x[2i+1]); HF's `rope_interleave: true` rotates the same
pairs (it writes them out de-interleaved, to queries and keys alike, which leaves every
score unchanged), and DeepseekV2 rotates them as complex numbers in place, so RoPE
weights copy as they are.

Vocabulary: the exported vocab_size is our padded one, so HF's logits and loss are ours
over every row; generation_config.json suppresses the padding ids, as our sampler does.

Capacity: HF never drops tokens, so an export equals our dropless forward
(capacity_factor 0, and decoding), not a capacity-dropping training step.

Experts: per-expert tensors (experts.{e}.gate_proj...) for deepseek_v3 and deepseek_v2, as
DeepSeek's own checkpoints have them (transformers fuses them on load); fused ones
(experts.gate_up_proj, experts.down_proj) for meshformer, as its classes store them
(transformers converts names for its own model types only, not for remote code).
Either imports.
"""

import dataclasses
import itertools
import json
import math
import os
import shutil

import jax
import ml_dtypes
import numpy as np

from hf.config import (
    ARCH_FIELDS,
    REMOTE_CODE,
    adopt_hf_config,
    architecture_of,
    check_exportable,
    from_hf_config,
    hf_dir,
    read_hf_config,
    to_hf_config,
)
from hf.safetensors_reader import Checkpoint
from hf.tokenizer import write_tokenizer
from model import abstract_params
from parallel.weights import WEIGHTS, row
from utils import ConfigError

EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
# Our module names -> HF's (DeepseekV3's modeling code). Each weight's own tensor name
# under its module, and how it is laid out there, is its row in weights.WEIGHTS.
HF_MODULES = {"attn_norm": "input_layernorm", "attn": "self_attn", "q_norm": "q_a_layernorm", "kv_norm": "kv_a_layernorm",
              "ffn_norm": "post_attention_layernorm", "ffn": "mlp", "shared": "shared_experts", "final_norm": "norm"}
TOP_LEVEL = {"head_VD"}  # weights whose HF tensor sits outside `model.` (lm_head.weight)


def hf_name(keys, prefix, fused_experts=False):
    """The HF tensor of our weight at `keys` (module names, then the weight name) under
    `prefix` ("model." or "model.layers.{l}."); routed experts' names hold `{e}`
    unless fused_experts (one tensor for all experts)."""
    hf = row(keys[-1]).hf
    tensor = hf.fused if fused_experts and hf.fused else hf.name
    if keys[-1] in TOP_LEVEL:
        return tensor
    return prefix + ".".join([*(HF_MODULES[k] for k in keys[:-1]), tensor])


def hf_layout(tree, prefix, fused_experts):
    """{HF tensor: [keys of our weights in it]} for a dict of our weights (one layer's, or
    the top level's), the weights of one tensor in table order (concatenated along their
    last dim)."""
    layout = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = tuple(k.key for k in path)
        layout.setdefault(hf_name(keys, prefix, fused_experts), []).append(keys)
    order = list(WEIGHTS)
    return {name: sorted(parts, key=lambda keys: order.index(keys[-1])) for name, parts in layout.items()}


def torch_shape(shape, weight):
    """HF's shape for ours: [E.., out, in] (nn.Linear's [out, in]) for a weight with
    fan-in dims, whose fan-in and fan-out dims flatten into `in` and `out`."""
    if weight.fan_in is None:
        return tuple(shape)
    b = int(weight.routed)
    return (*shape[:b], math.prod(shape[b + weight.fan_in:]), math.prod(shape[b:b + weight.fan_in]))


def leaf_at(tree, keys):
    for k in keys:
        tree = tree[k]
    return tree


# ---- Import: where each of our weights is in the checkpoint, read by box


@dataclasses.dataclass(frozen=True)
class Source:
    """One of our weights in an HF checkpoint.

    names: its HF tensor for each block (stacked weights), or the one tensor; a routed
      expert's name holds `{e}` when the checkpoint stores one tensor per expert.
    whole: the shape of everything in that tensor, ours (no N): our part and its siblings
      concatenated along the last dim, our part from `offset` on.
    transform: applied to what is read (the final norm's representation)."""
    names: tuple
    stacked: bool
    weight: object
    whole: tuple
    offset: int
    transform: object = None

    def read(self, tensors, index, shape):
        """Our weight's elements at `index` (a tuple of slices, as make_array_from_callback
        gives), reading only those from `tensors`."""
        ranges = [s.indices(n)[:2] for s, n in zip(index, shape)]
        if self.stacked:
            (n0, n1), ranges = ranges[0], ranges[1:]
            x = np.stack([self.read_one(tensors, self.names[n], ranges) for n in range(n0, n1)])
        else:
            x = self.read_one(tensors, self.names[0], ranges)
        return x if self.transform is None else self.transform(x)

    def read_one(self, tensors, name, ranges):
        ranges = [*ranges[:-1], (ranges[-1][0] + self.offset, ranges[-1][1] + self.offset)]
        fan_in = self.weight.fan_in
        if "{e}" in name:  # one tensor per expert: [out, in] each
            (e0, e1), rest = ranges[0], ranges[1:]
            return np.stack([read_box(tensors, name.format(e=e), fan_in, 0, self.whole[1:], rest) for e in range(e0, e1)])
        return read_box(tensors, name, fan_in, int(self.weight.routed), self.whole, ranges)

    def tensor_shapes(self):
        """{HF tensor: the shape it must have}."""
        if "{e}" in self.names[0]:
            one = torch_shape(self.whole[1:], dataclasses.replace(self.weight, routed=False))
            return {name.format(e=e): one for name in self.names for e in range(self.whole[0])}
        return {name: torch_shape(self.whole, self.weight) for name in self.names}


def read_box(tensors, name, fan_in, lead, whole, ranges):
    """Our box `ranges` (per dim of `whole`) of HF tensor `name`: as it is for a weight
    without fan-in dims; else from torch's [lead.., out, in], where our in and out dims are
    flattened, read as the rectangles of contiguous runs that make up the box."""
    if fan_in is None:
        return tensors.read(name, tuple(slice(a, b) for a, b in ranges))
    lead_box = tuple(slice(a, b) for a, b in ranges[:lead])
    in_runs = contiguous_runs(whole[lead:lead + fan_in], ranges[lead:lead + fan_in])
    out_runs = contiguous_runs(whole[lead + fan_in:], ranges[lead + fan_in:])
    x = np.concatenate([np.concatenate([tensors.read(name, lead_box + (slice(*o), slice(*i))) for i in in_runs], -1)
                        for o in out_runs], -2)  # [lead.., out box, in box], each flattened row-major
    return np.swapaxes(x, -1, -2).reshape([b - a for a, b in ranges])


def contiguous_runs(sizes, ranges):
    """The flat index runs [start, stop), in row-major order, of the box `ranges` of an
    array of shape `sizes` flattened: the innermost dims the box covers whole join the
    first partial dim from the inside into one run per index of the dims outside it.
    (q_b_proj's rows: per head h of a tp shard, the K content rows of its K + R.)"""
    j = len(sizes) - 1
    while j > 0 and tuple(ranges[j]) == (0, sizes[j]):
        j -= 1
    inner = math.prod(sizes[j + 1:])
    runs = []
    for outer in itertools.product(*(range(a, b) for a, b in ranges[:j])):
        base = int(np.ravel_multi_index(outer, sizes[:j])) * sizes[j] if j else 0
        runs.append(((base + ranges[j][0]) * inner, (base + ranges[j][1]) * inner))
    return runs


def layer_sources(shapes, L, fused_experts):
    """{our keys under a layer: Source} for one layer's weights (no N), at HF layer(s) L
    (a list: one per block when stacked)."""
    sources = {}
    for template, parts in hf_layout(shapes, "model.layers.{l}.", fused_experts).items():
        part_shapes = [leaf_at(shapes, keys).shape for keys in parts]
        whole = (*part_shapes[0][:-1], sum(s[-1] for s in part_shapes))
        offsets = np.cumsum([0] + [s[-1] for s in part_shapes])
        for keys, offset in zip(parts, offsets):
            sources[keys] = Source(tuple(template.replace("{l}", str(layer)) for layer in L), True, row(keys[-1]), whole,
                                   int(offset))
    return sources


def import_sources(m, tensors):
    """{our param path (keys): Source} for every param of model `m` that a checkpoint
    holds (not MTP's: DeepSeek-V3's MTP layer is an MoE layer, ours dense). Checks, from
    the headers alone, that every tensor is there with its shape, and that none is left
    over, so a wrong checkpoint fails before a byte of weights is read."""
    shapes = abstract_params(m)
    top = {k: shapes[k] for k in ("embed_VD", "head_VD") if k in shapes}
    sources = {}
    for template, parts in hf_layout(top, "model.", False).items():
        sources[parts[0]] = Source((template,), False, row(parts[0][-1]), shapes[parts[0][0]].shape, 0)
    sources[("final_norm", "scale_D")] = Source(("model.norm.weight",), False, row("scale_D"), (m.d_model,), 0,
                                                lambda x: final_norm_in(x, m))

    def fused(shapes, L):  # the checkpoint's choice: per-expert tensors or fused ones
        fused_only = hf_layout(shapes, "model.layers.{l}.", True).keys() - hf_layout(shapes, "model.layers.{l}.", False).keys()
        return any(name.replace("{l}", str(L)) in tensors for name in fused_only)

    for j, layer in (shapes.get("prefix") or {}).items():
        for keys, source in layer_sources(layer, [j], fused(layer, j)).items():
            sources[("prefix", j, *keys)] = dataclasses.replace(source, stacked=False)
    P = len(m.block_pattern)
    for i, layer in shapes["blocks"]["layers"].items():
        layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), layer)
        L = [m.first_dense + n * P + i for n in range(m.n_blocks)]
        for keys, source in layer_sources(layer, L, fused(layer, L[0])).items():
            sources[("blocks", "layers", i, *keys)] = source
    check_tensors(sources, tensors, m)
    return sources


def check_tensors(sources, tensors, m):
    """Every tensor the model needs is there with its shape; none is left over."""
    where = getattr(tensors, "path", "the state dict")
    needed = {}
    for keys, source in sources.items():
        needed |= source.tensor_shapes()
    for name, shape in needed.items():
        if name not in tensors:
            if name.endswith("e_score_correction_bias"):
                raise ConfigError(f"hf:{where} has no tensor {name}, which config.json's topk_method noaux_tc (DeepSeek-V3's "
                                  "router) implies: is it the model its config.json describes?")
            raise ConfigError(f"hf:{where} has no tensor {name}: is it the model its config.json describes?")
        if tuple(tensors.shapes[name]) != tuple(shape):
            raise ConfigError(f"hf:{where}: tensor {name} has shape {tuple(tensors.shapes[name])}; the model of its "
                              f"config.json needs {tuple(shape)}")
    n_layers = m.first_dense + m.n_blocks * len(m.block_pattern)
    # Multi-token-prediction layers (DeepSeek-V3's extra layers after the last) are not
    # next-token weights of this model; a tied model's lm_head copy is the embedding.
    extra = tuple(f"model.layers.{j}." for j in range(n_layers, n_layers + 8))
    unused = [k for k in tensors.names() if k not in needed and not k.startswith(extra)
              and not (k == "lm_head.weight" and m.tie_embeddings)]
    for name in [k for k in unused if k.endswith("e_score_correction_bias")]:
        if np.any(tensors.read(name) != 0):
            raise ConfigError(f"hf:{where}: {name} is not zero, and this model has no router bias: set --model.router_bias "
                              "(frozen) or --model.router_bias_rate > 0 (trained on)")
        unused.remove(name)  # zeros: the same routing without one
    if unused:
        raise ConfigError(f"hf:{where} has tensors this model has no place for, e.g. {unused[:3]}")


def mtp_note(m, tensors):
    """One line for a checkpoint with MTP layers (DeepSeek-V3's num_nextn_predict_layers), or None."""
    n_layers = m.first_dense + m.n_blocks * len(m.block_pattern)
    if any(k.startswith(f"model.layers.{n_layers}.") for k in tensors.names()):
        return (f"note: the checkpoint's multi-token-prediction layers (model.layers.{n_layers}.*) are skipped: "
                "DeepSeek-V3's MTP block is an MoE layer, ours (--model.mtp_depth) dense")
    return None


class StateDict:
    """An HF state dict in memory, read like a safetensors_reader.Checkpoint."""

    def __init__(self, tensors):
        self.tensors = tensors
        self.shapes = {k: tuple(np.shape(v)) for k, v in tensors.items()}

    def __contains__(self, name):
        return name in self.tensors

    def names(self):
        return list(self.tensors)

    def read(self, name, box=None):
        x = np.asarray(self.tensors[name])
        return np.asarray(x if box is None else x[box], np.float32)


class HFSource:
    """A Hugging Face directory opened once, like torchtitan's StateDictAdapter: its
    config.json (`config`), its tensors' headers (`tensors`: the safetensors_reader
    Checkpoint, each file's header read once) and where each of our weights is in them
    (`sources`, kept for the model last asked about). `--train.init_from hf:DIR` makes one
    (open_init_from); `adopt` decides the model from it, `load` then reads the weights
    and closes the files."""

    def __init__(self, path):
        self.path = path
        self.config = read_hf_config(path)
        self.tensors = Checkpoint(path)
        self.mapped = None  # (model config, its sources)

    def sources(self, m):
        """{our param path (keys): Source} for model `m` (import_sources), mapped from the
        headers already read; the same `m` again reuses the mapping."""
        if self.mapped is None or self.mapped[0] != m:
            self.mapped = (m, import_sources(m, self.tensors))
        return self.mapped[1]

    def adopt(self, cfg):
        """cfg with this directory's model (hf_config.adopt_hf_config), after the checks of
        `load` that need no arrays (tensor names and shapes, file headers): a bad
        checkpoint fails before anything is built or written."""
        cfg = adopt_hf_config(cfg, self.config)
        self.sources(cfg.model)
        return cfg

    def close(self):
        """Closes the files without loading (a run that resumes from its own checkpoints)."""
        self.tensors.close()

    def load(self, params, m, log=None):
        """Weights into the shardings of `params` (any mesh, any number of processes),
        streamed: each process reads, tensor by tensor, only the slices of the shards its
        own devices hold (jax.make_array_from_callback calls back per addressable shard).
        Params the checkpoint has no tensor for (MTP) keep `params`'. Closes the files."""
        expected = from_hf_config(self.config, m)
        diffs = [f"{k} {getattr(m, k)!r} vs {getattr(expected, k)!r}" for k in ARCH_FIELDS if getattr(m, k) != getattr(expected, k)]
        if diffs:
            raise ConfigError(f"the model config differs from hf:{self.path}'s ({'; '.join(diffs)})")
        with self.tensors as tensors:
            sources = self.sources(m)
            note = mtp_note(m, tensors)
            if note and log is not None:
                log(note)
            leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
            arrays = []
            for key_path, target in leaves:
                source = sources.get(tuple(getattr(k, "key", getattr(k, "idx", None)) for k in key_path))
                if source is None:
                    arrays.append(target)
                    continue
                arrays.append(jax.make_array_from_callback(target.shape, target.sharding,
                                                           shard_reader(source, tensors, target.shape)))
        return jax.tree_util.tree_unflatten(treedef, arrays)


def open_init_from(cfg):
    """The one place `--train.init_from hf:DIR` is told apart (main.py and serving/modes.py call
    it): (cfg with that directory's model, its HFSource), which checkpoint.restore_params
    then loads from; (cfg, None) for any other init_from (a run or an export directory)."""
    path = hf_dir(cfg.train.init_from)
    if path is None:
        return cfg, None
    source = HFSource(path)
    return source.adopt(cfg), source


def shard_reader(source, tensors, shape):
    """make_array_from_callback's callback for one param: its slice at `index`, read once
    per process (devices holding the same slice, a replicated norm scale, share it)."""
    read = {}

    def callback(index):
        key = tuple((s.start, s.stop) for s in index)
        if key not in read:
            read[key] = source.read(tensors, index, shape)
        return read[key]
    return callback


def from_hf_state(tensors, m):
    """Our params (pure dict of float32 numpy arrays, stacked blocks; no MTP) from an HF
    state dict in memory; the inverse of `to_hf_state`. Per-expert or fused experts."""
    state = StateDict(tensors)
    sources = import_sources(m, state)
    shapes = dict(jax.tree_util.tree_flatten_with_path(abstract_params(m))[0])
    out = {}
    for key_path, shape in shapes.items():
        keys = tuple(k.key for k in key_path)
        if keys in sources:
            node = out
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = sources[keys].read(state, tuple(slice(None) for _ in shape.shape), shape.shape)
    return out


# ---- Export: ours -> HF state dict (numpy)


def final_norm_out(scale_D, m, dtype=np.float32):
    """HF's final norm weight: ours times our logits' 1/sqrt(D), rounded once into `dtype`
    (ours as it is when it already holds that factor, m.final_norm_folded)."""
    scale_D = np.asarray(scale_D, np.float32)
    if not m.final_norm_folded:
        scale_D = (scale_D.astype(np.float64) / math.sqrt(m.d_model)).astype(np.float32)
    return scale_D.astype(dtype)


def final_norm_in(weight_D, m):
    """Our final norm scale for HF's weight: the weight itself with m.final_norm_folded
    (what an import from a foreign model sets), else the float32 nearest weight x sqrt(D).
    The latter is for our own exports: a weight that an export wrote exports back from
    it to exactly itself (every one of 10^5 draws at D = 32, 128 and 768), and so does
    every bfloat16 weight. A foreign float32 weight can fall between two values an
    export can write (1/sqrt(D) is not a power of two, so no float32 scale maps onto
    it; 11-13% of random draws), hence the folded representation for those."""
    weight_D = np.asarray(weight_D).astype(np.float32)
    if m.final_norm_folded:
        return weight_D
    return (weight_D.astype(np.float64) * math.sqrt(m.d_model)).astype(np.float32)


def to_hf_tensors(tree, prefix, fused_experts):
    """{HF name: array} of a dict of our weights (numpy, no N dim)."""
    out = {}
    for name, parts in hf_layout(tree, prefix, fused_experts).items():
        weight = row(parts[0][-1])
        x = np.concatenate([leaf_at(tree, keys) for keys in parts], -1)
        if weight.fan_in is not None:  # ours [E.., in.., out..] -> torch's [E.., out, in]
            out_size, in_size = torch_shape(x.shape, weight)[-2:]
            x = np.swapaxes(x.reshape(*x.shape[:int(weight.routed)], in_size, out_size), -1, -2)
        if "{e}" in name:  # one tensor per expert
            out |= {name.format(e=e): x[e] for e in range(x.shape[0])}
        else:
            out[name] = x
    return out


def layer_to_hf(w, kind, L, m, model_type):
    """{HF name: array} of one layer's weights (numpy, no N) at HF layer L."""
    D, fused_experts = m.d_model, model_type == "meshformer"
    if kind == "M" and "shared" not in w["ffn"]:  # HF's MoE layers always have shared experts: none = width 0
        w["ffn"]["shared"] = {"w_gate_DF": np.zeros((D, 0), np.float32), "w_up_DF": np.zeros((D, 0), np.float32),
                              "w_down_FD": np.zeros((0, D), np.float32)}
    if kind == "M" and model_type != "deepseek_v2" and "router_bias_E" not in w["ffn"]:
        w["ffn"]["router_bias_E"] = np.zeros((m.n_experts,), np.float32)  # noaux_tc's bias: ours, or zeros
    return to_hf_tensors(w, f"model.layers.{L}.", fused_experts)


def to_hf_state(params, m, dtype=np.float32):
    """{HF name: array} from our params (a pure dict of host arrays, the stacked blocks'
    leading axis N included). Per-expert names (experts.{e}.gate_proj...) for
    deepseek_v3 and deepseek_v2, as DeepSeek's own checkpoints and vLLM/SGLang have them;
    meshformer's fused expert tensors, as its (remote-code) class stores them.
    Multi-token prediction modules are not exported (num_nextn_predict_layers 0)."""
    check_exportable(m)
    model_type = architecture_of(m)[0]
    top = {k: params[k] for k in ("embed_VD", "head_VD") if k in params}
    top["final_norm"] = {"scale_D": final_norm_out(params["final_norm"]["scale_D"], m, dtype)}
    out = to_hf_tensors(top, "model.", False)
    for j, layer in (params.get("prefix") or {}).items():
        out |= layer_to_hf(jax.tree.map(np.asarray, layer), "D", int(j), m, model_type)
    P = len(m.block_pattern)
    for n in range(m.n_blocks):
        for i, kind in enumerate(m.block_pattern):
            w = jax.tree.map(lambda a: np.asarray(a[n]), params["blocks"]["layers"][i])
            out |= layer_to_hf(w, kind, m.first_dense + n * P + i, m, model_type)
    return {k: np.ascontiguousarray(np.asarray(v, np.float32).astype(dtype)) for k, v in out.items()}


# ---- Files


def write_hf_dir(out_dir, params, m, tokenizer, dtype="float32"):
    """The whole export: config.json, model.safetensors, generation_config.json, the
    tokenizer (tokenizer.json + tokenizer_config.json) and, for a model no built-in
    transformers class computes, modeling_meshformer.py (config.json's auto_map names
    it). `params`: host arrays."""
    from safetensors.numpy import save_file

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--export.dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    config = to_hf_config(m, tokenizer, dtype)
    state = to_hf_state(params, m, EXPORT_DTYPES[dtype])
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    V = config["vocab_size"]
    generation = {"eos_token_id": tokenizer.eot_id, "pad_token_id": tokenizer.eot_id,
                  # Padding rows of the vocabulary are never sampled here; nor there.
                  "suppress_tokens": list(range(tokenizer.vocab_size, V)) or None}
    for name, content in (("config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f, indent=2)
    if "auto_map" in config:
        shutil.copyfile(REMOTE_CODE, os.path.join(out_dir, os.path.basename(REMOTE_CODE)))
    write_tokenizer(out_dir, tokenizer, m.seq_len)
    return out_dir
