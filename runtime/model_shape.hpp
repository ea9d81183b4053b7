#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace duet {

/// The dimensions of a decoder-only transformer that cost and memory depend on.
struct model_shape {
  std::string name;
  std::string arch;  // "llama" | "qwen2"
  uint32_t layers = 0;
  uint32_t hidden = 0;
  uint32_t heads = 0;
  uint32_t kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t ffn = 0;
  uint32_t vocab = 0;
  bool tied_embeddings = false;
  uint32_t dtype_bytes = 2;  // bf16

  /// Parameters of every matrix a forward pass multiplies by (LM head included).
  [[nodiscard]] uint64_t linear_params() const;
  [[nodiscard]] uint64_t weight_bytes() const;
  /// K and V of every layer for one token.
  [[nodiscard]] uint64_t kv_bytes_per_token() const {
    return 2ull * layers * kv_heads * head_dim * dtype_bytes;
  }
};

/// Real published shapes: r1-distill-llama-8b, r1-distill-qwen-1.5b, r1-distill-qwen-7b,
/// smollm2-135m, and "tiny" (a few layers, for tests). Empty when unknown.
[[nodiscard]] std::optional<model_shape> find_model_shape(std::string_view preset);

/// Measured fraction of a peak as a function of one shape quantity: points (shape, fraction)
/// with ascending shapes, interpolated linearly in log(shape) and held flat beyond the ends.
struct efficiency_curve {
  std::vector<std::pair<double, double>> points;

  [[nodiscard]] bool empty() const { return points.empty(); }
  /// The fraction at `shape`; `fallback` when the curve is empty.
  [[nodiscard]] double at(double shape, double fallback) const;
};

