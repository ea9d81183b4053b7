#include "sim/trace.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <istream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <ostream>
#include <random>
#include <string_view>

#include "runtime/latency_stats.hpp"

namespace duet {

namespace {

[[noreturn]] void fail_at(const std::string& source, size_t line, const std::string& what) {
  throw trace_error(source + ":" + std::to_string(line) + ": " + what);
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
  return s;
}

std::vector<std::string_view> split_csv(std::string_view line) {
  std::vector<std::string_view> fields;
  size_t start = 0;
  while (true) {
    const size_t comma = line.find(',', start);
    fields.push_back(trim(line.substr(start, comma - start)));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return fields;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool parse_uint(std::string_view s, uint64_t& out) {
  if (s.empty()) return false;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size();
}

/// Parses exactly `digits` decimal digits at s[pos..] into `out`.
bool fixed_digits(std::string_view s, size_t pos, size_t digits, int& out) {
  if (pos + digits > s.size()) return false;
  out = 0;
  for (size_t i = pos; i < pos + digits; ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
    out = out * 10 + (s[i] - '0');
  }
  return true;
}

/// "YYYY-MM-DD HH:MM:SS[.f{1,9}][Z|±HH:MM]" → nanoseconds since the Unix epoch (UTC when an
/// offset is given; otherwise the time as written, which only matters relative to itself).
bool parse_timestamp_ns(std::string_view s, int64_t& out) {
  int y, mo, d, h, mi, sec;
  if (!fixed_digits(s, 0, 4, y) || s.size() < 19 || s[4] != '-' || !fixed_digits(s, 5, 2, mo) ||
      s[7] != '-' || !fixed_digits(s, 8, 2, d) || (s[10] != ' ' && s[10] != 'T') ||
      !fixed_digits(s, 11, 2, h) || s[13] != ':' || !fixed_digits(s, 14, 2, mi) || s[16] != ':' ||
      !fixed_digits(s, 17, 2, sec)) {
    return false;
  }
  const std::chrono::year_month_day ymd{std::chrono::year{y},
                                        std::chrono::month{static_cast<unsigned>(mo)},
                                        std::chrono::day{static_cast<unsigned>(d)}};
  if (!ymd.ok() || h > 23 || mi > 59 || sec > 60) return false;
  size_t pos = 19;
  int64_t frac_ns = 0;
  if (pos < s.size() && s[pos] == '.') {
    ++pos;
    size_t digits = 0;
    while (pos < s.size() && s[pos] >= '0' && s[pos] <= '9') {
      if (digits < 9) frac_ns = frac_ns * 10 + (s[pos] - '0');
      ++digits;
      ++pos;
    }
    if (digits == 0) return false;
    for (size_t i = digits; i < 9; ++i) frac_ns *= 10;
  }
  int64_t offset_s = 0;
  if (pos < s.size()) {
    if (s[pos] == 'Z' && pos + 1 == s.size()) {
      pos += 1;
    } else if ((s[pos] == '+' || s[pos] == '-') && pos + 6 == s.size() && s[pos + 3] == ':') {
      int oh, om;
      if (!fixed_digits(s, pos + 1, 2, oh) || !fixed_digits(s, pos + 4, 2, om)) return false;
      offset_s = (s[pos] == '+' ? 1 : -1) * (oh * 3600 + om * 60);
      pos += 6;
    } else {
      return false;
    }
  }
  const int64_t days = std::chrono::sys_days{ymd}.time_since_epoch().count();
  const int64_t seconds = days * 86400 + h * 3600 + mi * 60 + sec - offset_s;
  out = seconds * 1'000'000'000 + frac_ns;
  return true;
}

std::ifstream open_input(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw trace_error(file.string() + ": cannot open trace file");
  return in;
}

/// Stable-sorts by arrival and shifts the first arrival to t = 0.
void normalize_arrivals(std::vector<trace_request>& trace) {
  if (trace.empty()) return;
  if (!std::is_sorted(trace.begin(), trace.end(),
                      [](const auto& a, const auto& b) { return a.arrival_s < b.arrival_s; })) {
    std::stable_sort(trace.begin(), trace.end(),
                     [](const auto& a, const auto& b) { return a.arrival_s < b.arrival_s; });
  }
  const double t0 = trace.front().arrival_s;
  for (auto& r : trace) r.arrival_s -= t0;
}

}  // namespace

// ---------------------------------------------------------------------------- Azure CSV

std::vector<trace_request> parse_azure_csv(std::istream& in, const std::string& source_name) {
  std::string line;
  size_t line_no = 0;
  size_t col_time = 0, col_in = 0, col_out = 0, columns = 0;
  bool have_header = false;
  while (!have_header && std::getline(in, line)) {
    ++line_no;
    std::string_view view = line;
    if (line_no == 1 && view.starts_with("\xEF\xBB\xBF")) view.remove_prefix(3);  // UTF-8 BOM
    if (trim(view).empty()) continue;
    const auto fields = split_csv(view);
    columns = fields.size();
    bool found[3] = {false, false, false};
    for (size_t i = 0; i < fields.size(); ++i) {
      const std::string name = lower(fields[i]);
      if (name == "timestamp") {
        col_time = i, found[0] = true;
      } else if (name == "contexttokens") {
        col_in = i, found[1] = true;
      } else if (name == "generatedtokens") {
        col_out = i, found[2] = true;
      }
    }
    if (!found[0] || !found[1] || !found[2]) {
      fail_at(source_name, line_no,
              "expected a header with TIMESTAMP,ContextTokens,GeneratedTokens, got \"" +
                  std::string(trim(view)) + "\"");
    }
    have_header = true;
  }
  if (!have_header) fail_at(source_name, std::max<size_t>(line_no, 1), "empty trace file");

  std::vector<int64_t> stamps;
  std::vector<trace_request> trace;
  while (std::getline(in, line)) {
    ++line_no;
    if (trim(line).empty()) continue;
    const auto fields = split_csv(line);
    if (fields.size() != columns) {
      fail_at(
          source_name, line_no,
          "expected " + std::to_string(columns) + " columns, got " + std::to_string(fields.size()));
    }
    int64_t ns = 0;
    if (!parse_timestamp_ns(fields[col_time], ns)) {
      fail_at(source_name, line_no,
              "bad TIMESTAMP \"" + std::string(fields[col_time]) +
                  "\" (want YYYY-MM-DD HH:MM:SS.fffffff)");
    }
    uint64_t in_tokens = 0, out_tokens = 0;
    if (!parse_uint(fields[col_in], in_tokens) || in_tokens > UINT32_MAX) {
      fail_at(source_name, line_no,
              "bad ContextTokens \"" + std::string(fields[col_in]) +
                  "\" (want a non-negative integer)");
    }
    if (!parse_uint(fields[col_out], out_tokens) || out_tokens > UINT32_MAX) {
      fail_at(source_name, line_no,
              "bad GeneratedTokens \"" + std::string(fields[col_out]) +
                  "\" (want a non-negative integer)");
    }
    stamps.push_back(ns);
    trace.push_back({0.0, static_cast<uint32_t>(in_tokens), static_cast<uint32_t>(out_tokens), {}});
  }
  if (in.bad()) fail_at(source_name, line_no, "read error");
  if (!stamps.empty()) {
    // Relative times from integer nanoseconds: no precision lost to 1.7e9-second epochs.
    const int64_t t0 = *std::min_element(stamps.begin(), stamps.end());
    for (size_t i = 0; i < trace.size(); ++i) {
      trace[i].arrival_s = static_cast<double>(stamps[i] - t0) * 1e-9;
    }
  }
  normalize_arrivals(trace);
  return trace;
}

std::vector<trace_request> load_azure_csv(const std::filesystem::path& file) {
  auto in = open_input(file);
  return parse_azure_csv(in, file.string());
}

// ---------------------------------------------------------------------------- Mooncake JSONL

namespace {

uint64_t json_count(const nlohmann::json& obj, const char* key, const std::string& source,
                    size_t line_no, bool required = true) {
  const auto it = obj.find(key);
  if (it == obj.end()) {
    if (!required) return 0;
    fail_at(source, line_no, std::string("missing \"") + key + "\"");
  }
  if (it->is_number_unsigned()) return it->get<uint64_t>();
  if (it->is_number_integer() && it->get<int64_t>() >= 0) {
    return static_cast<uint64_t>(it->get<int64_t>());
  }
  if (it->is_number_float()) {
    const double v = it->get<double>();
    if (v >= 0 && v == std::floor(v) && v < 1.8e19) return static_cast<uint64_t>(v);
  }
  fail_at(source, line_no,
          std::string("\"") + key + "\" must be a non-negative integer, got " + it->dump());
}

}  // namespace

std::vector<trace_request> parse_mooncake_jsonl(std::istream& in, const std::string& source_name) {
  std::vector<trace_request> trace;
  std::string line;
  size_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (trim(line).empty()) continue;
    nlohmann::json obj;
    try {
      obj = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      fail_at(source_name, line_no, std::string("invalid JSON: ") + e.what());
    }
    if (!obj.is_object()) fail_at(source_name, line_no, "expected a JSON object");
    const auto ts = obj.find("timestamp");
    if (ts == obj.end()) fail_at(source_name, line_no, "missing \"timestamp\"");
    if (!ts->is_number() || !std::isfinite(ts->get<double>()) || ts->get<double>() < 0) {
      fail_at(source_name, line_no,
              "\"timestamp\" must be a non-negative number of milliseconds, got " + ts->dump());
    }
    trace_request r;
    r.arrival_s = ts->get<double>() / 1000.0;
    const uint64_t input = json_count(obj, "input_length", source_name, line_no);
    const uint64_t output = json_count(obj, "output_length", source_name, line_no);
    if (input > UINT32_MAX || output > UINT32_MAX) {
      fail_at(source_name, line_no, "token count does not fit 32 bits");
    }
    r.input_tokens = static_cast<uint32_t>(input);
    r.output_tokens = static_cast<uint32_t>(output);
    if (const auto h = obj.find("hash_ids"); h != obj.end() && !h->is_null()) {
      if (!h->is_array()) fail_at(source_name, line_no, "\"hash_ids\" must be an array");
      r.prefix_hashes.reserve(h->size());
      for (const auto& id : *h) {
        if (id.is_number_unsigned()) {
          r.prefix_hashes.push_back(id.get<uint64_t>());
        } else if (id.is_number_integer() && id.get<int64_t>() >= 0) {
          r.prefix_hashes.push_back(static_cast<uint64_t>(id.get<int64_t>()));
        } else {
          fail_at(source_name, line_no,
                  "\"hash_ids\" must hold non-negative integers, got " + id.dump());
        }
      }
    }
    trace.push_back(std::move(r));
  }
  if (in.bad()) fail_at(source_name, line_no, "read error");
  normalize_arrivals(trace);
  return trace;
}

std::vector<trace_request> load_mooncake_jsonl(const std::filesystem::path& file) {
  auto in = open_input(file);
  return parse_mooncake_jsonl(in, file.string());
}

std::vector<trace_request> load_trace(const std::filesystem::path& file) {
  const std::string ext = lower(file.extension().string());
  if (ext == ".csv") return load_azure_csv(file);
  if (ext == ".jsonl" || ext == ".json") return load_mooncake_jsonl(file);
  throw trace_error(file.string() +
                    ": unknown trace format (want .csv for Azure or .jsonl for Mooncake)");
}

void write_mooncake_jsonl(std::ostream& out, std::span<const trace_request> trace) {
  for (const auto& r : trace) {
    nlohmann::json j = {{"timestamp", static_cast<uint64_t>(std::llround(r.arrival_s * 1000.0))},
                        {"input_length", r.input_tokens},
                        {"output_length", r.output_tokens},
                        {"hash_ids", r.prefix_hashes}};
    out << j.dump() << '\n';
  }
}

void save_mooncake_jsonl(const std::filesystem::path& file, std::span<const trace_request> trace) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  if (!out) throw trace_error(file.string() + ": cannot open for writing");
  write_mooncake_jsonl(out, trace);
  out.flush();
  if (!out) throw trace_error(file.string() + ": write failed");
}

// ---------------------------------------------------------------------------- synthetic

length_distribution length_distribution::fixed(uint32_t tokens) {
  length_distribution d;
  d.kind = shape::fixed;
  d.mean = tokens;
  return d;
}

length_distribution length_distribution::uniform(uint32_t lo, uint32_t hi) {
  length_distribution d;
  d.kind = shape::uniform;
  d.min = lo;
  d.max = hi;
  d.mean = (static_cast<double>(lo) + static_cast<double>(hi)) / 2.0;
  return d;
}

length_distribution length_distribution::lognormal(double mean, double cv, uint32_t lo,
                                                   uint32_t hi) {
  length_distribution d;
  d.kind = shape::lognormal;
  d.mean = mean;
  d.cv = cv;
  d.min = lo;
  d.max = hi;
  return d;
}

namespace {

/// Portable draws on top of mt19937_64 (whose output the standard fixes): the standard
/// library's distributions differ between implementations, these do not.
class portable_rng {
 public:
  explicit portable_rng(uint64_t seed) : engine_(seed) {}

