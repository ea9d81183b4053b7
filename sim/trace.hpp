#pragma once
// Request traces for `duet sim` and `duet bench serve`: loaders for the public Azure LLM
// inference CSV and Mooncake JSONL traces, seeded synthetic arrival processes, the
// transformations a replay needs (rate scaling, time window, count limit, context clipping)
// and descriptive statistics.
//
// Every loader and generator returns requests in arrival order with the first arrival at
// t = 0 (Azure: seconds since the earliest row; Mooncake: its relative milliseconds / 1000).
// Loaders throw trace_error naming "file:line: what" on the first malformed row.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <limits>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace duet {

/// One request of a trace.
struct trace_request {
  double arrival_s = 0;                 // seconds since the trace's first arrival
  uint32_t input_tokens = 0;            // prompt length
  uint32_t output_tokens = 0;           // tokens to generate
  std::vector<uint64_t> prefix_hashes;  // one id per prefix block (Mooncake: 512 tokens);
                                        // equal leading ids mean a shareable KV prefix
};

/// A malformed trace file or invalid generator parameters. what() is "file:line: reason"
/// for file errors.
class trace_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Tokens per prefix-hash block in the Mooncake traces.
inline constexpr uint32_t mooncake_hash_block_tokens = 512;

/// Azure LLM inference trace (2023 or 2024): a header naming TIMESTAMP, ContextTokens and
/// GeneratedTokens (any order, extra columns ignored), then one row per request with a
/// timestamp like "2023-11-16 18:15:46.6805900" (up to 9 fraction digits, optional 'T'
/// separator and "Z"/"+HH:MM" offset). Blank lines are skipped; CRLF is accepted.
[[nodiscard]] std::vector<trace_request> load_azure_csv(const std::filesystem::path& file);
/// Same, from a stream; `source_name` stands for the file name in errors.
[[nodiscard]] std::vector<trace_request> parse_azure_csv(std::istream& in,
                                                         const std::string& source_name);

/// Mooncake trace: one JSON object per line with "timestamp" (ms), "input_length",
/// "output_length" and optional "hash_ids" (array of non-negative integers).
[[nodiscard]] std::vector<trace_request> load_mooncake_jsonl(const std::filesystem::path& file);
[[nodiscard]] std::vector<trace_request> parse_mooncake_jsonl(std::istream& in,
                                                              const std::string& source_name);

/// Picks the loader by extension: .csv → Azure, .jsonl/.json → Mooncake.
[[nodiscard]] std::vector<trace_request> load_trace(const std::filesystem::path& file);

/// Writes the Mooncake JSONL form (timestamps rounded to whole ms, as the format has them),
/// so a synthetic or transformed trace can be saved and replayed.
void write_mooncake_jsonl(std::ostream& out, std::span<const trace_request> trace);
void save_mooncake_jsonl(const std::filesystem::path& file, std::span<const trace_request> trace);

// ---------------------------------------------------------------------------- synthetic

/// A distribution of token counts; every draw is rounded and clamped to [min, max].
struct length_distribution {
  enum class shape : uint8_t {
    fixed,      ///< always `mean`
    uniform,    ///< integers uniform in [min, max]
    lognormal,  ///< lognormal with the given mean and coefficient of variation `cv`
  };
  shape kind = shape::fixed;
  double mean = 128;
  double cv = 0;
  uint32_t min = 1;
  uint32_t max = std::numeric_limits<uint32_t>::max();

  [[nodiscard]] static length_distribution fixed(uint32_t tokens);
  [[nodiscard]] static length_distribution uniform(uint32_t lo, uint32_t hi);
  [[nodiscard]] static length_distribution lognormal(
      double mean, double cv, uint32_t lo = 1, uint32_t hi = std::numeric_limits<uint32_t>::max());
};

