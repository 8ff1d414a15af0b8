"""Hugging Face remote code for the meshformer exports that no built-in transformers class computes.

This file is not imported by the repo: `python main.py --mode export_hf` copies it beside the
weights when transformers' own classes cannot compute the model (hf_config.architecture_of),
and config.json's `auto_map` points AutoConfig and AutoModelForCausalLM at it, so that

    AutoModelForCausalLM.from_pretrained("runs/NAME/hf", trust_remote_code=True)
    lm_eval --model hf --model_args pretrained=runs/NAME/hf,trust_remote_code=True ...

load it (nothing is downloaded: the code is in the directory). Why it exists: the default run
(`python main.py`) alternates dense and MoE layers (blocks "DM" x 2) and scores experts with a
softmax whose top-k scores are renormalised to sum to 1. In transformers 5.24, DeepseekV3 puts
dense layers only first (first_k_dense_replace) and always scores with a sigmoid; DeepseekV2
never renormalises the top k; Mistral4 renormalises but is dense-first too and is not in
AutoModelForCausalLM's table. None reads a per-layer dense/MoE list.

So this is transformers' DeepseekV3 with two changes, everything else its own code (MLA
attention, RMSNorm, interleaved RoPE, experts, KV cache, generate):
- `mlp_layer_types`: "dense" or "sparse" (MoE) for each layer, in any order;
- the router scores with `scoring_func` ("softmax" or "sigmoid"), picks the top k of the score
  (+ e_score_correction_bias, which only selects; within the topk_group best of n_group expert
  groups, as DeepseekV3), and with `norm_topk_prob` divides the chosen scores by their sum
  (meshformer's model.top_k_routing; with one expert per token the gate is the raw score and
  norm_topk_prob is false), times routed_scaling_factor.
The model_type is "meshformer", not "deepseek_v3": without trust_remote_code transformers
refuses the directory instead of computing another model from the same weights.
"""

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3ForCausalLM,
    DeepseekV3MLP,
    DeepseekV3Model,
    DeepseekV3MoE,
    DeepseekV3TopkRouter,
)


@strict
class MeshformerConfig(DeepseekV3Config):
    r"""DeepseekV3Config plus:
    mlp_layer_types (`list[str]`, *optional*): "dense" or "sparse" per layer; by default
        DeepseekV3's layout (first_k_dense_replace dense layers, then MoE).
    scoring_func (`str`, defaults to "softmax"): the router's score, "softmax" or "sigmoid".
    """

    model_type = "meshformer"
    mlp_layer_types: list[str] | None = None
    scoring_func: str = "softmax"

    def __post_init__(self, **kwargs):
        if self.mlp_layer_types is None:
            k = self.first_k_dense_replace or 0
            self.mlp_layer_types = ["dense"] * k + ["sparse"] * (self.num_hidden_layers - k)
        super().__post_init__(**kwargs)

    def validate_scoring_func(self):
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {self.scoring_func!r}")


class MeshformerRouter(DeepseekV3TopkRouter):
    """Top-k routing as meshformer's model.top_k_routing: DeepseekV3's (selection bias,
    expert groups ranked by their two best biased scores, norm_topk_prob,
    routed_scaling_factor) with a softmax or a sigmoid score."""

    def __init__(self, config):
        super().__init__(config)
        self.scoring_func = config.scoring_func

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        scores = router_logits.softmax(dim=-1) if self.scoring_func == "softmax" else router_logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.num_group > 1:  # keep the experts of each token's topk_group best groups (as DeepseekV3TopkRouter)
            by_group = choice.view(-1, self.num_group, self.num_experts // self.num_group)
            best_groups = torch.topk(by_group.topk(2, dim=-1)[0].sum(dim=-1), k=self.topk_group, dim=-1, sorted=False)[1]
            kept = torch.zeros(by_group.shape[:2], dtype=torch.bool, device=choice.device).scatter_(1, best_groups, True)
            choice = choice.masked_fill(~kept.repeat_interleave(self.num_experts // self.num_group, dim=1), float("-inf"))
        topk_indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_indices)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


class MeshformerMoE(DeepseekV3MoE):
    def __init__(self, config):
        super().__init__(config)
        self.gate = MeshformerRouter(config)


class MeshformerModel(DeepseekV3Model):
    config_class = MeshformerConfig

    def __init__(self, config):
        super().__init__(config)
        # DeepseekV3's layers, each given the MLP that mlp_layer_types names
        for layer, kind in zip(self.layers, config.mlp_layer_types, strict=True):
            layer.mlp = MeshformerMoE(config) if kind == "sparse" else DeepseekV3MLP(config)
        self.post_init()


class MeshformerForCausalLM(DeepseekV3ForCausalLM):
    config_class = MeshformerConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = MeshformerModel(config)
        self.post_init()


__all__ = ["MeshformerConfig", "MeshformerModel", "MeshformerForCausalLM"]