  /// Uniform in [0, 1).
  double uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }
  /// Uniform in (0, 1].
  double uniform_open0() { return 1.0 - uniform(); }
  double exponential(double rate) { return -std::log(uniform_open0()) / rate; }
  double normal() {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    const double r = std::sqrt(-2.0 * std::log(uniform_open0()));
    const double theta = 2.0 * 3.14159265358979323846 * uniform();
    spare_ = r * std::sin(theta);
    have_spare_ = true;
    return r * std::cos(theta);
  }
  /// Gamma(shape k, scale 1): Marsaglia and Tsang (2000), with the k < 1 boost.
  double gamma(double k) {
    if (k < 1.0) return gamma(k + 1.0) * std::pow(uniform_open0(), 1.0 / k);
    const double d = k - 1.0 / 3.0;
    const double c = 1.0 / std::sqrt(9.0 * d);
    while (true) {
      double x, v;
      do {
        x = normal();
        v = 1.0 + c * x;
      } while (v <= 0);
      v = v * v * v;
      const double u = uniform_open0();
      if (u < 1.0 - 0.0331 * x * x * x * x) return d * v;
      if (std::log(u) < 0.5 * x * x + d * (1.0 - v + std::log(v))) return d * v;
    }
  }
  /// Uniform integer in [lo, hi].
  uint64_t uniform_int(uint64_t lo, uint64_t hi) {
    const double span = static_cast<double>(hi - lo) + 1.0;
    const auto k = static_cast<uint64_t>(uniform() * span);
    return std::min(hi, lo + k);
  }

