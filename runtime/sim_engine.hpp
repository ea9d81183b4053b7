#pragma once
#include <vector>

#include "runtime/engine.hpp"
#include "runtime/model_shape.hpp"

namespace duet {

/// No compute: deterministic pseudo-tokens, and step times from a roofline cost model of a
/// GPU, so a whole deployment can be rehearsed on a laptop with realistic latencies.
/// The next token depends only on the previous token and its position, so splitting a
/// sequence across prefill and decode never changes the output.
class sim_engine final : public engine {
 public:
  sim_engine(const model_shape& shape, const gpu_spec& gpu, std::string served_name,
             uint32_t max_context, uint32_t block_tokens, double sm_share, double time_scale);

  [[nodiscard]] const engine_info& info() const override { return info_; }
  [[nodiscard]] step_output prefill(std::span<const prefill_chunk> chunks) override;
  [[nodiscard]] step_output decode(std::span<const decode_slot> slots) override;
  /// A decode step priced as a CUDA graph of `graph_rows` rows runs it (decode_seconds).
  [[nodiscard]] step_output decode_in_graph(std::span<const decode_slot> slots, uint32_t graph_rows);
  /// The batch sizes the modelled engine captures decode graphs for (decode_graph_buckets):
  /// a step then costs as its bucket's rows. Empty (the default): as its own batch.
  void set_decode_graph_buckets(std::vector<uint32_t> buckets) { buckets_ = std::move(buckets); }
  /// The rows of the graph a step of `batch` sequences replays.
  [[nodiscard]] uint32_t graph_rows(uint32_t batch) const;
  [[nodiscard]] const cost_model& costs() const { return costs_; }

  /// The token the sim engine emits after `previous` at `position` (exposed for tests).
  [[nodiscard]] static int32_t next_token(int32_t previous, uint32_t position, uint32_t vocab);

 private:
  [[nodiscard]] std::chrono::nanoseconds scaled(double seconds) const;
  engine_info info_;
  cost_model costs_;
  double time_scale_;
  std::vector<uint32_t> buckets_;
};

}  // namespace duet
