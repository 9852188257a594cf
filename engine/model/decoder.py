"""The decoder stack: embeddings, [attention + MoE] x layers, final norm, LM head."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.config import ModelConfig
from engine.model.attention import Attention
from engine.model.moe import DenseMLP, SparseMoE
from engine.model.norm import RMSNorm
from engine.model.paged import AttentionMetadata, KVCache
from engine.model.rotary import cos_sin_table


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        dt = config.torch_dtype
        self.input_norm = RMSNorm(config.hidden_size, config.rms_eps, dt)
        self.attn = Attention(config)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_eps, dt)
        self.mlp: nn.Module = (
            SparseMoE(config) if config.is_moe_layer(index) else DenseMLP(config.hidden_size, config.intermediate_size, dt)
        )

    def forward(self, x, residual, positions, cos_sin, kv, meta):
        h, residual = self.input_norm(x, residual)
        h = self.attn(h, positions, cos_sin, kv, meta)
        h, residual = self.post_attn_norm(h, residual)
        return self.mlp(h), residual


class MoEForCausalLM(nn.Module):
    """Forward over a step's flattened tokens; K/V live in the caller's paged cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        dt = config.torch_dtype
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dt)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps, dt)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dt)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        table = cos_sin_table(config.head_dim, config.context_length, config.rope_theta)
        self.register_buffer("cos_sin", table, persistent=False)
        self.requires_grad_(False)

    def moe_layers(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm. `input_embeds` overrides token embeddings
        (multimodal prompts splice encoder outputs in)."""
        x = self.embed(input_ids) if input_embeds is None else input_embeds
        residual = None
        for layer, kv in zip(self.layers, kv_cache):
            x, residual = layer(x, residual, positions, self.cos_sin, kv, meta)
        return self.norm(x, residual)[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