 private:
  std::mt19937_64 engine_;
  double spare_ = 0;
  bool have_spare_ = false;
};

void check_lengths(const length_distribution& d, const char* which) {
  const std::string name = which;
  if (d.min > d.max) throw trace_error(name + " length: min > max");
  switch (d.kind) {
    case length_distribution::shape::fixed:
      if (!(d.mean >= 0) || !std::isfinite(d.mean)) {
        throw trace_error(name + " length: fixed value must be >= 0");
      }
      break;
    case length_distribution::shape::uniform:
      break;
    case length_distribution::shape::lognormal:
      if (!(d.mean > 0) || !std::isfinite(d.mean) || !(d.cv >= 0) || !std::isfinite(d.cv)) {
        throw trace_error(name + " length: lognormal needs mean > 0 and cv >= 0");
      }
      break;
  }
}

uint32_t draw_length(const length_distribution& d, portable_rng& rng) {
  double v = 0;
  switch (d.kind) {
    case length_distribution::shape::fixed:
      v = d.mean;
      break;
    case length_distribution::shape::uniform:
      return static_cast<uint32_t>(rng.uniform_int(d.min, d.max));
    case length_distribution::shape::lognormal: {
      const double sigma2 = std::log1p(d.cv * d.cv);
      const double mu = std::log(d.mean) - sigma2 / 2.0;
      v = std::exp(mu + std::sqrt(sigma2) * rng.normal());
      break;
    }
  }
  const double clamped =
      std::clamp(std::round(v), static_cast<double>(d.min), static_cast<double>(d.max));
  return static_cast<uint32_t>(clamped);
}

}  // namespace