/// How arrivals are spaced.
enum class arrival_process : uint8_t {
  poisson,  ///< exponential inter-arrivals at `rate` (CV 1)
  gamma,    ///< gamma inter-arrivals with mean 1/rate and coefficient of variation `cv`
            ///< (cv < 1 smoother than Poisson, cv > 1 burstier)
  on_off,   ///< alternating periods: `on_s` seconds of Poisson arrivals, then `off_s`
            ///< seconds of none; the rate inside a burst is rate·(on_s + off_s)/on_s, so
            ///< `rate` stays the long-run mean
};

/// Parameters of a synthetic trace. It stops after `count` requests, or at `duration_s`
/// when count is 0 (at least one of them must be set).
struct synthetic_trace_params {
  arrival_process process = arrival_process::poisson;
  double rate = 1.0;   // long-run mean requests per second, > 0
  double cv = 1.0;     // gamma: coefficient of variation of inter-arrival times, > 0
  double on_s = 1.0;   // on_off: burst length
  double off_s = 1.0;  // on_off: silence between bursts
  size_t count = 0;
  double duration_s = 0;
  length_distribution input = length_distribution::fixed(512);
  length_distribution output = length_distribution::fixed(128);
  uint64_t seed = 0;  // same seed and parameters → same trace, on every platform
};

/// Generates a synthetic trace; the first request arrives at t = 0. Throws trace_error on
/// invalid parameters. Uses mt19937_64 with its own (portable) distribution transforms.
[[nodiscard]] std::vector<trace_request> generate_synthetic_trace(
    const synthetic_trace_params& params);

// ---------------------------------------------------------------------------- transforms

/// Multiplies the request rate by `factor` (> 0): every arrival time is divided by it, so 2
/// compresses the trace into half the time and 0.5 stretches it to twice as long.
[[nodiscard]] std::vector<trace_request> scale_rate(std::vector<trace_request> trace,
                                                    double factor);

/// Keeps the requests with start_s <= arrival < start_s + duration_s and shifts them so the
/// window starts at t = 0.
[[nodiscard]] std::vector<trace_request> time_window(std::vector<trace_request> trace,
                                                     double start_s, double duration_s);

/// Keeps the first `max_count` requests.
[[nodiscard]] std::vector<trace_request> limit_count(std::vector<trace_request> trace,
                                                     size_t max_count);

/// Makes every request fit input + output <= max_context: the input is clipped first but
/// keeps at least 1 token, then the output. Prefix hashes beyond the clipped input are
/// dropped (`hash_block_tokens` tokens per hash).
[[nodiscard]] std::vector<trace_request> clip_to_context(
    std::vector<trace_request> trace, uint32_t max_context,
    uint32_t hash_block_tokens = mooncake_hash_block_tokens);

/// The transformations a replay applies, in this order: window, rate scale, count, clip.
struct trace_transform {
  double window_start_s = 0;
  double window_duration_s = std::numeric_limits<double>::infinity();
  double rate_scale = 1.0;
  size_t max_requests = 0;   // 0 = all
  uint32_t max_context = 0;  // 0 = no clipping
};
[[nodiscard]] std::vector<trace_request> apply_transform(std::vector<trace_request> trace,
                                                         const trace_transform& transform);

// ---------------------------------------------------------------------------- statistics

/// Descriptive statistics of a trace.
struct trace_stats {
  size_t count = 0;
  double duration_s = 0;       // last arrival - first arrival
  double mean_rate = 0;        // (count - 1) / duration_s: 1 / mean inter-arrival time
  double interarrival_cv = 0;  // stddev / mean of inter-arrival times (1 for Poisson)
  double input_mean = 0;
  double input_p50 = 0;
  double input_p99 = 0;
  uint32_t input_max = 0;
  double output_mean = 0;
  double output_p50 = 0;
  double output_p99 = 0;
  uint32_t output_max = 0;
};

/// Computes trace_stats (percentiles interpolate linearly, as in latency_stats).
[[nodiscard]] trace_stats compute_trace_stats(std::span<const trace_request> trace);
/// A few lines for the terminal.
[[nodiscard]] std::string format_trace_stats(const trace_stats& stats);
void to_json(nlohmann::json& j, const trace_stats& stats);

}  // namespace duet
