#pragma once
// Latency statistics for serving: exact percentiles over recorded samples, a fixed-bucket
// histogram for Prometheus, per-request records and the TTFT / TPOT / ITL / E2E / goodput
// summary printed by `duet demo`, written by `duet sim` and `duet bench serve`.
//
// Definitions (the ones vLLM's benchmark_serving and DistServe use):
//   TTFT  = first_token - arrival
//   E2E   = finish - arrival
//   TPOT  = (E2E - TTFT) / (output_tokens - 1), one value per request with > 1 output token
//   ITL   = every gap between consecutive output tokens, pooled over all requests
//   goodput = completed requests meeting both TTFT <= slo.ttft_s and TPOT <= slo.tpot_s,
//             divided by the run's duration (requests/s)
// Percentiles are exact (every sample is kept) and, by default, interpolate linearly between
// the two closest ranks (numpy's default, "type 7"); nearest-rank is available on request.
// All times are seconds on one clock (the sim's virtual clock or a steady clock).
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace duet {

/// How a percentile is read from sorted samples x[0..n-1], p in [0, 100].
enum class percentile_method : uint8_t {
  linear,        ///< x[h] interpolated at h = (n-1)·p/100 (numpy default); P50 of {1,2} = 1.5
  nearest_rank,  ///< x[ceil(n·p/100) - 1], clamped to x[0]; always an observed value
};

/// The exact percentile of already sorted samples. Returns 0 for an empty span; p is clamped
/// to [0, 100]. Precondition: `sorted` is ascending (checked in debug builds).
[[nodiscard]] double percentile_sorted(std::span<const double> sorted, double p,
                                       percentile_method method = percentile_method::linear);

/// The exact percentile of samples in any order (copies and sorts them).
[[nodiscard]] double percentile(std::span<const double> samples, double p,
                                percentile_method method = percentile_method::linear);

/// Count, mean, min, P50/P90/P99 and max of one set of samples. All zero when count == 0.
struct percentile_summary {
  size_t count = 0;
  double mean = 0;
  double min = 0;
  double p50 = 0;
  double p90 = 0;
  double p99 = 0;
  double max = 0;
};

/// Summarizes samples in any order (NaNs are dropped) with the given percentile method.
[[nodiscard]] percentile_summary summarize_samples(
    std::span<const double> samples, percentile_method method = percentile_method::linear);

/// A fixed-bucket histogram in the Prometheus style: buckets are upper bounds, inclusive
/// (a sample equal to a bound lands in that bucket), with an implicit +Inf bucket; counts are
/// reported cumulatively. Not thread-safe: one owner observes (an actor, or under a lock).
class latency_histogram {
 public:
  /// `upper_bounds` must be finite and strictly ascending; throws std::invalid_argument.
  explicit latency_histogram(std::vector<double> upper_bounds = default_latency_buckets_s());

  /// 1 ms .. 100 s in 1-2.5-5 steps: fits TTFT, TPOT, ITL and E2E in seconds.
  [[nodiscard]] static std::vector<double> default_latency_buckets_s();
  /// start, start·factor, ..., count bounds. Requires start > 0, factor > 1.
  [[nodiscard]] static std::vector<double> exponential_buckets(double start, double factor,
                                                               size_t count);
  /// start, start+width, ..., count bounds. Requires width > 0.
  [[nodiscard]] static std::vector<double> linear_buckets(double start, double width, size_t count);

  /// Records one sample. NaN is dropped (and counted in dropped()); ±Inf lands in the
  /// first or the +Inf bucket and makes sum() infinite, as in Prometheus.
  void observe(double value);
  /// Adds another histogram's counts; throws std::invalid_argument if the bounds differ.
  void merge(const latency_histogram& other);
  void reset();

  [[nodiscard]] std::span<const double> upper_bounds() const { return bounds_; }
  /// Cumulative counts, one per bound plus the +Inf bucket last (which equals count()).
  [[nodiscard]] std::vector<uint64_t> cumulative_counts() const;
  [[nodiscard]] uint64_t count() const { return count_; }
  [[nodiscard]] double sum() const { return sum_; }
  [[nodiscard]] uint64_t dropped() const { return dropped_; }

  /// Prometheus' histogram_quantile: linear interpolation inside the bucket that holds the
  /// q-quantile (q in [0, 1]); the lowest bucket starts at 0; a quantile in +Inf returns the
  /// highest finite bound. 0 when empty.
  [[nodiscard]] double estimate_quantile(double q) const;

  /// Prometheus text exposition (version 0.0.4): # HELP, # TYPE, name_bucket{...,le="..."},
  /// name_sum and name_count, each line ending in '\n'. Label values are escaped.
  [[nodiscard]] std::string to_prometheus(
      std::string_view name, std::string_view help,
      std::span<const std::pair<std::string, std::string>> labels = {}) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; bounds_.size() + 1 entries
  uint64_t count_ = 0;
  uint64_t dropped_ = 0;
  double sum_ = 0;
};

/// The outcome string of a request that completed normally (stop or length).
inline constexpr std::string_view request_outcome_ok = "ok";

/// What one request did, as seen by the client (or the simulator's client model).
struct request_record {
  uint64_t id = 0;
  double arrival_s = 0;                 // request sent / arrived at the router
  std::optional<double> first_token_s;  // first output token received; none if it never came
  std::vector<double> itl_s;            // gaps between consecutive output tokens after the
                                        // first (output_tokens - 1 when every token was seen;
                                        // a token delivered in the same batch gives a 0 gap)
  double finish_s = 0;                  // final response (success or error) received
  uint32_t prompt_tokens = 0;
  uint32_t output_tokens = 0;
  std::string outcome = std::string(request_outcome_ok);  // "ok", or why it failed:
                                                          // "cancelled", "timeout", "error"...
  std::optional<double> first_text_s;  // HTTP: the first event with text; later than first_token_s
                                       // when the first token's text was held back (part of a
                                       // UTF-8 character, a special token)

  [[nodiscard]] bool succeeded() const { return outcome == request_outcome_ok; }
  [[nodiscard]] double e2e_s() const { return finish_s - arrival_s; }
  /// first_token_s - arrival_s, when a first token came.
  [[nodiscard]] std::optional<double> ttft_s() const;
  /// (E2E - TTFT) / (output_tokens - 1), when a first token came and output_tokens > 1.
  [[nodiscard]] std::optional<double> tpot_s() const;
  /// Absolute times of the output tokens: first_token_s, then first_token_s + cumulative
  /// itl_s. Empty when no first token came.
  [[nodiscard]] std::vector<double> token_times_s() const;
};

/// A latency service-level objective; infinity means "no limit".
struct latency_slo {
  double ttft_s = std::numeric_limits<double>::infinity();
  double tpot_s = std::numeric_limits<double>::infinity();

  [[nodiscard]] bool limits_anything() const;
};

/// Whether a request counts towards goodput: it succeeded, its TTFT <= slo.ttft_s and its
/// TPOT <= slo.tpot_s. A request with a single output token has no TPOT and meets that half;
/// one that succeeded without any token is judged on its E2E in place of its TTFT.
[[nodiscard]] bool meets_slo(const request_record& record, const latency_slo& slo);

/// Everything `summarize` reports about one run.
struct latency_summary {
  size_t requests = 0;                     // records summarized
  size_t completed = 0;                    // outcome == "ok"
  size_t failed = 0;                       // any other outcome
  std::map<std::string, size_t> outcomes;  // count per outcome string, "ok" included
  double duration_s = 0;                   // last finish - first arrival, or the duration passed in
  uint64_t input_tokens = 0;               // prompt tokens of completed requests
  uint64_t output_tokens = 0;              // output tokens of completed requests
  double request_throughput = 0;           // completed requests / s
  double output_token_throughput = 0;      // output tokens of completed requests / s
  double total_token_throughput = 0;       // (prompt + output) tokens of completed requests / s
  latency_slo slo;
  size_t good = 0;            // completed requests meeting the SLO
  double goodput = 0;         // good / duration_s (requests / s), DistServe's goodput
  double slo_attainment = 0;  // good / requests (failed requests count as misses)
  percentile_method method = percentile_method::linear;
  percentile_summary ttft_s;  // completed requests with a first token
  percentile_summary tpot_s;  // completed requests with > 1 output token
  percentile_summary itl_s;   // all gaps of completed requests
  // The first of those gaps per request (first to second token): on PD it holds the KV
  // handover and the wait to join a decode step, which ITL's P99 hides among the rest or,
  // with short outputs, is made of.
  percentile_summary second_token_s;
  percentile_summary e2e_s;   // completed requests
};

/// Summarizes a run. Latency percentiles cover completed requests only; failed ones count
/// in `failed`, `outcomes` and against `slo_attainment`. The duration is the span from the
/// first arrival to the last finish over all records.
[[nodiscard]] latency_summary summarize(std::span<const request_record> records,
                                        const latency_slo& slo = {},
                                        percentile_method method = percentile_method::linear);
/// Same, with the duration given (e.g. the benchmark's wall time); throughputs divide by it.
[[nodiscard]] latency_summary summarize(std::span<const request_record> records,
                                        const latency_slo& slo, double duration_s,
                                        percentile_method method = percentile_method::linear);

/// A terminal-friendly table: request counts, throughput, goodput, then one row per metric
/// (TTFT, TPOT, ITL, 2nd token, E2E) with mean / P50 / P90 / P99 / max in milliseconds and the count.
/// Lines end in '\n'; no colour codes; 80 columns (a long list of failure kinds may wrap).
[[nodiscard]] std::string format_summary_table(const latency_summary& summary,
                                               std::string_view title = {});

/// Several runs side by side: one column per run, one row per quantity.
[[nodiscard]] std::string format_comparison_table(
    std::span<const std::pair<std::string, latency_summary>> runs);

[[nodiscard]] std::string_view to_string(percentile_method method);

/// JSON form (seconds; an unlimited SLO is null). Also usable as `nlohmann::json j = s;`.
[[nodiscard]] nlohmann::json to_json(const latency_summary& summary);
void to_json(nlohmann::json& j, const latency_summary& summary);
void to_json(nlohmann::json& j, const percentile_summary& summary);
/// Reads what to_json wrote; throws nlohmann::json::exception on a missing or mistyped key.
void from_json(const nlohmann::json& j, latency_summary& summary);
void from_json(const nlohmann::json& j, percentile_summary& summary);

}  // namespace duet
