"""Config dataclasses, presets and the command line; logging; FLOP/MFU accounting; plots.

Every default lives in exactly one place: the dataclasses below. The defaults ARE the
`shakespeare` preset; other presets override some fields; the command line overrides
any field as `--section.field=value` (or `--section.field value`).
"""

import dataclasses
import difflib
import json
import math
import os
import sys
import typing
from dataclasses import dataclass, field

import numpy as np


def option(default, help):
    """A config field with its one-line explanation (shown by --help)."""
    return field(default=default, metadata={"help": help})


# ----------------------------------------------------------------------------
# Config sections


@dataclass(frozen=True)
class RunConfig:
    name: str = option("", "run directory name under out_dir; empty = the preset name")
    out_dir: str = option("runs", "where run directories live")
    seed: int = option(0, "seeds init, data order and dropout; same seed = same run on any mesh")
    cpu_devices: int = option(0, "expose N fake CPU devices (try a mesh on a laptop); 0 = as JAX finds them")
    compile_cache: str = option("~/.cache/meshformer/jax", "JAX's persistent compilation cache (reruns skip compiling); empty = off")


# --model.remat values: model.apply_blocks applies layer / block / block_dots,
# parallel.pipeline_loss applies stage.
REMAT_POLICIES = ("none", "layer", "block", "block_dots", "stage")
# --train.pipeline values: parallel.pipeline_loss runs gpipe, pipeline.py the others.
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = option(0, "vocabulary size; 0 = take it from the data's manifest")
    vocab_multiple: int = option(128, "pad the vocabulary to a multiple of this (tp splits it)")
    seq_len: int = option(128, "tokens per training sequence (T)")
    d_model: int = option(128, "model width (D)")
    n_heads: int = option(4, "attention heads (H)")
    head_dim: int = option(32, "per-head dim of queries/keys/values, content part (K)")
    rope_dim: int = option(16, "per-head dim of the decoupled RoPE query/key part (R)")
    q_latent: int = option(64, "MLA query latent width (Q)")
    kv_latent: int = option(32, "MLA key/value latent width (A); with R, all the KV cache stores")
    rope_theta: float = option(10000.0, "RoPE base")
    embed_row_norm: float = option(2.0, "norm of the tied embedding's rows at init (std = this / sqrt(D)); "
                                        "the untrained output logits are at most this (model.py)")
    n_blocks: int = option(2, "blocks (N); the pipeline splits blocks over pp")
    block_pattern: str = option("DM", "layers of one block: D = dense FFN, M = MoE FFN")
    d_ff: int = option(512, "hidden units of dense FFN layers (F)")
    ffn_activation: str = option("swiglu", "dense FFN activation: swiglu | gelu")
    n_experts: int = option(8, "routed experts per MoE layer (E)")
    n_shared: int = option(1, "shared experts per MoE layer (see every token)")
    top_k: int = option(2, "routed experts per token")
    d_expert: int = option(128, "hidden units per expert")
    capacity_factor: float = option(1.5, "expert capacity = factor x group tokens x top_k / experts; 0 = dropless")
    router_score: str = option("softmax", "router scores: softmax | sigmoid")
    routing_group: int = option(0, "tokens per routing group (capacity is per group); 0 = seq_len")
    aux_loss_weight: float = option(0.01, "weight of the load-balance loss (Switch)")
    router_bias_rate: float = option(0.0, "aux-loss-free balancing (DeepSeek-V3): after every step each expert's selection bias "
                                          "moves by this towards uniform load; 0 = off (V3 used 0.001)")
    seq_aux_loss_weight: float = option(0.0, "weight of DeepSeek-V3's sequence-wise balance loss (V3 used 0.0001)")
    n_groups: int = option(1, "group-limited routing: split the experts into this many groups (HF n_group); 1 = off")
    topk_groups: int = option(1, "group-limited routing: each token picks experts in its best this-many groups (HF topk_group)")
    routed_scale: float = option(1.0, "multiply the routed experts' output by this (DeepSeek-V3 routed_scaling_factor)")
    final_norm_folded: bool = option(False, "the final norm's scale holds the logits' 1/sqrt(D) (set by --train.init_from hf:, "
                                            "which keeps HF's norm weight bit for bit); false = logits of final_norm(x) / sqrt(D)")
    mtp_depth: int = option(0, "multi-token prediction (DeepSeek-V3): extra blocks predicting tokens 2..depth+1 ahead, "
                               "trained with the rest, ignored by sampling and eval; 0 = off")
    mtp_loss_weight: float = option(0.3, "weight of the MTP loss (mean over depths; V3 used 0.3, later 0.1)")
    dropout: float = option(0.0, "dropout on residual branches")
    dtype: str = option("bfloat16", "compute dtype: float32 | bfloat16 (weights, Adam and softmax/norms stay float32)")
    grad_reduce_dtype: str = option("float32", "dtype of the gradient reductions (FSDP reduce-scatters, psums of replicated "
                                               "weights): float32 | bfloat16 (halves their bytes, loses precision)")
    attention: str = option("matmul", "attention kernel: matmul (softmax of explicit scores; fastest on CPU) | dot_product_attention (jax.nn's, cuDNN flash attention on GPU)")
    remat: str = option("none", "rematerialisation, what the backward pass recomputes: none | layer (each layer from its input) | "
                                "block (each block from its input) | block_dots (each block, keeping its matmul outputs) | "
                                "stage (all of a pipeline stage's blocks, per microbatch, from the stage input)")
    unroll_blocks: bool = option(True, "unroll the loop over blocks (faster here); false = lax.scan (compile time flat in depth)")


