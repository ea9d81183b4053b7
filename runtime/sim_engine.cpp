#include "runtime/sim_engine.hpp"

#include <stdexcept>

#include "runtime/decode_buckets.hpp"

namespace duet {

uint64_t layout_hash(std::string_view model, std::string_view dtype, uint32_t layers,
                     uint32_t kv_heads, uint32_t head_dim, uint32_t block_tokens) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](std::string_view bytes) {
    for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
  };
  mix(model);
  mix(dtype);
  for (uint32_t v : {layers, kv_heads, head_dim, block_tokens}) mix(std::to_string(v));
  return h;
}

sim_engine::sim_engine(const model_shape& shape, const gpu_spec& gpu, std::string served_name,
                       uint32_t max_context, uint32_t block_tokens, double sm_share, double time_scale)
    : costs_(shape, gpu, sm_share), time_scale_(time_scale) {
  info_.engine = "sim";
  info_.model = std::move(served_name);
  info_.vocab_size = shape.vocab;
  info_.max_context = max_context;
  info_.block_tokens = block_tokens;
  info_.block_bytes = shape.kv_bytes_per_token() * block_tokens;
  info_.layout_hash = layout_hash(shape.name, "bf16", shape.layers, shape.kv_heads, shape.head_dim, block_tokens);
  // No eos: sim sequences always run to max_new_tokens, which is what load tests want.
}

int32_t sim_engine::next_token(int32_t previous, uint32_t position, uint32_t vocab) {
  uint64_t x = (uint64_t(uint32_t(previous)) << 32) ^ position;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<int32_t>(x % vocab);
}

std::chrono::nanoseconds sim_engine::scaled(double seconds) const {
  return std::chrono::nanoseconds(static_cast<int64_t>(seconds * time_scale_ * 1e9));
}

step_output sim_engine::prefill(std::span<const prefill_chunk> chunks) {
  step_output out;
  uint64_t tokens = 0;
  double attention = 0;
  for (const auto& c : chunks) {
    if (c.tokens.empty()) throw std::invalid_argument("sim_engine: empty prefill chunk");
    tokens += c.tokens.size();
    attention += costs_.chunk_attention_flops(static_cast<uint32_t>(c.tokens.size()), c.start);
    if (c.last) {
      const uint32_t position = c.start + static_cast<uint32_t>(c.tokens.size());
      out.tokens.push_back(next_token(c.tokens.back(), position, info_.vocab_size));
    }
  }
  out.modeled = scaled(costs_.prefill_seconds(tokens, attention));
  return out;
}

step_output sim_engine::decode(std::span<const decode_slot> slots) {
  return decode_in_graph(slots, graph_rows(static_cast<uint32_t>(slots.size())));
}

uint32_t sim_engine::graph_rows(uint32_t batch) const { return decode_graph_rows(buckets_, batch); }

step_output sim_engine::decode_in_graph(std::span<const decode_slot> slots, uint32_t graph_rows) {
  step_output out;
  uint64_t context = 0;
  for (const auto& s : slots) {
    if (s.history.empty()) throw std::invalid_argument("sim_engine: decode slot without history");
    context += s.history.size();
    out.tokens.push_back(next_token(s.history.back(), static_cast<uint32_t>(s.history.size()), info_.vocab_size));
  }
  out.modeled = scaled(costs_.decode_seconds(static_cast<uint32_t>(slots.size()), context, graph_rows));
  return out;
}

}  // namespace duet