std::vector<trace_request> generate_synthetic_trace(const synthetic_trace_params& p) {
  if (!(p.rate > 0) || !std::isfinite(p.rate))
    throw trace_error("synthetic trace: rate must be > 0");
  if (p.count == 0 && !(p.duration_s > 0)) {
    throw trace_error("synthetic trace: set a request count or a duration > 0");
  }
  if (p.process == arrival_process::gamma && (!(p.cv > 0) || !std::isfinite(p.cv))) {
    throw trace_error("synthetic trace: gamma arrivals need cv > 0");
  }
  if (p.process == arrival_process::on_off &&
      (!(p.on_s > 0) || !(p.off_s >= 0) || !std::isfinite(p.on_s) || !std::isfinite(p.off_s))) {
    throw trace_error("synthetic trace: on/off arrivals need on_s > 0 and off_s >= 0");
  }
  check_lengths(p.input, "input");
  check_lengths(p.output, "output");

  portable_rng arrivals_rng(p.seed);
  // Lengths draw from their own streams so changing the arrival process keeps the lengths.
  portable_rng input_rng(p.seed ^ 0x9E3779B97F4A7C15ull);
  portable_rng output_rng(p.seed ^ 0xC2B2AE3D27D4EB4Full);

  const double gamma_shape = 1.0 / (p.cv * p.cv);
  const double gamma_scale = 1.0 / (p.rate * gamma_shape);
  const double period = p.on_s + p.off_s;
  const double burst_rate = p.rate * period / p.on_s;

  std::vector<trace_request> trace;
  if (p.count > 0) trace.reserve(p.count);
  double clock = 0;  // poisson/gamma: real time; on_off: time spent "on"
  while (true) {
    double t = clock;
    if (p.process == arrival_process::on_off) {
      const double cycles = std::floor(clock / p.on_s);
      t = cycles * period + (clock - cycles * p.on_s);
    }
    if (p.count > 0 ? trace.size() >= p.count : t >= p.duration_s) break;
    trace_request r;
    r.arrival_s = t;
    r.input_tokens = draw_length(p.input, input_rng);
    r.output_tokens = draw_length(p.output, output_rng);
    trace.push_back(std::move(r));
    switch (p.process) {
      case arrival_process::poisson:
        clock += arrivals_rng.exponential(p.rate);
        break;
      case arrival_process::gamma:
        clock += arrivals_rng.gamma(gamma_shape) * gamma_scale;
        break;
      case arrival_process::on_off:
        clock += arrivals_rng.exponential(burst_rate);
        break;
    }
  }
  return trace;
}