SHARDING_MODES = ("manual", "auto")  # --mesh.sharding: parallel.make_train_step dispatches on it


@dataclass(frozen=True)
class MeshConfig:
    dp: int = option(-1, "data parallel (FSDP) degree; -1 = all devices not used by pp and tp")
    pp: int = option(1, "pipeline stages")
    tp: int = option(1, "tensor parallel degree")
    expert_parallel: bool = option(False, "shard routed experts over dp (all-to-all dispatch)")
    sharding: str = option("manual", "manual: one shard_map, every collective written out (parallel.py) | "
                                     "auto: jax.jit with the same shardings, the compiler inserts the collectives (auto_sharding.py; pp = 1)")


@dataclass(frozen=True)
class DistConfig:
    coordinator: str = option("", "HOST:PORT of process 0; empty = single process (auto on TPU/SLURM)")
    num_processes: int = option(0, "number of processes (with --dist.coordinator)")
    process_id: int = option(0, "this process's id (with --dist.coordinator)")
    timeout_s: int = option(120, "how long to wait for a missing process before stopping")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = option(1200, "optimizer steps")
    batch_size: int = option(16, "global sequences per step")
    microbatches: int = option(1, "split each step's batch (pipeline microbatches; accumulation when pp=1)")
    lr: float = option(5e-3, "peak learning rate")
    min_lr_ratio: float = option(0.0, "final lr as a fraction of the peak")
    warmup_steps: int = option(50, "linear warmup steps")
    decay_steps: int = option(0, "cosine decay ends here; 0 = train.steps")
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    grad_clip: float = option(1.0, "clip the global gradient norm to this; 0 = off")
    eval_every: int = option(200, "evaluate every N steps (and at the end)")
    eval_batches: int = option(8, "validation batches per evaluation")
    eval_capacity_factor: float = option(0.0, "expert capacity factor of evaluation (val_loss); 0 = dropless, "
                                              "the function that sampling computes")
    checkpoint_every: int = option(500, "checkpoint every N steps (and at the end)")
    keep_checkpoints: int = option(2, "how many recent checkpoints to keep")
    resume_step: int = option(-1, "resume from this checkpoint step; -1 = the latest")
    init_from: str = option("", "start from these params (export or checkpoint dir, or hf:DIR, a Hugging Face "
                                "DeepseekV3-format directory whose architecture the model takes) with a fresh optimizer")
    pipeline: str = option("gpipe", "pipeline schedule over pp: gpipe (all forwards, then all backwards) | 1f1b (one forward, "
                                    "one backward: at most pp microbatches alive) | interleaved (1f1b over virtual_stages chunks per stage)")
    virtual_stages: int = option(2, "interleaved: chunks of blocks per stage (V); a microbatch passes every stage V times")


@dataclass(frozen=True)
class DataConfig:
    source: str = option("shakespeare", "embedded name, local directory, or gs://bucket/prefix")
    cache_dir: str = option("data_cache", "where embedded data is prepared and gs:// shards are cached")
    cache_max_gb: float = option(20.0, "size bound of the gs:// shard cache")
    tokenizer: str = option("bytes", "bytes | a tiktoken encoding name; must match the data's manifest")
    encoding_file: str = option("", "local .tiktoken file for the tokenizer (when it cannot be downloaded)")


@dataclass(frozen=True)
class LogConfig:
    every: int = option(10, "log train metrics every N steps")
    wandb: bool = option(False, "log to Weights & Biases (WANDB_MODE=offline works without a key)")
    wandb_project: str = option("meshformer", "wandb project")
    progress: bool = option(True, "show a progress bar")
    show_sharding: bool = option(False, "draw the sharding of the batch and of one weight per kind")
    plots: bool = option(True, "write plots into the run directory at the end")


@dataclass(frozen=True)
class SampleConfig:
    prompt: str = option("ROMEO:", "text to continue")
    max_tokens: int = option(300, "tokens to generate")
    temperature: float = option(0.8, "0 = greedy")
    top_k: int = option(40, "sample among the k most likely tokens; 0 = all")
    seed: int = option(0, "sampling seed")
    num_samples: int = option(2, "samples written to samples.txt at the end of training")


@dataclass(frozen=True)
class ExportConfig:
    dtype: str = option("bfloat16", "--mode export_hf: dtype of model.safetensors, float32 | bfloat16")


@dataclass(frozen=True)
class ServeConfig:
    host: str = option("127.0.0.1", "address --mode serve listens on (0.0.0.0 = every interface; set MESHFORMER_API_KEY then)")
    port: int = option(8000, "port --mode serve listens on")
    slots: int = option(8, "sequences decoded together: the batch of the one compiled decode step")
    max_tokens: int = option(1024, "the largest max_tokens a request may ask for")
    queue: int = option(64, "sequences that may wait for a slot; more get 429")


@dataclass(frozen=True)
class Config:
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    dist: DistConfig = DistConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    log: LogConfig = LogConfig()
    sample: SampleConfig = SampleConfig()
    serve: ServeConfig = ServeConfig()
    export: ExportConfig = ExportConfig()
    preset: str = "shakespeare"
    mode: str = "train"


MODES = ("train", "sample", "export", "eval", "serve", "export_hf")