/// A calibration file's measurements (docs/sim.md, "Calibration files"). Empty curves leave
/// the spec's single efficiencies in force.
struct gpu_calibration {
  std::string source;           // the file it came from
  // sm_shares = "nominal": shares below 1 are priced as configured, not as the green context's
  // SMs (partition_sms), and the curves keyed by share below are at configured shares: the
  // calibrations fitted before the simulator rounded shares (docs/sim.md).
  bool nominal_sm_shares = false;
  efficiency_curve gemm;        // x: tokens in the step (GEMM M); fraction of peak FLOP/s
  efficiency_curve attention;   // x: mean keys per query; fraction of peak FLOP/s
  efficiency_curve memory;      // x: bytes read by the step; fraction of peak bandwidth
  efficiency_curve split_bandwidth;  // x: SM share (< 1); fraction of the whole GPU's bandwidth
                                     // an engine on that share reaches (default min(1, 1.1·√s))
  efficiency_curve split_kv_bandwidth;  // x: SM share (< 1); the same for a decode step's KV
                                        // reads (its attention kernels), relative to what they
                                        // reach on the whole GPU; empty = split_bandwidth's
  efficiency_curve split_compute;  // x: SM share (< 1); factor on the whole GPU's gemm / attention
                                   // fractions that a prefill step on that share reaches of the
                                   // share's peak FLOP/s; may exceed 1 (empty: 1)
  // The fraction of peak bandwidth a prefill step's weight reads reach (its memory floor: its
  // kernels run one by one, not in one graph), times split_bandwidth on a share. Unset: the
  // memory curve at the weights' bytes, on the whole GPU's bandwidth at any share.
  std::optional<double> prefill_memory;
  // A prefill step's GEMMs compute whole tiles of this many rows: a step of T tokens is priced
  // as ceil(T / this) tiles, its GEMM FLOPs and the gemm curve both at those rows (a step of 700
  // tokens as one of 768 at 128). Unset: T exactly, as the curve's points were measured at
  // multiples of 64 and 128 (the model before 2026-12-06, late).
  std::optional<uint32_t> prefill_gemm_row_tile;
  // A prefill step's compute time c and weight-read time m combine as (c^p + m^p)^(1/p) with p
  // this: a step of a few hundred tokens runs GEMMs too narrow to hide their reads behind their
  // math, so it costs more than the larger of the two (H100: 7.0-8.0 ms at 70-240 tokens
  // against a 6.7 ms weight floor). Unset: max(c, m), the plain roofline.
  std::optional<double> prefill_roofline_exponent;
  // Engines on the two shares of one split GPU (event_sim): a decode step runs this many times
  // as long while the other share's prefill step is in flight, for the part of it they overlap
  // (the SMs are split, the HBM and L2 are not). split_bandwidth and split_kv_bandwidth are
  // then the rates with prefill idle. Unset: 1, the shares do not interact.
  std::optional<double> split_decode_slowdown;
  // x: SM share (< 1); a prefill step on that share runs this many times as long while the
  // other share's decode step is in flight; split_compute is then its rate with decode idle.
  // Empty: 1.
  efficiency_curve split_prefill_slowdown;
  std::optional<double> step_overhead_s;
  std::optional<double> decode_sequence_overhead_s;  // host work per sequence per decode step
  // Engines of one GPU on streams of their own (event_sim): a step starting while the other
  // engine is busy takes this many times as long (kernels from both streams share the SMs).
  std::optional<double> concurrent_decode_slowdown;
  std::optional<double> concurrent_prefill_slowdown;
  // ... and a decode step starting while prefill runs waits this much longer in all: each of
  // its few hundred small kernels queues for SMs behind the prefill GEMM's thread blocks.
  std::optional<double> concurrent_decode_delay_s;
  // With this set, that delay is the one beside a chunk's GEMM tiles, and it scales with the
  // chunk in flight: a decode kernel waits out the thread block on its SM, and a prefill
  // attention block over K keys holds an SM (K / this)·(GEMM efficiency / attention
  // efficiency) times as long as a GEMM tile (this: the keys at which an attention block does
  // a GEMM tile's FLOPs). event_sim weights the two by the chunk's modelled GEMM and attention
  // time (docs/sim.md, "Engines on streams of their own").
  std::optional<double> concurrent_decode_tile_keys;
  // With this true, a decode step waits out that delay only for the part of it the prefill step
  // in flight overlaps: a chunk ending a third of the way into the step (delay included)
  // delays it by a third of the delay (event_sim, docs/sim.md).
  std::optional<bool> concurrent_decode_delay_by_overlap;
  // With this true, a prefill step that starts while a decode step runs on the other stream
  // interferes with the rest of it as one already running would: the decode step's kernels
  // still to come wait (concurrent_decode_delay_s, scaled as above, times the share of the
  // step left), and the prefill step loses its yield of that rest (event_sim, docs/sim.md).
  // Without it only the engine whose step starts second is affected.
  std::optional<bool> concurrent_overlap_on_prefill_start;
  // ... and a prefill step in flight loses this fraction of every decode step that starts
  // during it (the decode stream has the higher priority: its kernels get the SMs first).
  std::optional<double> concurrent_prefill_yield;
  // With this set, the fraction of a decode step's attention time (its KV reads: the share of
  // its modelled time the roofline gives them) that prefill loses, concurrent_prefill_yield
  // then being that of the rest of the step (weight GEMMs). Decode attention is split to
  // fill every SM; a prefill kernel that needs a whole SM cannot run beside any of its blocks.
  std::optional<double> concurrent_prefill_attention_yield;
  // x: tokens of the prefill step in flight; factors on the effects above (empty: 1).
  // Short steps are made of short kernels, one or two waves each: between them the decode
  // stream takes the SMs first, so a short step loses more of each decode step beside it
  // (the yields times this, at most 1), a decode kernel finds SMs sooner (the delay times
  // this) and shares them with prefill kernels more of the time (concurrent_decode_slowdown
  // times this, at least 1). Fitted on serving runs at 512- to 2,048-token chunks (docs/sim.md).
  efficiency_curve concurrent_prefill_yield_scale;
  efficiency_curve concurrent_decode_delay_scale;
  efficiency_curve concurrent_decode_slowdown_scale;
  // x: the decode step's rows; a factor on the delay above on streams (empty: 1). A step of a
  // few rows launches kernels of a few thread blocks each, which start on the first SMs a
  // prefill block frees; a wide step's kernels wait for many. H200 runs: a 1-3 row step beside
  // a 1,024-token chunk waited 3-6 ms, a 128-256 row step 24-26 ms (docs/sim.md).
  efficiency_curve concurrent_decode_delay_batch_scale;
  // x: the fraction of the GPU's SMs no partition holds, when a decode engine on the whole GPU
  // (sm_share 1, own stream) runs beside a prefill engine on a partition (sm_share < 1): factor
  // on the delay above. Those SMs are decode's alone, so its kernels start there without
  // waiting for a prefill block to retire (empty: 1, as on streams; docs/sim.md).
  efficiency_curve reserve_decode_delay_scale;
  // x: the decode step's rows; a further factor on that delay beside a partition (empty: 1).
  // Fitted on H100 runs: a step of 2-3 rows (the code trace) was delayed about 0.6 times as
  // much as one of 28-63 rows (conversation) at the same share (docs/sim.md).
  efficiency_curve reserve_decode_delay_batch_scale;
  // ... and the factor on the yield the prefill engine on the partition loses to each decode
  // step (the result at most the whole step; empty: the partition's share, as if the decode
  // kernels spread evenly over every SM).
  efficiency_curve reserve_prefill_yield_scale;
  // x: the decode step's rows; a further factor on that yield (empty: 1).
  efficiency_curve reserve_prefill_yield_batch_scale;
  // ... and, beside such a partition, the fraction of a decode step's attention time the prefill
  // loses, in place of concurrent_prefill_attention_yield (before the factor above): the
  // attention's blocks fill the SMs no partition holds first, so less of them wait for the
  // partition's SMs than on streams (empty: concurrent_prefill_attention_yield; docs/sim.md).
  std::optional<double> reserve_prefill_attention_yield;
  // Engines of one GPU on one shared stream (stream = "shared", event_sim's step_policy::
  // stream): a prefill step holds the stream this much longer than its modelled work. Fitted
  // to the prefill step time (prefill.hop_step) the colocated serving runs measured; what
  // the time is spent on is not broken down (docs/sim.md).
  std::optional<double> shared_prefill_delay_s;
  // x: a decode step's rows; seconds of a prefill step's work that run ahead of the decode step
  // when both are enqueued on one shared stream in the same instant (empty: none). The decode
  // worker prepares its rows on the host before it launches; the prefill worker's first
  // kernels land on the stream meanwhile (docs/sim.md, "One shared stream").
  efficiency_curve shared_decode_lag_s;
  // A request's time outside the router, front end to client and back (HTTP, tokenizing, the
  // first token's way out): event_sim admits each request this much after it arrives, so its
  // TTFT and end-to-end time include it. Measured, not fitted: the live runs' client TTFT less
  // the router's (bench serve's "beyond the router").
  std::optional<double> front_end_s;
  // Front-end work per prompt token (reading and parsing the request body), which the
  // requests in the front end at one time share (processor sharing): requests that arrive
  // together reach the router shortest first. The Mooncake H100 runs: ten prompts of 2-16K
  // tokens arriving in one millisecond were prefilled in order of length (docs/sim.md).
  std::optional<double> front_end_token_s;
};

