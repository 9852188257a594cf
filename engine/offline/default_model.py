"""The default model: a seeded random small MoE in Hugging Face format, with a real BPE tokenizer.

Its weights are random, so its text is gibberish; it exists so every pipeline runs end to end on
a laptop. Any Mixtral / Qwen-MoE checkpoint directory can be used instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.model.config import ModelConfig
from engine.encoder.vision import write_vision_encoder

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

DEFAULT_CONFIG = ModelConfig(
    architecture="MixtralForCausalLM",
    vocab_size=8192,
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    num_experts=8,
    experts_per_token=2,
    intermediate_size=1024,
    moe_intermediate_size=1024,
    rope_theta=1e6,
    rms_eps=1e-5,
    max_position_embeddings=4096,
    eos_token_id=[0, 2],
)


def training_text() -> list[str]:
    """English prose that ships with every CPython: the pydoc topic help texts."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    return tok


def random_hf_state(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """HF Mixtral tensor names with seeded N(0, 0.02) weights and unit norms."""
    gen = torch.Generator().manual_seed(seed)
    h, kvd, inter = config.hidden_size, config.num_kv_heads * config.head_dim, config.moe_intermediate_size

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(config.torch_dtype)

    ones = lambda n: torch.ones(n, dtype=config.torch_dtype)  # noqa: E731
    state = {"model.embed_tokens.weight": w(config.vocab_size, h), "model.norm.weight": ones(h),
             "lm_head.weight": w(config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": w(config.num_heads * config.head_dim, h),
            p + "self_attn.k_proj.weight": w(kvd, h), p + "self_attn.v_proj.weight": w(kvd, h),
            p + "self_attn.o_proj.weight": w(h, config.num_heads * config.head_dim),
            p + "block_sparse_moe.gate.weight": w(config.num_experts, h),
        }
        for e in range(config.num_experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            state |= {q + "w1.weight": w(inter, h), q + "w3.weight": w(inter, h), q + "w2.weight": w(h, inter)}
    return state


TINY_CONFIG = DEFAULT_CONFIG.model_copy(update=dict(
    vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
    intermediate_size=128, moe_intermediate_size=128,
))
"""A model small enough for unit tests and fast pipeline runs."""


def write_default_model(out_dir: str | Path, config: ModelConfig = DEFAULT_CONFIG, seed: int = 0) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json and the vision encoder."""
    if config.architecture != "MixtralForCausalLM":
        raise ValueError("the default model is written in the Mixtral layout")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(config.vocab_size)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}, indent=2))
    (out / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
    save_file(random_hf_state(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_vision_encoder(out, config.hidden_size, seed)  # for the encoder role (vision_encoder/)
    return out