# ----------------------------------------------------------------------------
# Presets: overrides of the defaults above (which are `shakespeare`).

PRESETS = {
    "shakespeare": {},
    # Small enough that one train step compiles and runs in well under a second:
    # for tests. 8 blocks so that pp can be 8; 8 experts so that dp can be 8 with
    # expert parallelism; widths divisible by 8 for tp and FSDP. Sigmoid router and
    # MoE in every layer: a DeepSeek-V3 in every respect, so its Hugging Face export
    # loads with transformers' AutoModelForCausalLM (hf_interop.py).
    # Embedding rows of norm 1 (at D = 32 with 8 blocks, norm 2 gives the input token
    # a logit of 1.06 at init) and min_lr_ratio 0.1: the tests' calibrated figures.
    "tiny": {
        "model": dict(vocab_multiple=64, seq_len=16, d_model=32, n_heads=8, head_dim=8,
                      rope_dim=8, q_latent=16, kv_latent=16, n_blocks=8, block_pattern="M", d_ff=64,
                      n_experts=8, n_shared=1, top_k=2, d_expert=16, capacity_factor=1.5, router_score="sigmoid",
                      embed_row_norm=1.0, unroll_blocks=False, remat="block", dtype="float32"),
        "train": dict(steps=100, batch_size=16, microbatches=1, lr=3e-3, warmup_steps=10, min_lr_ratio=0.1,
                      eval_every=50, eval_batches=2, checkpoint_every=50),
        "log": dict(every=10),
    },
    # The shakespeare size with DeepSeek-V3's MoE recipe: sigmoid scores, aux-loss-free
    # bias balancing (plus V3's tiny sequence-wise loss instead of the Switch loss),
    # 4 expert groups of 2 with each token's experts in its best 2 groups, routed output
    # scaled by 2.5, and one multi-token-prediction depth.
    "deepseek_v3": {
        "model": dict(router_score="sigmoid", router_bias_rate=0.001, aux_loss_weight=0.0, seq_aux_loss_weight=0.0001,
                      n_groups=4, topk_groups=2, routed_scale=2.5, mtp_depth=1, mtp_loss_weight=0.3),
    },
    # The reference MoE: ~1B parameters in total, about a third active per token.
    "moe1b": {
        "model": dict(vocab_size=100277, seq_len=1024, d_model=768, n_heads=12, head_dim=64, rope_dim=64,
                      q_latent=384, kv_latent=128, n_blocks=8, block_pattern="DDDDDM", d_ff=2048,
                      n_experts=16, n_shared=2, top_k=2, d_expert=2048, capacity_factor=1.5,
                      dtype="bfloat16", unroll_blocks=False, remat="block"),
        "mesh": dict(dp=8, pp=2, tp=2),
        "train": dict(steps=75000, batch_size=256, microbatches=4, lr=6e-4, warmup_steps=5000, min_lr_ratio=0.1,
                      eval_every=1000, eval_batches=32, checkpoint_every=1000, weight_decay=0.1),
        "data": dict(tokenizer="cl100k_base", source="gs://YOUR_BUCKET/fineweb-edu-cl100k"),
    },
}


def apply_overrides(cfg, overrides):
    """Return cfg with {section: {field: value}} applied."""
    sections = {name: dataclasses.replace(getattr(cfg, name), **values) for name, values in overrides.items()}
    return dataclasses.replace(cfg, **sections)


# ----------------------------------------------------------------------------
# Command line, generated from the dataclasses


class ConfigError(ValueError):
    """A config the user can fix; the message says how."""


def config_fields():
    """{"section.field": (section, Field, type)} for every config field."""
    out = {}
    for section in dataclasses.fields(Config):
        if not dataclasses.is_dataclass(section.default):
            continue
        hints = typing.get_type_hints(type(section.default))
        for f in dataclasses.fields(section.default):
            out[f"{section.name}.{f.name}"] = (section.name, f, hints[f.name])
    return out


def parse_value(flag, text, kind):
    if kind is bool:
        lowered = str(text).lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--{flag} expects true or false, got {text!r}")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"--{flag} expects {'an integer' if kind is int else 'a number' if kind is float else kind.__name__}, got {text!r}") from None


def help_text():
    lines = [f"usage: python main.py [--preset NAME] [--mode {'|'.join(MODES)}] [--section.field=value ...]", "",
             f"  --preset NAME   one of {', '.join(PRESETS)} (default shakespeare)",
             f"  --mode MODE     {' | '.join(MODES)} (default train)", ""]
    section = None
    for flag, (name, f, kind) in config_fields().items():
        if name != section:
            section = name
            lines.append(f"{name}:")
        lines.append(f"  --{flag:<24} {f.metadata['help']} (default {f.default!r})")
    return "\n".join(lines)