/// A GPU's spec-sheet peaks and the fractions of them reached in practice.
struct gpu_spec {
  std::string name;
  double bf16_flops = 0;        // dense, FLOP/s
  double memory_bandwidth = 0;  // bytes/s
  double memory_bytes = 0;
  uint32_t sms = 0;
  double gemm_efficiency = 0.7;       // achieved / peak for large GEMMs
  double bandwidth_efficiency = 0.88; // achieved / peak for streaming reads
  double step_overhead_s = 30e-6;     // launch and host work per engine step
  double nvlink_bandwidth = 0;        // bytes/s one way; 0 = no NVLink
  double pcie_bandwidth = 0;          // bytes/s one way, host link
  double nic_bandwidth = 0;           // bytes/s one way, the network interface per GPU
  double link_efficiency = 0.88;      // achieved / peak for large transfers on any link
  gpu_calibration calibration;        // measured fractions of peak; empty = the fields above
  // Green-context partitions (CUDA's cuDevSmResourceSplitByCount): at least this many SMs, in
  // multiples of the step. 0: shares are taken as given.
  uint32_t sm_partition_min = 0;
  uint32_t sm_partition_step = 0;
};

/// round(share x total) in multiples of `step`, at least `least`: what a green context asked
/// for that share of a device's SMs is given before the cap by what other partitions left
/// (the CUDA engine's sm_partition and partition_sms below both use it).
[[nodiscard]] double partition_request(double share, double total, double step, double least);
/// The SMs a green context asked for `share` of `spec`'s SMs gets when `available` are left,
/// as the CUDA engine makes it: round(share x SMs) in the partition steps, at least the minimum
/// partition, at most what is left. Throws std::invalid_argument when fewer than the minimum
/// are left. Without partition steps in the spec, or with a calibration of nominal shares:
/// share x SMs, unrounded.
[[nodiscard]] double partition_sms(const gpu_spec& spec, double share, double available);
/// The share of the whole GPU the engine on that partition runs on: partition_sms / SMs, or
/// `share` where the spec gives no SM count.
[[nodiscard]] double partition_share(const gpu_spec& spec, double share);

