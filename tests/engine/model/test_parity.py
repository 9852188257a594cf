"""tideflow's decoder against Hugging Face transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine.offline.generate import generate
from engine.model.loader import load_model
from engine.core.sampling_params import SamplingParams
from tests.engine.model.conftest import full_forward_logits

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

FAMILIES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                       shared_expert_intermediate_size=80, norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_checkpoint(request, tmp_path_factory):
    config_cls, model_cls, extra = FAMILIES[request.param]
    torch.manual_seed(1234)
    hf = model_cls(config_cls(**COMMON, **extra)).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path, hf


@pytest.mark.parametrize("length", [1, 17, 300])
def test_logits_match_transformers_fp32(hf_checkpoint, length):
    path, hf = hf_checkpoint
    ours = load_model(path)
    ids = torch.randint(0, COMMON["vocab_size"], (length,), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        ref = hf(ids.unsqueeze(0)).logits[0].float()
    assert (full_forward_logits(ours, ids) - ref).abs().max().item() < 1e-4


def test_32_greedy_tokens_identical(hf_checkpoint):
    path, hf = hf_checkpoint
    ours = load_model(path)
    prompt = torch.randint(0, COMMON["vocab_size"], (11,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf.generate(prompt.unsqueeze(0), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    out = generate(ours, None, [prompt.tolist()], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert out.tokens == ref


def test_bf16_loads_and_tracks_fp32(hf_checkpoint):
    path, _ = hf_checkpoint
    fp32, bf16 = load_model(path), load_model(path, dtype="bfloat16")
    assert bf16.embed.weight.dtype == torch.bfloat16
    ids = torch.arange(20) % COMMON["vocab_size"]
    a, b = full_forward_logits(fp32, ids), full_forward_logits(bf16, ids)
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99