def parse_args(argv):
    """argv -> Config. Unknown flags and bad values raise ConfigError with a hint."""
    fields = config_fields()
    preset, mode, overrides = "shakespeare", "train", {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(help_text())
            sys.exit(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: flags look like --section.field=value (see --help)")
        name, has_value, value = arg[2:].partition("=")
        known = name in fields or name in ("preset", "mode")
        if not known:
            close = difflib.get_close_matches(name, list(fields) + ["preset", "mode"], n=3)
            hint = f"; did you mean {' or '.join('--' + c for c in close)}?" if close else "; see --help"
            raise ConfigError(f"unknown flag --{name}{hint}")
        kind = fields[name][2] if name in fields else str
        if not has_value:
            next_is_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            if kind is bool and not (next_is_value and argv[i + 1].lower() in ("true", "false", "1", "0", "yes", "no", "on", "off")):
                value = "true"  # a boolean flag given alone means true
            elif next_is_value:
                value, i = argv[i + 1], i + 1
            else:
                raise ConfigError(f"--{name} needs a value")
        if name == "preset":
            if value not in PRESETS:
                raise ConfigError(f"unknown preset {value!r}; choose one of {', '.join(PRESETS)}")
            preset = value
        elif name == "mode":
            if value not in MODES:
                raise ConfigError(f"unknown mode {value!r}; choose one of {', '.join(MODES)}")
            mode = value
        else:
            section, f, kind = fields[name]
            overrides.setdefault(section, {})[f.name] = parse_value(name, value, kind)
        i += 1
    cfg = apply_overrides(Config(preset=preset, mode=mode), PRESETS[preset])
    cfg = apply_overrides(cfg, overrides)
    if not cfg.run.name:
        cfg = apply_overrides(cfg, {"run": {"name": preset}})
    validate_model(cfg)
    return cfg


def validate_model(cfg):
    """Checks that need no devices; mesh checks are in parallel.py."""
    m, t = cfg.model, cfg.train
    checks = [
        (set(m.block_pattern) <= {"D", "M"} and m.block_pattern, f"--model.block_pattern must be a string of D and M, got {m.block_pattern!r}"),
        (m.ffn_activation in ("swiglu", "gelu"), f"--model.ffn_activation must be swiglu or gelu, got {m.ffn_activation!r}"),
        (m.router_score in ("softmax", "sigmoid"), f"--model.router_score must be softmax or sigmoid, got {m.router_score!r}"),
        (m.dtype in ("float32", "bfloat16"), f"--model.dtype must be float32 or bfloat16, got {m.dtype!r}"),
        (m.grad_reduce_dtype in ("float32", "bfloat16"), f"--model.grad_reduce_dtype must be float32 or bfloat16, got {m.grad_reduce_dtype!r}"),
        (m.attention in ("matmul", "dot_product_attention"), f"--model.attention must be matmul or dot_product_attention, got {m.attention!r}"),
        (cfg.export.dtype in ("float32", "bfloat16"), f"--export.dtype must be float32 or bfloat16, got {cfg.export.dtype!r}"),
        (m.remat in REMAT_POLICIES, f"--model.remat must be one of {', '.join(REMAT_POLICIES)}, got {m.remat!r}"),
        (m.rope_dim % 2 == 0, f"--model.rope_dim must be even (RoPE rotates pairs), got {m.rope_dim}"),
        (1 <= m.top_k <= m.n_experts, f"--model.top_k ({m.top_k}) must be between 1 and --model.n_experts ({m.n_experts})"),
        (m.capacity_factor >= 0, "--model.capacity_factor must be >= 0 (0 = dropless)"),
        (m.router_bias_rate >= 0 and m.seq_aux_loss_weight >= 0, "--model.router_bias_rate and --model.seq_aux_loss_weight must be >= 0"),
        (m.routed_scale > 0, f"--model.routed_scale must be > 0, got {m.routed_scale}"),
        (0 <= m.mtp_depth < m.seq_len, f"--model.mtp_depth ({m.mtp_depth}) must be >= 0 and below --model.seq_len ({m.seq_len})"),
        (m.n_groups >= 1 and m.n_experts % m.n_groups == 0,
         f"--model.n_groups ({m.n_groups}) must be >= 1 and divide --model.n_experts ({m.n_experts})"),
        (m.n_groups == 1 or m.n_experts // m.n_groups >= 2,
         f"--model.n_groups ({m.n_groups}) leaves fewer than 2 experts per group (a group's score is its two best); use fewer groups"),
        (1 <= m.topk_groups <= m.n_groups, f"--model.topk_groups ({m.topk_groups}) must be between 1 and --model.n_groups ({m.n_groups})"),
        (m.n_groups == 1 or m.top_k <= m.topk_groups * (m.n_experts // m.n_groups),
         f"--model.top_k ({m.top_k}) exceeds the experts in --model.topk_groups ({m.topk_groups}) groups of "
         f"{m.n_experts // m.n_groups}; raise --model.topk_groups"),
        (m.seq_len % (m.routing_group or m.seq_len) == 0, f"--model.routing_group ({m.routing_group}) must divide --model.seq_len ({m.seq_len})"),
        (0 <= m.dropout < 1, "--model.dropout must be in [0, 1)"),
        (cfg.mesh.sharding in SHARDING_MODES, f"--mesh.sharding must be manual or auto, got {cfg.mesh.sharding!r}"),
        (cfg.mesh.sharding != "auto" or cfg.mesh.pp == 1, f"--mesh.sharding auto does not pipeline (--mesh.pp {cfg.mesh.pp}): "
                                                           "use --mesh.pp 1, or --mesh.sharding manual for pipeline stages"),
        (cfg.mesh.sharding != "auto" or not (m.router_bias_rate or m.seq_aux_loss_weight or m.mtp_depth),
         "--model.router_bias_rate, --model.seq_aux_loss_weight and --model.mtp_depth are not in --mesh.sharding auto yet "
         "(its step has no bias update, sequence-wise loss or MTP): use --mesh.sharding manual, or set them to 0"),
        (t.steps >= 0 and t.batch_size > 0 and t.microbatches > 0, "--train.steps must be >= 0, --train.batch_size and --train.microbatches > 0"),
        (t.batch_size % t.microbatches == 0, f"--train.batch_size ({t.batch_size}) must be divisible by --train.microbatches ({t.microbatches})"),
        (t.pipeline in PIPELINE_SCHEDULES, f"--train.pipeline must be one of {', '.join(PIPELINE_SCHEDULES)}, got {t.pipeline!r}"),
        (t.pipeline == "gpipe" or not (m.mtp_depth or m.seq_aux_loss_weight),
         f"--model.mtp_depth and --model.seq_aux_loss_weight are not in the hand-written backward of --train.pipeline "
         f"{t.pipeline} yet: use --train.pipeline gpipe, or set them to 0"),
        (t.virtual_stages >= 1, f"--train.virtual_stages must be >= 1, got {t.virtual_stages}"),
        (t.eval_capacity_factor >= 0, "--train.eval_capacity_factor must be >= 0 (0 = dropless)"),
        (cfg.serve.slots >= 1 and cfg.serve.max_tokens >= 1 and cfg.serve.queue >= 0,
         "--serve.slots and --serve.max_tokens must be >= 1, --serve.queue >= 0"),
        (0 <= cfg.serve.port < 65536, f"--serve.port must be in 0..65535, got {cfg.serve.port}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def config_to_dict(cfg):
    return dataclasses.asdict(cfg)


def config_from_dict(d):
    sections = {f.name: type(f.default)(**d[f.name]) for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.default) and f.name in d}
    return Config(**sections, preset=d.get("preset", "shakespeare"), mode=d.get("mode", "train"))


# ----------------------------------------------------------------------------
# Parameter and FLOP accounting (no allocation: shapes only)


def count_params(model_cfg):
    """(total, active per token) parameter counts, from shapes alone (nnx.eval_shape)."""
    import jax
    from flax import nnx

    from model import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    total, routed = 0, 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        size = math.prod(leaf.shape)
        total += size
        if any(getattr(k, "key", None) in ("w_gate_EDF", "w_up_EDF", "w_down_EFD") for k in path):
            routed += size
    inactive = routed * (model_cfg.n_experts - model_cfg.top_k) / model_cfg.n_experts
    return total, int(total - inactive)


def flops_per_token(model_cfg):
    """Model FLOPs to train on one token (forward + backward = 3 x forward).

    forward = 2 x (active matmul params) + attention scores and values:
      matmul params: every active weight except the embedding lookup (a gather), but the
      tied output layer is a real matmul of V x D, so it counts once;
      attention: per layer 2 x T x H x (K + R) for q.k and 2 x T x H x K for p.v
      (full T x T, as in the PaLM paper's MFU accounting).
    Remat recomputation is not counted: MFU measures useful work.
    """
    m = model_cfg
    total, active = count_params(m)
    norms = m.d_model * (2 * m.n_blocks * len(m.block_pattern) + 1) + m.n_blocks * len(m.block_pattern) * (m.q_latent + m.kv_latent)
    matmul_params = active - norms  # the embedding counts once, as the output layer
    n_layers = m.n_blocks * len(m.block_pattern)
    attention = n_layers * 2 * m.seq_len * m.n_heads * (2 * m.head_dim + m.rope_dim)
    return 3 * (2 * matmul_params + attention)


# ----------------------------------------------------------------------------
# Logging: stdout, metrics.jsonl, wandb


class MetricsLog:
    """Appends one JSON object per line to <run_dir>/metrics.jsonl and, with
    --log.wandb, mirrors each row to wandb (see wandb_row).

    On resume, `wandb_id` (kept in the checkpoint's meta) continues the same wandb run.
    The steps between that checkpoint and a crash reached wandb once already; online,
    wandb continues from the run's last step and ignores steps that do not increase,
    and resume repeats them bit for bit, so the history stays whole. Offline, each start
    writes its own offline-run-*-<id> directory; `wandb sync` uploads them in turn.
    """

    def __init__(self, run_dir, cfg, enabled=True, wandb_id=None):
        self.enabled, self.wandb = enabled, None
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
        self.prompt = cfg.sample.prompt
        if enabled and cfg.log.wandb:
            self.wandb = start_wandb(run_dir, cfg, wandb_id)

    @property
    def wandb_id(self):
        return self.wandb.id if self.wandb else None

    def write(self, row):
        if not self.enabled:
            return
        row = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb:
            self.wandb.log(wandb_row(row, self.tokens_per_step), step=row["step"])

    def log_samples(self, step, samples):
        if self.wandb:
            import wandb

            table = wandb.Table(columns=["step", "prompt", "text"], data=[[step, self.prompt, s] for s in samples])
            self.wandb.log({"samples": table}, step=step)

    def close(self):
        if self.wandb:
            self.wandb.finish()


def start_wandb(run_dir, cfg, wandb_id):
    """A wandb run in <run_dir>/wandb holding the resolved config; `wandb_id` continues
    that run. WANDB_MODE=offline needs no key and no network (`wandb sync` uploads later)."""
    import wandb

    try:
        run = wandb.init(project=cfg.log.wandb_project, name=cfg.run.name, dir=run_dir, config=config_to_dict(cfg),
                         id=wandb_id, resume="allow")
    except wandb.errors.Error as e:
        raise ConfigError(f"--log.wandb: wandb could not start ({type(e).__name__}: {e}). Log in with `wandb login` "
                          "(or set WANDB_API_KEY), or set WANDB_MODE=offline and upload later with "
                          f"`wandb sync {os.path.join(run_dir, 'wandb', 'offline-run-*')}`") from e
    run.define_metric("val_loss", summary="min")
    print(f"wandb: {'continuing' if wandb_id else 'new'} run {run.id} ({'offline' if run.offline else 'online'}) "
          f"in {run.dir}", flush=True)
    return run


def wandb_row(row, tokens_per_step):
    """One metrics.jsonl row as flat wandb keys. expert_load [blocks x experts] becomes
    expert_load/block{n}/expert{e} (blocks without routed experts are left out); `tokens`
    (step x tokens per step) lets wandb chart against tokens, as the PNGs do. `step`
    itself is wandb's x axis, not a metric."""
    flat = {"tokens": row["step"] * tokens_per_step}
    for key, value in row.items():
        if key == "expert_load":
            for n, load_E in enumerate(value):
                if any(load_E):
                    flat.update({f"expert_load/block{n}/expert{e}": x for e, x in enumerate(load_E)})
        elif isinstance(value, list):
            flat.update({f"{key}/" + "/".join(map(str, i)): x for i, x in np.ndenumerate(np.asarray(value))})
        elif key != "step":
            flat[key] = value
    return flat


def read_metrics(run_dir):
    """The rows of <run_dir>/metrics.jsonl. A last line cut short (the process was
    killed while writing it; resume redoes that step) is left out; a damaged line
    anywhere else is an error."""
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        lines = f.readlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines) and not line.endswith("\n"):
                break
            raise ValueError(f"{path}, line {number} is not JSON: {line[:80]!r}") from None
    return rows


def truncate_metrics(run_dir, after_step):
    """On resume, drop rows logged after the checkpoint so no step appears twice.
    Rewrites a copy and renames it, so a kill meanwhile loses nothing."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return
    rows = read_metrics(run_dir)
    with open(path + ".tmp", "w") as f:
        for row in rows:
            if row["step"] <= after_step:
                f.write(json.dumps(row) + "\n")
    os.replace(path + ".tmp", path)


def human(n):
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}P"



# ----------------------------------------------------------------------------
# Plots: python utils.py plot RUN_DIR (also run at the end of training)
#
# Drawn on matplotlib Figure objects directly (no pyplot): no global backend or
# figure state, so plotting from a notebook or a test changes nothing else.

PLOT_DPI = 150  # a 6.4 x 4.4 inch figure is 960 x 660 px: sharp at README width
SMOOTH_FROM = 50  # from this many train-loss points on, a smoothed curve is drawn over the raw one
HEATMAP_COLUMNS = 200  # expert-load heatmaps average longer runs down to this many columns


def plot_series(rows, key):
    """(steps, values) of the rows that carry `key`."""
    picked = [(r["step"], r[key]) for r in rows if key in r]
    return [s for s, _ in picked], [v for _, v in picked]


def smoothed(values, window):
    """Centred moving average over `window` points (fewer at the ends): unlike an
    exponential average it does not lag behind a falling loss."""
    v, kernel = np.asarray(values, float), np.ones(window)
    return (np.convolve(v, kernel, "same") / np.convolve(np.ones_like(v), kernel, "same")).tolist()


def binned(steps, values_S, max_bins):
    """Means over runs of consecutive rows, at most `max_bins` of them: a heatmap of
    thousands of steps would show only aliasing. (steps, values) as they are when short."""
    if len(steps) <= max_bins:
        return np.asarray(steps, float), np.asarray(values_S, float)
    groups = np.array_split(np.arange(len(steps)), max_bins)
    steps, values_S = np.asarray(steps, float), np.asarray(values_S, float)
    return np.array([steps[g].mean() for g in groups]), np.stack([values_S[g].mean(0) for g in groups])


def cell_edges(centers):
    """Edges of heatmap cells centred on sorted, possibly unevenly spaced x values
    (log.every steps, the last step, a gap left by a resume)."""
    c = np.asarray(centers, float)
    if len(c) == 1:
        return np.array([c[0] - 0.5, c[0] + 0.5])
    mid = (c[1:] + c[:-1]) / 2
    return np.concatenate([[2 * c[0] - mid[0]], mid, [2 * c[-1] - mid[-1]]])


def line_data(line):
    """(x, y) as a Line2D holds them: what was actually drawn."""
    return np.asarray(line.get_xdata(), float).tolist(), np.asarray(line.get_ydata(), float).tolist()


def human_ticks(axis):
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda x, _: human(x)))


def step_ticks(axis):
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def draw_loss(fig, rows, cfg):
    """Train and validation loss against tokens seen (step on the top axis)."""
    tokens_per_step = cfg["train"]["batch_size"] * cfg["model"]["seq_len"]
    steps, loss = plot_series(rows, "loss")
    val_steps, val_loss = plot_series(rows, "val_loss")
    if not steps and not val_steps:
        return None
    ax = fig.subplots()
    tokens = [s * tokens_per_step for s in steps]
    drawn = {}
    if len(loss) >= SMOOTH_FROM:
        (raw,) = ax.plot(tokens, loss, color="tab:blue", alpha=0.3, lw=0.8, label="train (raw)")
        window = max(5, len(loss) // 100 * 2 + 1)  # odd, so the average is centred on each point
        (smooth,) = ax.plot(tokens, smoothed(loss, window), color="tab:blue", lw=1.8, label="train (smoothed)")
        drawn["train_smoothed"] = line_data(smooth)
    else:
        (raw,) = ax.plot(tokens, loss, color="tab:blue", lw=1.5, label="train")
    drawn["train"] = line_data(raw)
    val_tokens = [s * tokens_per_step for s in val_steps]
    eval_capacity = cfg["train"].get("eval_capacity_factor")  # (absent in runs older than the flag)
    val_label = {None: "validation", 0: "validation (dropless)"}.get(eval_capacity, f"validation (capacity factor {eval_capacity})")
    (val,) = ax.plot(val_tokens, val_loss, "o-", color="tab:orange", ms=4, label=val_label)
    drawn["val"] = line_data(val)
    human_ticks(ax.xaxis)
    step_axis = ax.secondary_xaxis("top", functions=(lambda t: t / tokens_per_step, lambda s: s * tokens_per_step))
    step_axis.set_xlabel("step")
    step_ticks(step_axis.xaxis)
    human_ticks(step_axis.xaxis)
    ax.set(xlabel=f"tokens seen ({human(tokens_per_step)} per step)", ylabel="cross-entropy (nats/token)",
           title=f"loss, run {cfg['run']['name']}")
    ax.legend()
    ax.grid(alpha=0.3)
    return drawn


def draw_load_balance(fig, rows, cfg):
    """Load-balance loss, and the share of routed assignments dropped at capacity."""
    steps, aux = plot_series(rows, "aux_loss")
    if not any(aux):  # a dense model
        return None
    drop_steps, dropped = plot_series(rows, "dropped_frac")
    fig.set_size_inches(6.4, 5.6)
    ax, ax2 = fig.subplots(2, 1, sharex=True)
    (aux_line,) = ax.plot(steps, aux, color="tab:purple")
    ax.axhline(1.0, color="gray", ls="--", lw=1, label="1 = perfectly balanced")
    ax.set(ylabel="load-balance loss", title="load-balance loss (Switch; mean over MoE layers)")
    ax.legend()
    (drop_line,) = ax2.plot(drop_steps, [100 * d for d in dropped], color="tab:red")
    factor = cfg["model"]["capacity_factor"]
    ax2.set(xlabel="step", ylabel="dropped (%)", ylim=(0, None),
            title=f"token-to-expert assignments dropped at capacity (factor {factor:g})" if factor else
            "token-to-expert assignments dropped (dropless routing)")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    step_ticks(ax2.xaxis)
    fig.suptitle(f"routing balance, run {cfg['run']['name']}")
    return {"aux_loss": line_data(aux_line), "dropped_percent": line_data(drop_line)}


def draw_expert_load(fig, rows, cfg):
    """Fraction of routed tokens per expert, one heatmap per MoE block, over steps.
    White is the uniform share 1/E; red experts get more, blue ones fewer."""
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.ticker import MaxNLocator

    steps, loads = plot_series(rows, "expert_load")
    load_SNE = np.asarray(loads, float)
    moe_blocks = [n for n in range(load_SNE.shape[1]) if load_SNE[:, n].any()] if loads else []
    if not moe_blocks:  # a dense model
        return None
    steps, load_SNE = binned(steps, load_SNE, HEATMAP_COLUMNS)
    n_experts = load_SNE.shape[2]
    uniform = 1 / n_experts
    norm = TwoSlopeNorm(vmin=0, vcenter=uniform, vmax=max(load_SNE.max(), 2 * uniform))
    ncols = min(4, math.ceil(len(moe_blocks) / 4))
    nrows = math.ceil(len(moe_blocks) / ncols)
    fig.set_size_inches(max(6.4, 0.8 + 3.4 * ncols), 1.2 + 1.5 * nrows)
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False)
    x_edges, e_edges = cell_edges(steps), np.arange(n_experts + 1) - 0.5
    drawn = {}
    for ax, n in zip(axes.flat, moe_blocks):
        mesh = ax.pcolormesh(x_edges, e_edges, load_SNE[:, n, :].T, cmap="RdBu_r", norm=norm)
        ax.set_title(f"block {n}", fontsize=9)
        drawn[f"block{n}"] = (steps.tolist(), np.asarray(mesh.get_array(), float).T.tolist())  # [step][expert]
    for i, ax in enumerate(axes.flat):
        if i >= len(moe_blocks):
            ax.set_visible(False)
        elif i + ncols >= len(moe_blocks):  # nothing drawn below: this panel carries the step axis
            ax.set_xlabel("step")
            ax.xaxis.set_tick_params(labelbottom=True)
        if i % ncols == 0:
            ax.set_ylabel("expert")
    axes[0, 0].invert_yaxis()  # expert 0 on top (the axes share y)
    axes[0, 0].yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(n_experts, 8)))
    axes[0, 0].xaxis.set_major_locator(MaxNLocator(integer=True, nbins=5))
    human_ticks(axes[0, 0].xaxis)
    colorbar = fig.colorbar(mesh, ax=axes, label=f"fraction of routed tokens\n(white = uniform 1/{n_experts})")
    colorbar.set_ticks([0, uniform / 2, uniform, *np.linspace(uniform, norm.vmax, 4)[1:]])
    colorbar.ax.yaxis.set_major_formatter("{x:.3g}")
    fig.suptitle(f"expert load per MoE block, run {cfg['run']['name']}")
    return drawn


def draw_router_bias(fig, rows, cfg):
    """Each expert's router bias (aux-loss-free balancing), one panel per MoE layer,
    over steps: an overloaded expert's bias falls, an underloaded one's rises."""
    steps, biases = plot_series(rows, "router_bias")
    if not biases:  # balancing off
        return None
    steps, bias_SLE = binned(steps, np.asarray(biases, float), HEATMAP_COLUMNS)
    n_layers, n_experts = bias_SLE.shape[1:]
    ncols = min(4, n_layers)
    nrows = math.ceil(n_layers / ncols)
    fig.set_size_inches(max(6.4, 0.8 + 3.4 * ncols), 1.6 + 1.8 * nrows)
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False)
    drawn = {}
    for l, ax in enumerate(axes.flat):
        if l >= n_layers:
            ax.set_visible(False)
            continue
        lines = ax.plot(steps, bias_SLE[:, l, :], lw=1)
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_title(f"MoE layer {l}", fontsize=9)
        ax.grid(alpha=0.3)
        drawn[f"layer{l}"] = (np.asarray(lines[0].get_xdata(), float).tolist(),
                              np.stack([np.asarray(line.get_ydata(), float) for line in lines], axis=1).tolist())
        if l + ncols >= n_layers:
            ax.set_xlabel("step")
            ax.xaxis.set_tick_params(labelbottom=True)
        if l % ncols == 0:
            ax.set_ylabel("selection bias")
    step_ticks(axes[0, 0].xaxis)
    fig.legend(lines, [f"expert {e}" for e in range(n_experts)], loc="outside right upper", fontsize=7)
    fig.suptitle(f"router bias per expert (rate {cfg['model']['router_bias_rate']:g} per step), run {cfg['run']['name']}")
    return drawn


def draw_speed(fig, rows, cfg):
    """Tokens per second and MFU per logged step, with their medians."""
    steps, tokens_per_sec = plot_series(rows, "tokens_per_sec")
    mfu_steps, mfu = plot_series(rows, "mfu")
    if not steps:
        return None
    fig.set_size_inches(6.4, 5.6)
    ax, ax2 = fig.subplots(2, 1, sharex=True)
    (speed_line,) = ax.plot(steps, tokens_per_sec, color="tab:blue", lw=1)
    median = float(np.median(tokens_per_sec))
    ax.axhline(median, color="gray", ls="--", lw=1, label=f"median {human(median)} tokens/s")
    human_ticks(ax.yaxis)
    ax.set(ylabel="tokens/s", ylim=(0, None), title="throughput (whole mesh)")
    (mfu_line,) = ax2.plot(mfu_steps, [100 * m for m in mfu], color="tab:green", lw=1)
    if mfu:
        median_mfu = float(np.median(mfu))
        ax2.axhline(100 * median_mfu, color="gray", ls="--", lw=1, label=f"median {median_mfu:.1%}")
    ax2.set(xlabel="step", ylabel="MFU (%)", ylim=(0, None),
            title="model FLOPs utilisation (of a measured matmul peak)")
    for a in (ax, ax2):
        a.legend(loc="lower right")
        a.grid(alpha=0.3)
    step_ticks(ax2.xaxis)
    fig.suptitle(f"speed, run {cfg['run']['name']}")
    return {"tokens_per_sec": line_data(speed_line), "mfu_percent": line_data(mfu_line)}


PLOTS = {"loss.png": draw_loss, "load_balance.png": draw_load_balance, "expert_load.png": draw_expert_load,
         "router_bias.png": draw_router_bias, "speed.png": draw_speed}


def plot_run(run_dir):
    """Write PNGs into the run directory from its metrics.jsonl and config.json:
      loss.png          train and validation loss against tokens seen
      load_balance.png  load-balance loss and dropped assignments, over steps
      expert_load.png   fraction of tokens per expert, per MoE block, over steps
      router_bias.png   each expert's router bias per MoE layer (with --model.router_bias_rate)
      speed.png         tokens/s and MFU over steps
    A figure with nothing to show (a dense model has no expert load) is not written.
    Returns {file name: {series: data}}, the data read back from what was drawn:
    (x, y) for lines (percentages where the axis says %), (steps, [step][expert])
    for heatmaps."""
    from matplotlib.figure import Figure

    rows = read_metrics(run_dir)
    with open(os.path.join(run_dir, "config.json")) as f:
        cfg = json.load(f)
    drawn = {}
    for name, draw in PLOTS.items():
        fig = Figure(figsize=(6.4, 4.4), layout="constrained")
        series = draw(fig, rows, cfg)
        if series is not None:
            fig.savefig(os.path.join(run_dir, name), dpi=PLOT_DPI)
            drawn[name] = series
    return drawn


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "plot":
        for run_dir in sys.argv[2:]:
            for needed in ("metrics.jsonl", "config.json"):
                if not os.path.exists(os.path.join(run_dir, needed)):
                    sys.exit(f"error: {run_dir} has no {needed}: give a run directory (<run.out_dir>/<run.name>) "
                             "of a run that has logged at least one step")
            for name in plot_run(run_dir):
                print(os.path.join(run_dir, name))
    else:
        sys.exit("usage: python utils.py plot RUN_DIR [RUN_DIR ...]")
