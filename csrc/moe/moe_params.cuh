// What the mixture-of-experts kernels share: the params structs and the tile layout of the routed pairs.
//
// A pair is one (token, chosen expert): pair p = token * top_k + j is the token's j-th expert. The
// align kernel sorts the pairs by expert into slots, each expert's run of slots padded with -1 to a
// multiple of the tile rows of the expert kernels that follow (kMoeGemvRows for the decode GEMV,
// MoeGemmTraits::kBlockM for the tensor-core grouped GEMM), so that every tile of `tile_rows` slots
// belongs to one expert. Buffers are sized for the worst case (moe_max_tiles on the host), and the
// number of tiles in use lives on the device: nothing about the routing reaches the host, so a decode
// step captures in a CUDA graph.
#pragma once

#include "common.cuh"

namespace voltllm {

// Most experts the align kernel counts in shared memory, and the top-k kernel holds in registers.
constexpr int kMoeMaxExperts = 512;
constexpr int kMoeMaxTopK = 32;  // one lane of the top-k warp keeps each choice

struct MoeTopkParams {
  float* topk_weights;   // [tokens, top_k]: softmax probability of each chosen expert (renormalised)
  int* topk_ids;         // [tokens, top_k]: the chosen experts, by falling probability
  const void* logits;    // [tokens, num_experts], rows logits_stride apart
  long long logits_stride;
  int num_tokens;
  int num_experts;       // 1..kMoeMaxExperts
  int top_k;             // 1..min(num_experts, kMoeMaxTopK)
  int renormalize;       // divide the chosen probabilities by their sum
};

struct MoeAlignParams {
  const int* topk_ids;   // [pairs]: expert of each pair, in 0..num_experts-1
  int* sorted_pair_ids;  // [max_tiles * tile_rows]: pair of each slot, -1 for padding (the slots of
                         // tiles past *num_tiles are left as they were)
  int* tile_experts;     // [max_tiles]: expert of each tile in use
  int* num_tiles;        // [1]: tiles in use
  int num_pairs;
  int num_experts;       // 1..kMoeMaxExperts
  int tile_rows;         // slots per tile
};

// One expert stage over the sorted slots, gated (the gate/up projection with SwiGLU) or not (down).
struct MoeExpertParams {
  void* out;                   // gated: act [max_slots, n] of T, row = slot (rows of padding slots undefined);
                               // down: y [pairs, n] fp32, row = pair, times the pair's routing weight
  const void* a;               // gated: x [tokens, k], the row of pair p is token p / top_k;
                               // down: act [max_slots, k], row = slot. Rows a_stride apart.
  const void* weight;          // [num_experts, gated ? 2n : n, k], contiguous (gated: gate rows, then up rows)
  const int* sorted_pair_ids;  // [max_slots]
  const int* tile_experts;     // [max_tiles]
  const int* num_tiles;        // [1]
  const float* topk_weights;   // [pairs] (down only)
  long long a_stride;
  int top_k;
  int n;  // output features (gated: of the activation)
  int k;  // input features, a multiple of 8
};

// One expert stage pair by pair (pair_gemv.cuh: the decode path of a token or two, no tiles).
struct MoePairParams {
  void* out;                  // gated: act [pairs, n] of T, contiguous; down: out [tokens, n] of T, rows
                              // out_stride apart (the top-k sum of the token's pairs)
  const void* a;              // gated: x [tokens, k], the row of pair p is token p / top_k; down: act
                              // [pairs, k]. Rows a_stride apart.
  const void* weight;         // [num_experts, gated ? 2n : n, k], contiguous (gated: gate rows, then up rows)
  const int* topk_ids;        // [pairs]: the expert of each pair
  const float* topk_weights;  // [pairs] (down only)
  long long a_stride;
  long long out_stride;       // down only
  int top_k;
  int n;  // output features (gated: of the activation)
  int k;  // input features, a multiple of 8
};

struct MoeCombineParams {
  void* out;       // [tokens, n] of T, rows out_stride apart
  const float* y;  // [tokens * top_k, n]: each pair's weighted expert output
  long long out_stride;
  int num_tokens;
  int top_k;
  int n;  // a multiple of 4
};

}  // namespace voltllm