// ---------------------------------------------------------------------------- transforms

std::vector<trace_request> scale_rate(std::vector<trace_request> trace, double factor) {
  if (!(factor > 0) || !std::isfinite(factor)) {
    throw trace_error("scale_rate: factor must be a finite number > 0");
  }
  for (auto& r : trace) r.arrival_s /= factor;
  return trace;
}

std::vector<trace_request> time_window(std::vector<trace_request> trace, double start_s,
                                       double duration_s) {
  if (!(duration_s >= 0)) throw trace_error("time_window: duration must be >= 0");
  const double end_s = start_s + duration_s;
  std::erase_if(trace, [&](const trace_request& r) {
    return !(r.arrival_s >= start_s && r.arrival_s < end_s);
  });
  for (auto& r : trace) r.arrival_s -= start_s;
  return trace;
}

std::vector<trace_request> limit_count(std::vector<trace_request> trace, size_t max_count) {
  if (trace.size() > max_count) trace.resize(max_count);
  return trace;
}

std::vector<trace_request> clip_to_context(std::vector<trace_request> trace, uint32_t max_context,
                                           uint32_t hash_block_tokens) {
  for (auto& r : trace) {
    const uint64_t total = static_cast<uint64_t>(r.input_tokens) + r.output_tokens;
    if (total <= max_context) continue;
    const uint32_t room_for_input =
        r.output_tokens >= max_context ? 0u : max_context - r.output_tokens;
    r.input_tokens = std::max(1u, std::min(r.input_tokens, room_for_input));
    r.output_tokens =
        std::min(r.output_tokens, max_context > r.input_tokens ? max_context - r.input_tokens : 0u);
    if (hash_block_tokens > 0) {
      const size_t blocks =
          (static_cast<size_t>(r.input_tokens) + hash_block_tokens - 1) / hash_block_tokens;
      if (r.prefix_hashes.size() > blocks) r.prefix_hashes.resize(blocks);
    }
  }
  return trace;
}