/// `spec`'s calibration (`cal`) with the engine `factor` times as fast: the GEMM, attention and
/// memory efficiencies scaled, each at most 1; an empty curve starts from the spec's default.
/// What a few percent of engine speed (one machine against another) does to a prediction.
[[nodiscard]] gpu_calibration with_engine_speed(gpu_calibration cal, const gpu_spec& spec, double factor);

/// H20, H100, H200, A100, L40S (docs/sim.md cites the spec sheets). Empty when unknown.
/// Reads the GPU spec file when there is one (runtime/gpu_catalog.hpp), else the built-in table.
[[nodiscard]] std::optional<gpu_spec> find_gpu_spec(std::string_view name);

/// Roofline cost of engine steps: the larger of compute time and memory time, plus overhead.
class cost_model {
 public:
  cost_model(model_shape shape, gpu_spec gpu, double sm_share = 1.0);

  /// One prefill step over chunks; each chunk is (tokens in chunk, tokens before it).
  [[nodiscard]] double prefill_seconds(uint64_t chunk_tokens_total, double attention_flops) const;
  /// Bytes per second a prefill step reads its `bytes` of weights at (its memory floor).
  [[nodiscard]] double prefill_weight_rate(double bytes) const;
  /// The fraction of the whole GPU's bandwidth an engine on this cost model's share reaches.
  [[nodiscard]] double split_bandwidth_fraction() const;
  /// The compute terms of prefill_seconds: GEMM seconds and attention seconds, each with the
  /// efficiency it was priced at (no overhead, no memory bound).
  struct prefill_compute {
    double gemm_s = 0, attention_s = 0;
    double gemm_efficiency = 0, attention_efficiency = 0;
  };
  [[nodiscard]] prefill_compute prefill_compute_parts(uint64_t chunk_tokens_total,
                                                      double attention_flops) const;
  /// Attention FLOPs of a chunk of `tokens` after `prior` cached tokens (causal).
  [[nodiscard]] double chunk_attention_flops(uint32_t tokens, uint32_t prior) const;
  /// One decode step for `batch` sequences holding `context_tokens_total` tokens in all. A
  /// CUDA graph captured for `graph_rows` > batch runs its GEMMs on that many rows (the
  /// padding); attention, KV reads and host work stay those of the batch.
  [[nodiscard]] double decode_seconds(uint32_t batch, uint64_t context_tokens_total,
                                      uint32_t graph_rows = 0) const;
  /// The terms of decode_seconds: compute (linear layers, attention) and memory (weights, KV)
  /// seconds; decode_seconds = max(compute, memory) + overhead.
  struct decode_parts_s {
    double linear_s = 0, attention_s = 0, weights_s = 0, kv_s = 0, overhead_s = 0;
    [[nodiscard]] double compute_s() const { return linear_s + attention_s; }
    [[nodiscard]] double memory_s() const { return weights_s + kv_s; }
    /// The attention's share of the bound the roofline picks (KV reads when memory-bound).
    [[nodiscard]] double attention_share() const {
      if (memory_s() >= compute_s()) return memory_s() > 0 ? kv_s / memory_s() : 0.0;
      return attention_s / compute_s();
    }
  };
  [[nodiscard]] decode_parts_s decode_parts(uint32_t batch, uint64_t context_tokens_total,
                                            uint32_t graph_rows = 0) const;

  [[nodiscard]] const model_shape& shape() const { return shape_; }
  [[nodiscard]] const gpu_spec& gpu() const { return gpu_; }

 private:
  model_shape shape_;
  gpu_spec gpu_;
  double sm_share_;
};

}  // namespace duet
