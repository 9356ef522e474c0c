// Decode attention over the paged KV cache, read in place (no gather into a contiguous copy).
//
// One query token per sequence; its keys and values live in the blocks its block table names. Each
// (sequence, KV head) pair is one task: its G query heads (G = heads / KV heads) walk the sequence's blocks
// once, with an online softmax in fp32 (as SDPA's flash kernel computes), so K and V are read exactly once.
// The gather + SDPA path it replaces copies every sequence's whole KV into a new tensor in every layer of
// every step: on a CPU that copy costs as much as the attention itself (llm_engine/paged_attention.py).
// The lightest headers that serve, and the op registered with torch's dispatcher rather than built as a pybind11
// module: with <torch/extension.h> (all of ATen, pybind11, Python) the build took 21 s on a 2-core Intel, now 6.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace {

// Element loads as fp32. bf16 is the top half of an fp32: a shift the compiler vectorizes (the c10 conversion
// operator does not vectorize).
inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

constexpr int kMaxBlockSize = 256;
constexpr int kMaxGroups = 16;

template <typename scalar_t, int kHeadDim>
void decode_task(const scalar_t* query,            // [G, D] of this sequence and KV head
                 const scalar_t* key_base, const scalar_t* value_base,  // this layer's block 0, this KV head
                 int64_t block_stride, int64_t token_stride,            // elements between blocks / tokens
                 const int64_t* table, int64_t context_len, int64_t block_size, int64_t num_groups,
                 float scale, scalar_t* out) {                          // [G, D]
  constexpr int D = kHeadDim;
  alignas(64) float q[kMaxGroups][D];
  alignas(64) float acc[kMaxGroups][D];
  float running_max[kMaxGroups], running_sum[kMaxGroups];
  for (int64_t g = 0; g < num_groups; ++g) {
    for (int d = 0; d < D; ++d) {
      q[g][d] = to_float(query[g * D + d]) * scale;
      acc[g][d] = 0.0f;
    }
    // The lowest finite value, not -inf: exp(lowest - max) is 0 without an inf - inf = NaN on the first block.
    running_max[g] = std::numeric_limits<float>::lowest();
    running_sum[g] = 0.0f;
  }
  alignas(64) float row[D];
  alignas(64) float scores[kMaxGroups][kMaxBlockSize];
  for (int64_t start = 0; start < context_len; start += block_size) {
    const int64_t block = table[start / block_size];
    const int64_t num_tokens = std::min(block_size, context_len - start);
    const scalar_t* keys = key_base + block * block_stride;
    const scalar_t* values = value_base + block * block_stride;
    // Scores: each key row is converted once and dotted with every query head of the group.
    for (int64_t t = 0; t < num_tokens; ++t) {
      const scalar_t* k = keys + t * token_stride;
#pragma omp simd
      for (int d = 0; d < D; ++d) row[d] = to_float(k[d]);
      for (int64_t g = 0; g < num_groups; ++g) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += q[g][d] * row[d];
        scores[g][t] = dot;
      }
    }
    // Online softmax: rescale what was accumulated under the old maximum.
    for (int64_t g = 0; g < num_groups; ++g) {
      float block_max = running_max[g];
      for (int64_t t = 0; t < num_tokens; ++t) block_max = std::max(block_max, scores[g][t]);
      float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
      for (int64_t t = 0; t < num_tokens; ++t) {
        scores[g][t] = std::exp(scores[g][t] - block_max);
        block_sum += scores[g][t];
      }
      const float correction = std::exp(running_max[g] - block_max);
      running_sum[g] = running_sum[g] * correction + block_sum;
      running_max[g] = block_max;
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[g][d] *= correction;
    }
    // Values: each row converted once, added to every query head's accumulator with its weight.
    for (int64_t t = 0; t < num_tokens; ++t) {
      const scalar_t* v = values + t * token_stride;
#pragma omp simd
      for (int d = 0; d < D; ++d) row[d] = to_float(v[d]);
      for (int64_t g = 0; g < num_groups; ++g) {
        const float p = scores[g][t];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[g][d] += p * row[d];
      }
    }
  }
  for (int64_t g = 0; g < num_groups; ++g) {
    const float inv = 1.0f / running_sum[g];
    for (int d = 0; d < D; ++d) out[g * D + d] = static_cast<scalar_t>(acc[g][d] * inv);
  }
}

template <typename scalar_t, int kHeadDim>
void run(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t num_groups = num_heads / num_kv_heads;
  const int64_t block_stride = key_cache.stride(0), token_stride = key_cache.stride(1);
  const int64_t head_stride = key_cache.stride(2), table_stride = block_tables.stride(0);
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k = key_cache.data_ptr<scalar_t>();
  const scalar_t* v = value_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t offset = (seq * num_heads + kv_head * num_groups) * kHeadDim;
      decode_task<scalar_t, kHeadDim>(q + offset, k + kv_head * head_stride, v + kv_head * head_stride,
                                      block_stride, token_stride, tables + seq * table_stride, lens[seq],
                                      block_size, num_groups, static_cast<float>(scale), o + offset);
    }
  });
}

template <int kHeadDim>
void dispatch_dtype(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                    at::Tensor& out) {
  switch (query.scalar_type()) {
    case at::kFloat: run<float, kHeadDim>(query, key_cache, value_cache, block_tables, context_lens, scale, out); break;
    case at::kBFloat16:
      run<at::BFloat16, kHeadDim>(query, key_cache, value_cache, block_tables, context_lens, scale, out);
      break;
    case at::kHalf: run<at::Half, kHeadDim>(query, key_cache, value_cache, block_tables, context_lens, scale, out); break;
    default: TORCH_CHECK(false, "paged decode attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

// query: [B, H, D] contiguous; key_cache, value_cache: one layer's [num_blocks, block_size, KVH, D] (strided
// views into the whole cache are fine: the last dim must be contiguous); block_tables: [B, max_blocks] int64;
// context_lens: [B] int64 (keys each sequence attends to, its new token included). Returns [B, H, D].
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                                     const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [B, H, D]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.stride(3) == 1 && value_cache.strides() == key_cache.strides(),
              "key/value caches must be [num_blocks, block_size, KVH, D] with a contiguous last dim");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type(), "cache and query dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and context lengths must be int64");
  TORCH_CHECK(block_tables.stride(1) == 1 && context_lens.is_contiguous(), "tables rows must be contiguous");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(1) / key_cache.size(2) <= kMaxGroups && key_cache.size(1) <= kMaxBlockSize,
              "at most ", kMaxGroups, " query heads per KV head and ", kMaxBlockSize, " tokens per block");
  auto out = at::empty_like(query);
  switch (query.size(2)) {
    case 64: dispatch_dtype<64>(query, key_cache, value_cache, block_tables, context_lens, scale, out); break;
    case 128: dispatch_dtype<128>(query, key_cache, value_cache, block_tables, context_lens, scale, out); break;
    case 32: dispatch_dtype<32>(query, key_cache, value_cache, block_tables, context_lens, scale, out); break;
    case 96: dispatch_dtype<96>(query, key_cache, value_cache, block_tables, context_lens, scale, out); break;
    case 256: dispatch_dtype<256>(query, key_cache, value_cache, block_tables, context_lens, scale, out); break;
    default: TORCH_CHECK(false, "paged decode attention: head_dim ", query.size(2), " not built");
  }
  return out;
}

// torch.ops.pdserve_native.paged_decode_attention (llm_engine/native_kernels.py loads the library).
TORCH_LIBRARY(pdserve_native, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
}
