"""Every config dataclass, the presets, the command line, and the few helpers everyone
uses. The ground floor: it imports nothing of the project, and everything may import it.

Every default lives in exactly one place: the dataclasses below. The defaults ARE the
`shakespeare` preset; other presets override some fields; the command line overrides
any field as `--section.field=value` (or `--section.field value`).
"""

import dataclasses
import difflib
import os
import runpy
import sys
import typing
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A config the user can fix; the message says how. main.py prints it as one line."""


def option(default, help):
    """A config field with its one-line explanation (shown by --help)."""
    return field(default=default, metadata={"help": help})


# ---- The mesh axes, named once
# AXES lie within one TPU slice (ICI), the only ones weights are split over; CP splits every sequence
# (its ranks hold the same weights, stored FSDP-sharded over dp x cp); SLICE, outermost, is data
# parallelism over the data-center network: only the step's gradient all-reduce crosses it.
DP, CP, PP, TP = "dp", "cp", "pp", "tp"
SLICE = "slice"
AXES = (DP, CP, PP, TP)
MESH_AXES = (SLICE,) + AXES
BATCH_AXES = (SLICE, DP)  # the batch's rows, slice-major: a global row index stays meaningful

HF_PREFIX = "hf:"  # --train.init_from hf:DIR: a Hugging Face checkpoint directory
SEGMENT_START = 1 << 30  # set on a packed row's first token of each document (sft: ops/packing.py), above any vocabulary

# The choices of flags whose code lives in a kernel module (ops/), named here: a config is checked without importing them.
MOE_KERNELS = ("auto", "ragged_dot", "gmm")
ATTENTION_KERNELS = ("auto", "matmul", "dot_product_attention", "blockwise", "splash")
QUANT_MODES = ("none", "int8", "fp8")
BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}  # a boolean flag's values
SPLASH_LANES = 128  # the splash kernel's lanes (jax's splash_attention_kernel.NUM_LANES): a block is a multiple

# ---- Config sections


@dataclass(frozen=True)
class RunConfig:
    name: str = option("", "run directory name under out_dir; empty = the preset name")
    out_dir: str = option("runs", "where run directories live")
    seed: int = option(0, "seeds init, data order and dropout; same seed = same run on any mesh")
    cpu_devices: int = option(0, "expose N fake CPU devices (try a mesh on a laptop); 0 = as JAX finds them")
    compile_cache: str = option("~/.cache/meshformer/jax", "JAX's persistent compilation cache (reruns skip compiling); empty = off")


# --model.remat values: model.apply_blocks applies layer / block / block_dots,
# the executors stage (around all of a pipeline stage's blocks).
REMAT_POLICIES = ("none", "layer", "block", "block_dots", "stage")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = option(0, "vocabulary size; 0 = take it from the data's manifest")
    vocab_multiple: int = option(128, "pad the vocabulary to a multiple of this (tp splits it)")
    seq_len: int = option(128, "tokens per training sequence (T)")
    d_model: int = option(128, "model width (D)")
    n_heads: int = option(4, "attention heads (H)")
    head_dim: int = option(32, "per-head dim of queries/keys/values, content part (K)")
    rope_dim: int = option(16, "per-head dim of the decoupled RoPE query/key part (R)")
    q_latent: int = option(64, "MLA query latent width (Q); 0 = full-rank queries from x, no latent (HF q_lora_rank null)")
    kv_latent: int = option(32, "MLA key/value latent width (A); with R, all the KV cache stores")
    rope_theta: float = option(10000.0, "RoPE base")
    rope_scaling: str = option("none", "RoPE frequency scaling: none | yarn (DeepSeek-V2/V3's long-context YaRN, model.py)")
    rope_factor: float = option(1.0, "yarn: context extension factor (HF rope_scaling.factor)")
    rope_original_len: int = option(4096, "yarn: the context the RoPE was trained on (HF original_max_position_embeddings)")
    yarn_beta_fast: float = option(32.0, "yarn: pairs turning more often than this over the original context keep their frequency")
    yarn_beta_slow: float = option(1.0, "yarn: pairs turning less often than this are interpolated (frequency / factor)")
    yarn_mscale: float = option(1.0, "yarn: mscale (with yarn_mscale_all_dim, the RoPE parts' factor is their mscale ratio)")
    yarn_mscale_all_dim: float = option(0.0, "yarn: mscale_all_dim; non-zero: the softmax scale x mscale(factor, this)^2")
    norm_eps: float = option(1e-6, "eps of the RMSNorms of the residual stream (HF rms_norm_eps; the latent norms keep 1e-6)")
    tie_embeddings: bool = option(True, "the output layer is the input embedding; false = a separate head (HF lm_head)")
    embed_row_norm: float = option(2.0, "norm of the embedding's (and an untied head's) rows at init (std = this / sqrt(D)); "
                                        "the untrained output logits are at most this (model.py)")
    n_blocks: int = option(2, "blocks (N); the pipeline splits blocks over pp")
    first_dense: int = option(0, "dense layers before the blocks (HF first_k_dense_replace): each a full layer (MLA attention "
                                 "+ dense FFN of d_ff hidden units), run on the first pipeline stage beside the embedding")
    block_pattern: str = option("DM", "layers of one block: D = dense FFN, M = MoE FFN")
    d_ff: int = option(512, "hidden units of dense FFN layers (F)")
    ffn_activation: str = option("swiglu", "dense FFN activation: swiglu | gelu")
    n_experts: int = option(8, "routed experts per MoE layer (E)")
    n_shared: int = option(1, "shared experts per MoE layer (see every token)")
    top_k: int = option(2, "routed experts per token")
    d_expert: int = option(128, "hidden units per expert")
    capacity_factor: float = option(1.5, "expert capacity = factor x group tokens x top_k / experts; 0 = dropless")
    moe_kernel: str = option("auto", "grouped matmul of the dropless routed experts (--model.capacity_factor 0): ragged_dot "
                                     "(jax.lax.ragged_dot) | gmm (Pallas megablox, interpret mode off TPU) | auto (utils.kernels_for)")
    router_score: str = option("softmax", "router scores: softmax | sigmoid")
    routing_group: int = option(0, "tokens per routing group (capacity is per group); 0 = seq_len")
    aux_loss_weight: float = option(0.01, "weight of the load-balance loss (Switch)")
    router_bias_rate: float = option(0.0, "aux-loss-free balancing (DeepSeek-V3): after every step each expert's selection bias "
                                          "moves by this towards uniform load; 0 = off (V3 used 0.001)")
    router_bias: bool = option(False, "a per-expert router selection bias exists even at --model.router_bias_rate 0, where it "
                                      "stays frozen; --train.init_from hf: sets it for a DeepSeek-V3 checkpoint (e_score_correction_bias)")
    seq_aux_loss_weight: float = option(0.0, "weight of DeepSeek-V3's sequence-wise balance loss (V3 used 0.0001)")
    n_groups: int = option(1, "group-limited routing: split the experts into this many groups (HF n_group); 1 = off")
    topk_groups: int = option(1, "group-limited routing: each token picks experts in its best this-many groups (HF topk_group)")
    routed_scale: float = option(1.0, "multiply the routed experts' output by this (DeepSeek-V3 routed_scaling_factor)")
    norm_topk: bool = option(True, "renormalise the routed gates over the top k (HF norm_topk_prob); false = raw scores "
                                   "(DeepSeek-V2-Lite)")
    final_norm_folded: bool = option(False, "the final norm's scale holds the logits' 1/sqrt(D) (set by --train.init_from hf:, "
                                            "which keeps HF's norm weight bit for bit); false = logits of final_norm(x) / sqrt(D)")
    mtp_depth: int = option(0, "multi-token prediction (DeepSeek-V3): extra blocks predicting tokens 2..depth+1 ahead, "
                               "trained with the rest, ignored by sampling and eval; 0 = off")
    mtp_loss_weight: float = option(0.3, "weight of the MTP loss (mean over depths; V3 used 0.3, later 0.1)")
    dropout: float = option(0.0, "dropout on residual branches")
    dtype: str = option("auto", "compute dtype: float32 | bfloat16 | auto (the faster here: bfloat16 on TPU/GPU, on CPU a "
                                "timed probe of the model's matmuls, runtime/dtype_probe.py); weights, Adam and softmax/norms stay float32")
    quant: str = option("none", "quantized training of the weight matmuls (attention projections, experts, dense FFN) "
                                "and of --model.attention matmul's scores and values (forward and backward, ops/quant.py): "
                                "none | int8 (TPU v5e/v5p/v6e: 2x bf16's peak) | fp8 (e4m3/e5m2; H100/H200, TPU v7). The router "
                                "(a tie decides where tokens go), embedding, output layer (the logits' precision is the loss's), "
                                "norms and the fused attention kernels stay in --model.dtype / float32")
    grad_reduce_dtype: str = option("float32", "dtype of the gradient reductions (FSDP reduce-scatters, psums of replicated "
                                               "weights): float32 | bfloat16 (halves their bytes, loses precision)")
    attention: str = option("auto", "attention kernel: auto (splash on a TPU where it can run, else matmul) | matmul (softmax of "
                                    "explicit scores; fastest on CPU) | dot_product_attention (jax.nn's, cuDNN flash attention on GPU) | "
                                    "blockwise (online softmax over key blocks: memory linear in seq_len; ops/blockwise.py) | splash "
                                    "(the Pallas TPU kernel, causal blocks skipped; interpret mode off the TPU, slow; ops/splash.py)")
    attention_block: int = option(512, "blockwise and splash attention: queries and keys per block (must divide seq_len, or "
                                       "exceed it; splash: a multiple of 128 once cut to seq_len)")
    remat: str = option("none", "rematerialisation, what the backward pass recomputes: none | layer (each layer from its input) | "
                                "block (each block from its input) | block_dots (each block, keeping its matmul outputs) | "
                                "stage (all of a pipeline stage's blocks, per microbatch, from the stage input)")
    unroll_blocks: bool = option(True, "unroll the loop over blocks (faster here); false = lax.scan (compile time flat in depth)")


# --train.pipeline values: parallel/gpipe.py runs gpipe, parallel/one_f_one_b.py the others (parallel/rules.executor_name).
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1", "zbv")
GATHER_ONCE = ("auto", "true", "false")  # --train.gather_once: parallel/rules.gathers_once reads it
SHARDING_MODES = ("manual", "auto")  # --mesh.sharding: parallel/rules.executor_name dispatches on it


@dataclass(frozen=True)
class MeshConfig:
    dp: int = option(-1, "data parallel (FSDP) degree; -1 = all devices of a slice not used by cp, pp and tp")
    pp: int = option(1, "pipeline stages")
    tp: int = option(1, "tensor parallel degree")
    cp: int = option(1, "context parallel degree: every sequence split into 2cp chunks, rank i holding chunks i and 2cp-1-i "
                        "(balanced causal work); attention all-gathers the MLA latent over cp (ops/context_parallel.py)")
    slices: int = option(1, "TPU slices (multi-slice data parallelism over the data-center network: weights replicated per "
                            "slice, only the gradient all-reduce crosses slices); dp x cp x pp x tp is per slice")
    expert_parallel: bool = option(False, "shard routed experts over dp (all-to-all dispatch)")
    sharding: str = option("manual", "manual: one shard_map, every collective written out (parallel/gpipe.py, parallel/one_f_one_b.py) | "
                                     "auto: jax.jit with the same shardings, the compiler inserts the collectives (parallel/auto.py; pp = 1)")


@dataclass(frozen=True)
class DistConfig:
    coordinator: str = option("", "HOST:PORT of process 0; empty = single process (auto on TPU/SLURM)")
    num_processes: int = option(0, "number of processes (with --dist.coordinator)")
    process_id: int = option(0, "this process's id (with --dist.coordinator)")
    timeout_s: int = option(120, "how long to wait for a missing process before stopping")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = option(1000, "optimizer steps")
    batch_size: int = option(16, "global sequences per step")
    microbatches: int = option(1, "split each step's batch (pipeline microbatches; accumulation when pp=1)")
    lr: float = option(7e-3, "peak learning rate")
    min_lr_ratio: float = option(0.0, "final lr as a fraction of the peak")
    warmup_steps: int = option(50, "linear warmup steps")
    decay_steps: int = option(0, "cosine decay ends here; 0 = train.steps")
    optimizer: str = option("muon", "muon (Muon on the weight matrices, AdamW on the embedding, norms and routers: parallel/optimizers.py) | adamw")
    muon_momentum: float = option(0.9, "Muon's Nesterov momentum")
    weight_decay: float = option(0.1, "decoupled weight decay (every weight but the norm scales)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    grad_clip: float = option(1.0, "clip the global gradient norm to this; 0 = off")
    qk_clip: float = option(0.0, "QK-clip (Kimi K2's MuonClip): after each update, scale the query and key weights of every "
                                 "head whose largest attention logit (metrics' max_logit) exceeded this so it would be this; "
                                 "0 = off (step_core.qk_clip)")
    eval_every: int = option(200, "evaluate every N steps (and at the end)")
    eval_batches: int = option(8, "validation batches per evaluation")
    eval_capacity_factor: float = option(0.0, "expert capacity factor of evaluation (val_loss); 0 = dropless, "
                                              "the function that sampling computes")
    checkpoint_every: int = option(500, "checkpoint every N steps (and at the end)")
    keep_checkpoints: int = option(2, "how many recent checkpoints to keep")
    local_checkpoint_every: int = option(0, "local tier: every process saves its own shards every N steps (runtime/local_tier.py); 0 = off")
    local_checkpoint_dir: str = option("", "the local tier's directory (a local or RAM disk), process_<i>/ in it; empty = <run_dir>/local")
    resume_step: int = option(-1, "resume from this checkpoint step; -1 = the latest")
    init_from: str = option("", "start from these params (export or checkpoint dir, or hf:DIR, a Hugging Face "
                                "DeepseekV3-format directory whose architecture the model takes) with a fresh optimizer")
    pipeline: str = option("gpipe", "pipeline schedule over pp: gpipe (all forwards, then all backwards) | 1f1b (one forward, one "
                                    "backward: pp alive) | interleaved (1f1b over virtual_stages chunks) | zb1 (ZB-H1: W deferred) | zbv (ZB-V)")
    gather_once: str = option("auto", "pp = 1 with several microbatches (parallel/accumulate.py): all-gather the FSDP-split "
                                      "block weights once per step (true: holds them whole, and their float32 gradient) or "
                                      "per microbatch (false) | auto: once when that costs at most a quarter of the device's memory")
    virtual_stages: int = option(2, "interleaved: chunks of blocks per stage (V); a microbatch passes every stage V times")
    objective: str = option("lm", "lm (every next token) | sft (--data.conversations) | dpo (--data.preferences: parallel/dpo.py)")
    dpo_beta: float = option(0.1, "--train.objective dpo: beta, the strength of the pull towards the reference (DPO's KL weight)")
    lora_rank: int = option(0, "LoRA: adapters of this rank train beside the frozen base weights (parallel/lora.py); 0 = off")
    lora_alpha: float = option(16.0, "LoRA: the adapters' delta A @ B is scaled by alpha / rank")
    lora_targets: str = option("", "LoRA: attention | experts (dense, shared and routed FFNs) | all; empty = attention")


@dataclass(frozen=True)
class DataConfig:
    source: str = option("shakespeare", "embedded name, local directory, or gs://bucket/prefix")
    mixture: str = option("", "NAME:WEIGHT,... (NAMEs as --data.source takes) or a JSON file with stages: docs/data.md; replaces source")
    cache_dir: str = option("data_cache", "where embedded data is prepared and gs:// shards are cached")
    cache_max_gb: float = option(20.0, "size bound of the gs:// shard cache")
    tokenizer: str = option("bytes", "bytes | a tiktoken encoding name; must match the data's manifest")
    encoding_file: str = option("", "local .tiktoken file for the tokenizer (when it cannot be downloaded)")
    conversations: str = option("", "--train.objective sft: JSONL of {\"messages\": [...]}, or plays (data/conversations.py)")
    preferences: str = option("", "--train.objective dpo: JSONL of {\"prompt\", \"chosen\", \"rejected\"}, or plays (data/preferences.py)")


@dataclass(frozen=True)
class EvalConfig:
    tasks: str = option("", "lm-evaluation-harness tasks (TASK,...) scored every --train.eval_every steps on the mesh: docs/evaluation.md")
    include_path: str = option("", "a directory of task YAML files of your own, for --eval.tasks")
    limit: int = option(0, "score only the first N documents of each task; 0 = all")


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
    frequency_penalty: float = option(0.0, "subtracted from a token's logit once per time it was generated (-2..2, OpenAI's)")
    presence_penalty: float = option(0.0, "subtracted from a token's logit once it was generated (-2..2, OpenAI's)")
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
    chat_template: str = option("", "a Jinja file, or a Hugging Face directory, whose chat template to use (default: hf:DIR's)")
    slide: bool = option(False, "prompt + max_tokens may pass the context: the window slides (vLLM, default: a 400)")


@dataclass(frozen=True)
class Config:
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    dist: DistConfig = DistConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    log: LogConfig = LogConfig()
    sample: SampleConfig = SampleConfig()
    serve: ServeConfig = ServeConfig()
    export: ExportConfig = ExportConfig()
    preset: str = "shakespeare"
    mode: str = "train"


MODES = ("train", "sample", "export", "eval", "serve", "export_hf")

# ---- Presets: overrides of the defaults above (which are `shakespeare`).

PRESETS = {
    "shakespeare": {},
    # The tests' model (a step in under a second; pp and ep up to 8): a DeepSeek-V3 transformers loads.
    "tiny": {
        "model": dict(vocab_multiple=64, seq_len=16, d_model=32, n_heads=8, head_dim=8,
                      rope_dim=8, q_latent=16, kv_latent=16, n_blocks=8, block_pattern="M", d_ff=64,
                      n_experts=8, n_shared=1, top_k=2, d_expert=16, capacity_factor=1.5, router_score="sigmoid",
                      embed_row_norm=1.0, unroll_blocks=False, remat="block", dtype="float32"),
        "train": dict(steps=100, batch_size=16, microbatches=1, lr=3e-3, warmup_steps=10, min_lr_ratio=0.1, optimizer="adamw",
                      eval_every=50, eval_batches=2, checkpoint_every=50),
        "log": dict(every=10),
    },
    # The shakespeare size with DeepSeek-V3's MoE recipe (aux-loss-free balancing, group routing, MTP).
    "deepseek_v3": {
        "model": dict(router_score="sigmoid", router_bias_rate=0.001, aux_loss_weight=0.0, seq_aux_loss_weight=0.0001,
                      n_groups=4, topk_groups=2, routed_scale=2.5, mtp_depth=1, mtp_loss_weight=0.3),
    },
    # The reference MoE: ~1B parameters in total, about a third active per token.
    "moe1b": {
        "model": dict(vocab_size=100277, seq_len=1024, d_model=768, n_heads=12, head_dim=64, rope_dim=64,
                      q_latent=384, kv_latent=128, n_blocks=8, block_pattern="DDDDDM", d_ff=2048,
                      n_experts=16, n_shared=2, top_k=2, d_expert=2048, capacity_factor=1.5,
                      dtype="bfloat16", unroll_blocks=True, remat="block"),  # unrolled: 7% faster on v4 (docs/pods.md)
        "mesh": dict(dp=8, pp=2, tp=2),
        # Muon, as every preset (its cost against AdamW on this mesh: README, "Run on a TPU pod").
        "train": dict(steps=75000, batch_size=256, microbatches=4, lr=6e-4, warmup_steps=5000, min_lr_ratio=0.1,
                      eval_every=1000, eval_batches=32, checkpoint_every=1000, weight_decay=0.1),
        "data": dict(tokenizer="cl100k_base", source="gs://YOUR_BUCKET/fineweb-edu-cl100k"),
    },
    # Real models' shapes (--train.init_from hf:DIR, docs/checkpoints.md), on a TPU slice the step fits.
    # Moonlight-16B-A3B (Moonshot AI, 2025): DeepSeek-V3's architecture, 16B parameters, 3B active.
    "moonlight": {
        "model": dict(vocab_size=163840, seq_len=4096, d_model=2048, n_heads=16, head_dim=128, rope_dim=64, q_latent=0,
                      kv_latent=512, rope_theta=50000.0, norm_eps=1e-5, tie_embeddings=False, first_dense=1, n_blocks=26,
                      block_pattern="M", d_ff=11264, n_experts=64, n_shared=2, top_k=6, d_expert=1408, capacity_factor=1.5,
                      router_score="sigmoid", router_bias_rate=0.001, aux_loss_weight=0.0, seq_aux_loss_weight=0.0001,
                      routed_scale=2.446, dtype="bfloat16", unroll_blocks=False, remat="block"),
        "mesh": dict(dp=8, pp=2, tp=2),  # v4-64 (planner.py --tpu v4-64: docs/planning.md)
        "train": dict(steps=10000, batch_size=64, microbatches=4, lr=2e-4, warmup_steps=500, min_lr_ratio=0.1,
                      eval_every=500, eval_batches=8, checkpoint_every=500, weight_decay=0.1),
    },
    # DeepSeek-V2-Lite (DeepSeek-AI, 2024): 16B parameters, 2.4B active; softmax gates, YaRN RoPE.
    "deepseek_v2_lite": {
        "model": dict(vocab_size=102400, seq_len=4096, d_model=2048, n_heads=16, head_dim=128, rope_dim=64, q_latent=0,
                      kv_latent=512, rope_scaling="yarn", rope_factor=40.0, rope_original_len=4096, yarn_beta_fast=32.0,
                      yarn_beta_slow=1.0, yarn_mscale=0.707, yarn_mscale_all_dim=0.707, tie_embeddings=False, first_dense=1,
                      n_blocks=26, block_pattern="M", d_ff=10944, n_experts=64, n_shared=2, top_k=6, d_expert=1408,
                      capacity_factor=1.5, router_score="softmax", norm_topk=False, aux_loss_weight=0.001,
                      dtype="bfloat16", unroll_blocks=False, remat="block"),
        "mesh": dict(dp=8, pp=2, tp=2),  # v4-64 (planner.py --tpu v4-64: docs/planning.md)
        "train": dict(steps=10000, batch_size=64, microbatches=4, lr=2e-4, warmup_steps=500, min_lr_ratio=0.1,
                      eval_every=500, eval_batches=8, checkpoint_every=500, weight_decay=0.1),
    },
}


def kernels_for(cfg, platform):
    """cfg with the auto kernels decided for jax's `platform` (tpu, gpu, cpu): --model.attention splash on a TPU where splash_checks
    pass, else matmul; --model.moe_kernel gmm on a TPU for dropless experts under manual sharding (the partitioner cannot split it)."""
    m, tpu = cfg.model, platform == "tpu"
    splash = tpu and all(ok for ok, _ in splash_checks(apply_overrides(cfg, {"model": {"attention": "splash"}})))
    gmm = tpu and cfg.mesh.sharding == "manual" and m.capacity_factor == 0 and m.quant == "none"
    return apply_overrides(cfg, {"model": {"attention": ("splash" if splash else "matmul") if m.attention == "auto" else m.attention,
                                           "moe_kernel": ("gmm" if gmm else "ragged_dot") if m.moe_kernel == "auto" else m.moe_kernel}})


def apply_overrides(cfg, overrides):
    """Return cfg with {section: {field: value}} applied."""
    sections = {name: dataclasses.replace(getattr(cfg, name), **values) for name, values in overrides.items()}
    return dataclasses.replace(cfg, **sections)


# ---- Command line, generated from the dataclasses


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
        if str(text).lower() not in BOOL_WORDS:
            raise ConfigError(f"--{flag} expects true or false, got {text!r}")
        return BOOL_WORDS[str(text).lower()]
    try:
        return kind(text)
    except ValueError:
        expected = "an integer" if kind is int else "a number" if kind is float else kind.__name__
        raise ConfigError(f"--{flag} expects {expected}, got {text!r}") from None


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
    top, overrides = {"preset": "shakespeare", "mode": "train"}, {}  # --preset and --mode, the flags without a section
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(help_text())
            sys.exit(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: flags look like --section.field=value (see --help)")
        name, has_value, value = arg[2:].partition("=")
        known = name in fields or name in top
        if not known:
            close = difflib.get_close_matches(name, list(fields) + list(top), n=3)
            hint = f"; did you mean {' or '.join('--' + c for c in close)}?" if close else "; see --help"
            raise ConfigError(f"unknown flag --{name}{hint}")
        kind = fields[name][2] if name in fields else str
        if not has_value:
            next_is_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            if kind is bool and not (next_is_value and argv[i + 1].lower() in BOOL_WORDS):
                value = "true"  # a boolean flag given alone means true
            elif next_is_value:
                value, i = argv[i + 1], i + 1
            else:
                raise ConfigError(f"--{name} needs a value")
        if name in top:
            choices = PRESETS if name == "preset" else MODES
            if value not in choices:
                raise ConfigError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")
            top[name] = value
        else:
            section, f, kind = fields[name]
            overrides.setdefault(section, {})[f.name] = parse_value(name, value, kind)
        i += 1
    cfg = apply_overrides(Config(**top), PRESETS[top["preset"]])
    cfg = apply_overrides(cfg, overrides)
    if not cfg.run.name:
        cfg = apply_overrides(cfg, {"run": {"name": top["preset"]}})
    validate_model(cfg)
    return cfg


def context_parallel_checks(cfg):
    """--mesh.cp: what it needs (each a one-line error)."""
    m, cp = cfg.model, cfg.mesh.cp
    if cp == 1:
        return []
    L = m.seq_len // (2 * cp)  # tokens per chunk
    group = m.routing_group or m.seq_len
    return [(m.seq_len % (2 * cp) == 0, f"--model.seq_len ({m.seq_len}) must be divisible by 2 x --mesh.cp ({2 * cp}): "
                                        f"each cp rank holds 2 chunks of every sequence"),
            (m.seq_len % (2 * cp) or L % group == 0,
             f"--model.routing_group ({group}) must divide --model.seq_len / (2 x --mesh.cp) = {L}: a routing group must not straddle "
             f"two cp ranks' chunks; set --model.routing_group to a divisor of {L}"),
            (m.attention not in ("blockwise", "splash") or m.seq_len % (2 * cp) or L % min(m.attention_block, L) == 0,
             f"--model.attention_block ({m.attention_block}) must divide --model.seq_len / (2 x --mesh.cp) = {L} (blocks within a chunk)"),
            (m.attention != "dot_product_attention",
             f"--mesh.cp {cp} needs --model.attention matmul, blockwise or splash: {m.attention}'s causal mask assumes whole sequences "
             f"(a chunk's mask offset by its rank is not one it is made with)")]


def splash_checks(cfg):
    """--model.attention splash: the kernel's blocks and the executor (each a one-line error)."""
    m = cfg.model
    if m.attention != "splash":
        return []
    # Under cp the blocks are cut to a chunk (context_parallel_checks: they divide it), so
    # that the blocks a chunk cannot see are whole blocks, skipped.
    cp = cfg.mesh.cp
    span, name = (m.seq_len // (2 * cp), f"--model.seq_len / (2 x --mesh.cp) = {m.seq_len // (2 * cp)}") if cp > 1 else \
        (m.seq_len, f"--model.seq_len {m.seq_len}")
    block = min(m.attention_block, span)
    # (the compiler cannot partition a Pallas kernel: under auto it would run every head
    # of every row on each device; under manual each device calls it on its own share)
    return [(cfg.mesh.sharding == "manual", "--model.attention splash needs --mesh.sharding manual (the compiler does not "
                                            "partition the kernel)"),
            (block > 0 and m.seq_len % block == 0,
             f"--model.attention_block ({m.attention_block}) must divide --model.seq_len ({m.seq_len})"),
            (block % SPLASH_LANES == 0,
             f"--model.attention splash needs blocks of a multiple of {SPLASH_LANES} tokens (the kernel's lanes): "
             f"--model.attention_block {m.attention_block} at {name} gives {block}")]


def validate_model(cfg):
    """Checks that need no devices; mesh checks are in parallel/mesh.py."""
    m, t = cfg.model, cfg.train
    checks = [
        (set(m.block_pattern) <= {"D", "M"} and m.block_pattern, f"--model.block_pattern must be a string of D and M, got {m.block_pattern!r}"),
        (m.ffn_activation in ("swiglu", "gelu"), f"--model.ffn_activation must be swiglu or gelu, got {m.ffn_activation!r}"),
        (m.router_score in ("softmax", "sigmoid"), f"--model.router_score must be softmax or sigmoid, got {m.router_score!r}"),
        (m.dtype in ("float32", "bfloat16", "auto"), f"--model.dtype must be float32, bfloat16 or auto, got {m.dtype!r}"),
        (m.grad_reduce_dtype in ("float32", "bfloat16"), f"--model.grad_reduce_dtype must be float32 or bfloat16, got {m.grad_reduce_dtype!r}"),
        (m.attention in ATTENTION_KERNELS, f"--model.attention must be one of {', '.join(ATTENTION_KERNELS)}, got {m.attention!r}"),
        *splash_checks(cfg),
        (m.attention != "blockwise" or m.attention_block > 0 and m.seq_len % min(m.attention_block, m.seq_len) == 0,
         f"--model.attention_block ({m.attention_block}) must divide --model.seq_len ({m.seq_len})"),
        (cfg.export.dtype in ("float32", "bfloat16"), f"--export.dtype must be float32 or bfloat16, got {cfg.export.dtype!r}"),
        (m.remat in REMAT_POLICIES, f"--model.remat must be one of {', '.join(REMAT_POLICIES)}, got {m.remat!r}"),
        (m.rope_dim % 2 == 0, f"--model.rope_dim must be even (RoPE rotates pairs), got {m.rope_dim}"),
        (m.q_latent >= 0, f"--model.q_latent must be >= 0 (0 = full-rank queries), got {m.q_latent}"),
        (m.norm_eps > 0, f"--model.norm_eps must be > 0, got {m.norm_eps}"),
        (m.rope_scaling in ("none", "yarn"), f"--model.rope_scaling must be none or yarn, got {m.rope_scaling!r}"),
        (m.rope_scaling != "yarn" or (m.rope_factor >= 1 and m.rope_original_len >= 1),
         f"--model.rope_scaling yarn needs --model.rope_factor >= 1 (got {m.rope_factor}) and --model.rope_original_len >= 1 "
         f"(got {m.rope_original_len})"),
        (m.rope_scaling != "yarn" or 0 < m.yarn_beta_slow < m.yarn_beta_fast,
         f"--model.yarn_beta_slow ({m.yarn_beta_slow}) must be > 0 and below --model.yarn_beta_fast ({m.yarn_beta_fast})"),
        (1 <= m.top_k <= m.n_experts, f"--model.top_k ({m.top_k}) must be between 1 and --model.n_experts ({m.n_experts})"),
        (m.capacity_factor >= 0, "--model.capacity_factor must be >= 0 (0 = dropless)"),
        (m.moe_kernel in MOE_KERNELS, f"--model.moe_kernel must be one of {', '.join(MOE_KERNELS)}, got {m.moe_kernel!r}"),
        (m.moe_kernel != "gmm" or m.capacity_factor == 0, f"--model.moe_kernel gmm computes dropless experts: set "
                                                          f"--model.capacity_factor 0 (got {m.capacity_factor}) or the kernel auto"),
        (m.quant in QUANT_MODES, f"--model.quant must be one of {', '.join(QUANT_MODES)}, got {m.quant!r}"),
        (m.quant == "none" or m.moe_kernel != "gmm", f"--model.quant {m.quant} runs the dropless experts through ragged_dot: "
                                                     "set --model.moe_kernel auto or ragged_dot (gmm has no quantized kernel here)"),
        (m.router_bias_rate >= 0 and m.seq_aux_loss_weight >= 0, "--model.router_bias_rate and --model.seq_aux_loss_weight must be >= 0"),
        (m.routed_scale > 0, f"--model.routed_scale must be > 0, got {m.routed_scale}"),
        (m.first_dense >= 0, f"--model.first_dense ({m.first_dense}) must be >= 0 (dense layers before the blocks; 0 = none)"),
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
        *context_parallel_checks(cfg),
        (t.steps >= 0 and t.batch_size > 0 and t.microbatches > 0, "--train.steps must be >= 0, --train.batch_size and --train.microbatches > 0"),
        (t.batch_size % t.microbatches == 0, f"--train.batch_size ({t.batch_size}) must be divisible by --train.microbatches ({t.microbatches})"),
        ((t.objective, bool(cfg.data.conversations), bool(cfg.data.preferences)) in (("lm", 0, 0), ("sft", 1, 0), ("dpo", 0, 1)),
         "--train.objective must be lm, or sft with --data.conversations PATH|plays, or dpo with --data.preferences PATH|plays"),
        (t.optimizer in ("muon", "adamw"), f"--train.optimizer must be muon or adamw, got {t.optimizer!r}"),
        (t.qk_clip >= 0, f"--train.qk_clip must be >= 0 (a logit bound; 0 = off), got {t.qk_clip}"),
        (0 <= t.muon_momentum < 1, f"--train.muon_momentum must be in [0, 1), got {t.muon_momentum}"),
        (t.pipeline in PIPELINE_SCHEDULES, f"--train.pipeline must be one of {', '.join(PIPELINE_SCHEDULES)}, got {t.pipeline!r}"),
        (t.gather_once in GATHER_ONCE, f"--train.gather_once must be one of {', '.join(GATHER_ONCE)}, got {t.gather_once!r}"),
        (t.virtual_stages >= 1, f"--train.virtual_stages must be >= 1, got {t.virtual_stages}"),
        (t.eval_capacity_factor >= 0, "--train.eval_capacity_factor must be >= 0 (0 = dropless)"),
        (cfg.serve.slots >= 1 and cfg.serve.max_tokens >= 1 and cfg.serve.queue >= 0,
         "--serve.slots and --serve.max_tokens must be >= 1, --serve.queue >= 0"),
        (-2 <= cfg.sample.frequency_penalty <= 2 and -2 <= cfg.sample.presence_penalty <= 2,
         "--sample.frequency_penalty and --sample.presence_penalty must be in [-2, 2]"),
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


def run_dir_of(cfg):
    return os.path.join(cfg.run.out_dir, cfg.run.name)


if __name__ == "__main__":  # `python utils.py plot RUN_DIR`: runtime/plots.py draws them (run, not imported: utils imports nothing)
    runpy.run_module("runtime.plots", run_name="__main__")
