"""The MoE decoder (plain PyTorch) and its checkpoint loader."""

from engine.model.decoder import MoEForCausalLM
from engine.model.loader import load_model
from engine.model.paged import AttentionMetadata, allocate_kv_cache

__all__ = ["MoEForCausalLM", "load_model", "AttentionMetadata", "allocate_kv_cache"]
