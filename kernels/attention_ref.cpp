#include <cmath>
#include <vector>

#include "kernels/attention.cuh"
#include "kernels/bf16_host.hpp"

namespace duet::kernels {

namespace {

// out (head_dim bf16) = softmax(q . K[0..len)^T * scale) V, in double.
void attend(const uint16_t* q, uint16_t* out, const kv_pool_view& kv, uint32_t layer,
            uint32_t kv_head, const int32_t* table, int len, float scale) {
  const uint32_t d = kv.head_dim;
  std::vector<double> score(static_cast<std::size_t>(std::max(len, 0)));
  double mx = -INFINITY;
  auto row = [&](uint32_t sel, int key) {
    const uint32_t block = static_cast<uint32_t>(table[key / static_cast<int>(kv.block_tokens)]);
    return kv.pool + static_cast<uint64_t>(block) * kv.block_elems +
           kv.offset(layer, sel, kv_head, static_cast<uint32_t>(key) % kv.block_tokens);
  };
  for (int j = 0; j < len; ++j) {
    const uint16_t* k = row(0, j);
    double s = 0;
    for (uint32_t i = 0; i < d; ++i)
      s += static_cast<double>(bf16_to_f32(q[i])) * bf16_to_f32(k[i]);
    score[j] = s * scale;
    mx = std::max(mx, score[j]);
  }
  double sum = 0;
  for (int j = 0; j < len; ++j) sum += (score[j] = std::exp(score[j] - mx));
  std::vector<double> acc(d, 0.0);
  for (int j = 0; j < len; ++j) {
    const uint16_t* v = row(1, j);
    for (uint32_t i = 0; i < d; ++i) acc[i] += score[j] * bf16_to_f32(v[i]);
  }
  for (uint32_t i = 0; i < d; ++i)
    out[i] = f32_to_bf16(len > 0 ? static_cast<float>(acc[i] / sum) : 0.0f);
}

}  // namespace

void prefill_attention_reference(const prefill_attention_params& p) {
  const uint32_t group = p.heads / p.kv_heads, d = p.kv.head_dim;
  for (uint32_t s = 0; s < p.seqs; ++s) {
    for (int r = p.seq_rows[s]; r < p.seq_rows[s + 1]; ++r) {
      const int pos = p.seq_start[s] + (r - p.seq_rows[s]);
      for (uint32_t h = 0; h < p.heads; ++h) {
        attend(p.q + static_cast<uint64_t>(r) * p.q_stride + h * d,
               p.out + static_cast<uint64_t>(r) * p.out_stride + h * d, p.kv, p.layer, h / group,
               p.block_table + p.seq_table[s], pos + 1, p.scale);
      }
    }
  }
}

void decode_attention_reference(const decode_attention_params& p) {
  const uint32_t group = p.heads / p.kv_heads, d = p.kv.head_dim;
  for (uint32_t b = 0; b < p.batch; ++b) {
    for (uint32_t h = 0; h < p.heads; ++h) {
      attend(p.q + static_cast<uint64_t>(b) * p.q_stride + h * d,
             p.out + static_cast<uint64_t>(b) * p.out_stride + h * d, p.kv, p.layer, h / group,
             p.block_table + p.seq_table[b], p.seq_lens[b], p.scale);
    }
  }
}

}  // namespace duet::kernels