std::vector<trace_request> apply_transform(std::vector<trace_request> trace,
                                           const trace_transform& t) {
  if (t.window_start_s != 0 || std::isfinite(t.window_duration_s)) {
    trace = time_window(std::move(trace), t.window_start_s, t.window_duration_s);
  }
  if (t.rate_scale != 1.0) trace = scale_rate(std::move(trace), t.rate_scale);
  if (t.max_requests > 0) trace = limit_count(std::move(trace), t.max_requests);
  if (t.max_context > 0) trace = clip_to_context(std::move(trace), t.max_context);
  return trace;
}

// ---------------------------------------------------------------------------- statistics

trace_stats compute_trace_stats(std::span<const trace_request> trace) {
  trace_stats s;
  s.count = trace.size();
  if (trace.empty()) return s;
  std::vector<double> arrivals, inputs, outputs;
  arrivals.reserve(trace.size());
  inputs.reserve(trace.size());
  outputs.reserve(trace.size());
  for (const auto& r : trace) {
    arrivals.push_back(r.arrival_s);
    inputs.push_back(r.input_tokens);
    outputs.push_back(r.output_tokens);
    s.input_max = std::max(s.input_max, r.input_tokens);
    s.output_max = std::max(s.output_max, r.output_tokens);
  }
  std::sort(arrivals.begin(), arrivals.end());
  s.duration_s = arrivals.back() - arrivals.front();
  if (arrivals.size() > 1 && s.duration_s > 0) {
    const double n_gaps = static_cast<double>(arrivals.size() - 1);
    const double mean_gap = s.duration_s / n_gaps;
    s.mean_rate = 1.0 / mean_gap;
    double ss = 0;
    for (size_t i = 1; i < arrivals.size(); ++i) {
      const double d = (arrivals[i] - arrivals[i - 1]) - mean_gap;
      ss += d * d;
    }
    s.interarrival_cv = std::sqrt(ss / n_gaps) / mean_gap;
  }
  const auto in = summarize_samples(inputs);
  const auto out = summarize_samples(outputs);
  s.input_mean = in.mean;
  s.input_p50 = in.p50;
  s.input_p99 = in.p99;
  s.output_mean = out.mean;
  s.output_p50 = out.p50;
  s.output_p99 = out.p99;
  return s;
}

std::string format_trace_stats(const trace_stats& s) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "requests     %zu over %.1f s (%.3f req/s, inter-arrival CV %.2f)\n"
                "input len    mean %.1f, P50 %.0f, P99 %.0f, max %u\n"
                "output len   mean %.1f, P50 %.0f, P99 %.0f, max %u\n",
                s.count, s.duration_s, s.mean_rate, s.interarrival_cv, s.input_mean, s.input_p50,
                s.input_p99, s.input_max, s.output_mean, s.output_p50, s.output_p99, s.output_max);
  return buf;
}

void to_json(nlohmann::json& j, const trace_stats& s) {
  j = nlohmann::json{
      {"count", s.count},
      {"duration_s", s.duration_s},
      {"mean_rate_rps", s.mean_rate},
      {"interarrival_cv", s.interarrival_cv},
      {"input_tokens",
       {{"mean", s.input_mean}, {"p50", s.input_p50}, {"p99", s.input_p99}, {"max", s.input_max}}},
      {"output_tokens",
       {{"mean", s.output_mean},
        {"p50", s.output_p50},
        {"p99", s.output_p99},
        {"max", s.output_max}}}};
}

}  // namespace duet
