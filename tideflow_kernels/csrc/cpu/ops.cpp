// The CPU extension: one translation unit (one compiler run) registering every op under a
// per-build namespace (TIDEFLOW_NS, set by tideflow_kernels/build.py) so several builds can coexist.
#include <torch/library.h>

#include "moe_experts.h"
#include "paged_decode_attention.h"
#include "rms_norm.h"
#include "rotary_embedding.h"
#include "thread_binding.h"
#include "topk_gating.h"

#ifndef TIDEFLOW_NS
#error "TIDEFLOW_NS must name the op namespace (-DTIDEFLOW_NS=...)"
#endif

#define TIDEFLOW_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

TIDEFLOW_LIBRARY(TIDEFLOW_NS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &tideflow::rms_norm);
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        &tideflow::fused_add_rms_norm);
  m.def("rotary_embedding(Tensor q, Tensor k, Tensor positions, Tensor cos_sin) -> (Tensor, Tensor)",
        &tideflow::rotary_embedding);
  m.def("topk_gating(Tensor logits, int k, bool renormalize) -> (Tensor, Tensor)",
        &tideflow::topk_gating);
  m.def("moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, bool tiled) -> Tensor",
        &tideflow::moe_experts);
  m.def("moe_tiles_fit(int hidden, int inter, bool bf16) -> bool", &tideflow::moe_tiles_fit);
  m.def("bind_threads(int[] cpus) -> int[]", &tideflow::bind_threads);
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor",
        &tideflow::paged_decode_attention);
}
