#include "runtime/model_shape.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <stdexcept>

#include "runtime/gpu_catalog.hpp"

namespace duet {

uint64_t model_shape::linear_params() const {
  const uint64_t h = hidden, kv = uint64_t{kv_heads} * head_dim, q = uint64_t{heads} * head_dim;
  const uint64_t per_layer = h * q + 2 * h * kv + q * h + 3 * h * ffn;
  return per_layer * layers + uint64_t{vocab} * h;  // + LM head
}

uint64_t model_shape::weight_bytes() const {
  const uint64_t embedding = tied_embeddings ? 0 : uint64_t{vocab} * hidden;
  return (linear_params() + embedding) * dtype_bytes;
}

std::optional<model_shape> find_model_shape(std::string_view preset) {
  // Shapes from each model's published config.json.
  static const std::array shapes = {
      model_shape{"r1-distill-llama-8b", "llama", 32, 4096, 32, 8, 128, 14336, 128256, false, 2},
      model_shape{"r1-distill-qwen-1.5b", "qwen2", 28, 1536, 12, 2, 128, 8960, 151936, false, 2},
      model_shape{"r1-distill-qwen-7b", "qwen2", 28, 3584, 28, 4, 128, 18944, 152064, false, 2},
      model_shape{"smollm2-135m", "llama", 30, 576, 9, 3, 64, 1536, 49152, true, 2},
      model_shape{"tiny", "llama", 2, 64, 4, 2, 16, 128, 512, false, 2},
  };
  for (const auto& s : shapes) {
    if (s.name == preset) return s;
  }
  return std::nullopt;
}

double efficiency_curve::at(double shape, double fallback) const {
  if (points.empty()) return fallback;
  if (shape <= points.front().first) return points.front().second;
  if (shape >= points.back().first) return points.back().second;
  auto hi = std::lower_bound(points.begin(), points.end(), shape,
                             [](const std::pair<double, double>& p, double x) { return p.first < x; });
  auto lo = hi - 1;
  const double f = (std::log(shape) - std::log(lo->first)) / (std::log(hi->first) - std::log(lo->first));
  return lo->second + f * (hi->second - lo->second);
}

std::optional<gpu_spec> find_gpu_spec(std::string_view name) {
  if (auto from_file = find_gpu_spec_in_file(name)) return from_file;
  // Dense bf16 peaks and HBM bandwidth from NVIDIA's data sheets; efficiencies for Hopper
  // from the H200 measurements in BASELINES.md (GEMM ~700 of 989 TFLOP/s, copy 4.28 of 4.8 TB/s).
  // Links one way (half the data sheets' bidirectional NVLink and PCIe figures); NIC: one
  // 400 Gb/s (Hopper) or 200 Gb/s (A100, L40S) port per GPU. config/gpus.toml cites each.
  static const std::array specs = {
      gpu_spec{"h20", 148e12, 4.0e12, 96e9, 78, 0.85, 0.88, 30e-6, 450e9, 64e9, 50e9, 0.88, {}, 8, 8},
      gpu_spec{"h100", 989e12, 3.35e12, 80e9, 132, 0.70, 0.88, 30e-6, 450e9, 64e9, 50e9, 0.88, {}, 8, 8},
      gpu_spec{"h200", 989e12, 4.8e12, 141e9, 132, 0.70, 0.89, 30e-6, 450e9, 64e9, 50e9, 0.88, {}, 8, 8},
      gpu_spec{"a100", 312e12, 2.039e12, 80e9, 108, 0.75, 0.85, 30e-6, 300e9, 32e9, 25e9, 0.88, {}, 4, 2},
      gpu_spec{"l40s", 362e12, 0.864e12, 48e9, 142, 0.70, 0.85, 30e-6, 0, 32e9, 25e9, 0.88, {}, 4, 2},
  };
  for (const auto& s : specs) {
    if (s.name == name) return s;
  }
  return std::nullopt;
}

double partition_request(double share, double total, double step, double least) {
  return std::max(std::round(share * total / step) * step, least);
}

double partition_sms(const gpu_spec& spec, double share, double available) {
  const double total = spec.sms;
  if (spec.sm_partition_step == 0 || spec.calibration.nominal_sm_shares)
    return std::min(share * total, available);
  const double step = spec.sm_partition_step;
  const double least = std::max<double>(step, spec.sm_partition_min);
  if (available < least) {
    throw std::invalid_argument("sm_share " + std::to_string(share) + " on a " + spec.name +
                                ": only " + std::to_string(static_cast<int>(available)) +
                                " SMs are left by the other partitions (at least " +
                                std::to_string(static_cast<int>(least)) + ")");
  }
  return std::min(partition_request(share, total, step, least), available);
}

double partition_share(const gpu_spec& spec, double share) {
  if (share >= 1 || spec.sms == 0) return share;
  return partition_sms(spec, share, spec.sms) / spec.sms;
}

gpu_calibration with_engine_speed(gpu_calibration cal, const gpu_spec& spec, double factor) {
  auto scale = [factor](efficiency_curve& curve, double fallback) {
    if (curve.empty()) curve.points = {{1.0, fallback}};
    for (auto& [shape, fraction] : curve.points) fraction = std::min(1.0, fraction * factor);
  };
  scale(cal.gemm, spec.gemm_efficiency);
  scale(cal.attention, spec.gemm_efficiency);
  scale(cal.memory, spec.bandwidth_efficiency);
  if (cal.prefill_memory) cal.prefill_memory = std::min(1.0, *cal.prefill_memory * factor);
  return cal;
}

cost_model::cost_model(model_shape shape, gpu_spec gpu, double sm_share)
    : shape_(std::move(shape)), gpu_(std::move(gpu)), sm_share_(std::clamp(sm_share, 0.01, 1.0)) {}

double cost_model::chunk_attention_flops(uint32_t tokens, uint32_t prior) const {
  // QK^T and PV: 4 * head_dim FLOPs per (query, key) pair per head; causal half inside the chunk.
  const double pairs = double(tokens) * prior + double(tokens) * (tokens + 1) / 2.0;
  return 4.0 * shape_.layers * shape_.heads * shape_.head_dim * pairs;
}

// GEMM and attention FLOPs each run at their own fraction of peak (one fraction each without
// a calibration file, so the sum equals FLOPs / (peak * gemm_efficiency) as before); attention
// efficiency is looked up at the mean number of keys per query of the step.
cost_model::prefill_compute cost_model::prefill_compute_parts(uint64_t chunk_tokens_total,
                                                             double attention_flops) const {
  const auto& cal = gpu_.calibration;
  const double tokens = double(chunk_tokens_total);
  // The GEMMs run whole row tiles: the rows past the last token are computed all the same.
  const uint64_t tile = cal.prefill_gemm_row_tile.value_or(1);
  const double gemm_rows = double((chunk_tokens_total + tile - 1) / tile * tile);
  const double linear = 2.0 * double(shape_.linear_params()) * gemm_rows;
  const double per_pair = 4.0 * shape_.layers * shape_.heads * shape_.head_dim;
  const double keys_per_query = tokens > 0 ? attention_flops / (per_pair * tokens) : 0.0;
  // On a green context a prefill step reaches less than its share of the GPU's peak: the SM
  // count is rounded to the partition's steps, and the other side's bandwidth is taken from it.
  const double split = sm_share_ < 1.0 ? cal.split_compute.at(sm_share_, 1.0) : 1.0;
  const double peak = gpu_.bf16_flops * sm_share_ * split;
  prefill_compute out;
  out.gemm_efficiency = cal.gemm.at(gemm_rows, gpu_.gemm_efficiency);
  out.attention_efficiency = cal.attention.at(keys_per_query, gpu_.gemm_efficiency);
  out.gemm_s = linear / (peak * out.gemm_efficiency);
  out.attention_s = attention_flops / (peak * out.attention_efficiency);
  return out;
}

double cost_model::prefill_seconds(uint64_t chunk_tokens_total, double attention_flops) const {
  const auto& cal = gpu_.calibration;
  const auto parts = prefill_compute_parts(chunk_tokens_total, attention_flops);
  const double compute = parts.gemm_s + parts.attention_s;
  const double bytes = double(shape_.weight_bytes());
  const double memory = bytes / prefill_weight_rate(bytes);
  const double overhead = cal.step_overhead_s.value_or(gpu_.step_overhead_s);
  if (!cal.prefill_roofline_exponent) return std::max(compute, memory) + overhead;
  const double p = *cal.prefill_roofline_exponent;
  // Scaled by the larger term so neither power over- or underflows.
  const double top = std::max(compute, memory);
  if (top <= 0.0) return overhead;
  return top * std::pow(std::pow(compute / top, p) + std::pow(memory / top, p), 1.0 / p) + overhead;
}

double cost_model::prefill_weight_rate(double bytes) const {
  const auto& cal = gpu_.calibration;
  if (!cal.prefill_memory) return gpu_.memory_bandwidth * cal.memory.at(bytes, gpu_.bandwidth_efficiency);
  return gpu_.memory_bandwidth * *cal.prefill_memory * split_bandwidth_fraction();
}

double cost_model::split_bandwidth_fraction() const {
  if (sm_share_ >= 1.0) return 1.0;
  // A share of the SMs still reaches most of the bandwidth with well-pipelined kernels
  // (sqrt(share)); a calibration says how much an engine's own kernels reach.
  return gpu_.calibration.split_bandwidth.at(sm_share_, std::min(1.0, std::sqrt(sm_share_) * 1.1));
}

double cost_model::decode_seconds(uint32_t batch, uint64_t context_tokens_total,
                                  uint32_t graph_rows) const {
  if (batch == 0) return 0.0;
  const auto parts = decode_parts(batch, context_tokens_total, graph_rows);
  return std::max(parts.compute_s(), parts.memory_s()) + parts.overhead_s;
}

cost_model::decode_parts_s cost_model::decode_parts(uint32_t batch, uint64_t context_tokens_total,
                                                    uint32_t graph_rows) const {
  decode_parts_s parts;
  if (batch == 0) return parts;
  const auto& cal = gpu_.calibration;
  const uint32_t rows = std::max(batch, graph_rows);
  const double linear = 2.0 * double(shape_.linear_params()) * rows;
  const double attention = 4.0 * shape_.layers * shape_.heads * shape_.head_dim * double(context_tokens_total);
  const double bw_share = split_bandwidth_fraction();
  const double weights = double(shape_.weight_bytes());
  const double kv = double(shape_.kv_bytes_per_token()) * context_tokens_total;
  const double peak = gpu_.bf16_flops * sm_share_;
  parts.linear_s = linear / (peak * cal.gemm.at(rows, gpu_.gemm_efficiency));
  parts.attention_s =
      attention / (peak * cal.attention.at(double(context_tokens_total) / batch, gpu_.gemm_efficiency));
  const double rate = gpu_.memory_bandwidth * cal.memory.at(weights + kv, gpu_.bandwidth_efficiency);
  // On a share the weight GEMVs and the KV reads of attention may reach different fractions of
  // the bandwidth they reach on the whole GPU (split_kv_bandwidth; docs/sim.md, "Sharing a GPU").
  const bool kv_own_share = sm_share_ < 1.0 && !cal.split_kv_bandwidth.empty();
  parts.weights_s = weights / (rate * bw_share);
  parts.kv_s = kv / (rate * (kv_own_share ? cal.split_kv_bandwidth.at(sm_share_, 1.0) : bw_share));
  parts.overhead_s = cal.step_overhead_s.value_or(gpu_.step_overhead_s) + cal.decode_sequence_overhead_s.value_or(0.0) * batch;
  return parts;
}

}  // namespace duet
