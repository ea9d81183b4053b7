#include "runtime/latency_stats.hpp"

#include <algorithm>
#include <cassert>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace duet {

// ---------------------------------------------------------------------------- percentiles

double percentile_sorted(std::span<const double> sorted, double p, percentile_method method) {
  assert(std::is_sorted(sorted.begin(), sorted.end()));
  if (sorted.empty()) return 0;
  const size_t n = sorted.size();
  if (!(p > 0)) return sorted.front();  // also catches NaN
  if (p >= 100) return sorted.back();
  switch (method) {
    case percentile_method::linear: {
      const double h = static_cast<double>(n - 1) * p / 100.0;
      const auto lo = static_cast<size_t>(std::floor(h));
      const size_t hi = std::min(lo + 1, n - 1);
      const double frac = h - static_cast<double>(lo);
      return sorted[lo] + frac * (sorted[hi] - sorted[lo]);
    }
    case percentile_method::nearest_rank: {
      // The smallest x[k] with (k+1)/n >= p/100. The small epsilon keeps p = 90, n = 10 at
      // rank 9 despite 10 * 0.9 = 9.000000000000002 in binary floating point.
      const double rank = std::ceil(static_cast<double>(n) * p / 100.0 - 1e-9);
      const auto k = static_cast<size_t>(std::max(rank, 1.0)) - 1;
      return sorted[std::min(k, n - 1)];
    }
  }
  return 0;
}

double percentile(std::span<const double> samples, double p, percentile_method method) {
  std::vector<double> sorted;
  sorted.reserve(samples.size());
  for (double v : samples) {
    if (!std::isnan(v)) sorted.push_back(v);
  }
  std::sort(sorted.begin(), sorted.end());
  return percentile_sorted(sorted, p, method);
}

namespace {

percentile_summary summarize_sorted(std::span<const double> sorted, percentile_method method) {
  percentile_summary s;
  s.count = sorted.size();
  if (sorted.empty()) return s;
  // Kahan summation: ITL sets reach millions of samples.
  double sum = 0, carry = 0;
  for (double v : sorted) {
    const double y = v - carry;
    const double t = sum + y;
    carry = (t - sum) - y;
    sum = t;
  }
  s.mean = sum / static_cast<double>(sorted.size());
  s.min = sorted.front();
  s.max = sorted.back();
  s.p50 = percentile_sorted(sorted, 50, method);
  s.p90 = percentile_sorted(sorted, 90, method);
  s.p99 = percentile_sorted(sorted, 99, method);
  return s;
}

percentile_summary summarize_owned(std::vector<double>& samples, percentile_method method) {
  std::erase_if(samples, [](double v) { return std::isnan(v); });
  std::sort(samples.begin(), samples.end());
  return summarize_sorted(samples, method);
}

}  // namespace

percentile_summary summarize_samples(std::span<const double> samples, percentile_method method) {
  std::vector<double> copy(samples.begin(), samples.end());
  return summarize_owned(copy, method);
}

std::string_view to_string(percentile_method method) {
  switch (method) {
    case percentile_method::linear:
      return "linear";
    case percentile_method::nearest_rank:
      return "nearest_rank";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------- histogram

latency_histogram::latency_histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {
  for (size_t i = 0; i < bounds_.size(); ++i) {
    if (!std::isfinite(bounds_[i])) {
      throw std::invalid_argument("latency_histogram: bucket bound " + std::to_string(i) +
                                  " is not finite");
    }
    if (i > 0 && !(bounds_[i] > bounds_[i - 1])) {
      throw std::invalid_argument("latency_histogram: bucket bounds must be strictly ascending");
    }
  }
}

std::vector<double> latency_histogram::default_latency_buckets_s() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,  0.25,
          0.5,   1.0,    2.5,   5.0,  10.0,  25.0, 50.0, 100.0};
}

std::vector<double> latency_histogram::exponential_buckets(double start, double factor,
                                                           size_t count) {
  if (!(start > 0) || !(factor > 1)) {
    throw std::invalid_argument("exponential_buckets: need start > 0 and factor > 1");
  }
  std::vector<double> b;
  b.reserve(count);
  double v = start;
  for (size_t i = 0; i < count; ++i, v *= factor) b.push_back(v);
  return b;
}

std::vector<double> latency_histogram::linear_buckets(double start, double width, size_t count) {
  if (!(width > 0)) throw std::invalid_argument("linear_buckets: need width > 0");
  std::vector<double> b;
  b.reserve(count);
  for (size_t i = 0; i < count; ++i) b.push_back(start + width * static_cast<double>(i));
  return b;
}

void latency_histogram::observe(double value) {
  if (std::isnan(value)) {
    ++dropped_;
    return;
  }
  // First bound >= value: bounds are inclusive upper limits ("le").
  const auto it = std::lower_bound(bounds_.begin(), bounds_.end(), value);
  ++counts_[static_cast<size_t>(it - bounds_.begin())];
  ++count_;
  sum_ += value;
}

void latency_histogram::merge(const latency_histogram& other) {
  if (other.bounds_ != bounds_) {
    throw std::invalid_argument("latency_histogram::merge: bucket bounds differ");
  }
  for (size_t i = 0; i < counts_.size(); ++i) counts_[i] += other.counts_[i];
  count_ += other.count_;
  dropped_ += other.dropped_;
  sum_ += other.sum_;
}

void latency_histogram::reset() {
  std::fill(counts_.begin(), counts_.end(), 0);
  count_ = 0;
  dropped_ = 0;
  sum_ = 0;
}

std::vector<uint64_t> latency_histogram::cumulative_counts() const {
  std::vector<uint64_t> c(counts_.size());
  uint64_t run = 0;
  for (size_t i = 0; i < counts_.size(); ++i) c[i] = run += counts_[i];
  return c;
}

double latency_histogram::estimate_quantile(double q) const {
  if (count_ == 0) return 0;
  q = std::clamp(q, 0.0, 1.0);
  const double rank = q * static_cast<double>(count_);
  uint64_t below = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    const uint64_t here = counts_[i];
    if (static_cast<double>(below + here) >= rank && here > 0) {
      if (i == bounds_.size()) return bounds_.empty() ? 0 : bounds_.back();
      const double lo = i == 0 ? std::min(0.0, bounds_[0]) : bounds_[i - 1];
      const double hi = bounds_[i];
      const double frac = (rank - static_cast<double>(below)) / static_cast<double>(here);
      return lo + (hi - lo) * std::clamp(frac, 0.0, 1.0);
    }
    below += here;
  }
  return bounds_.empty() ? 0 : bounds_.back();
}

namespace {

std::string shortest(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

std::string escape_label_value(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

std::string latency_histogram::to_prometheus(
    std::string_view name, std::string_view help,
    std::span<const std::pair<std::string, std::string>> labels) const {
  std::string base_labels;
  for (const auto& [k, v] : labels) {
    base_labels += k;
    base_labels += "=\"";
    base_labels += escape_label_value(v);
    base_labels += "\",";
  }
  std::string out;
  out += "# HELP ";
  out += name;
  out += ' ';
  for (char c : help) {  // HELP escapes only backslash and newline
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  out += "\n# TYPE ";
  out += name;
  out += " histogram\n";
  const auto cumulative = cumulative_counts();
  for (size_t i = 0; i < cumulative.size(); ++i) {
    const double le = i < bounds_.size() ? bounds_[i] : std::numeric_limits<double>::infinity();
    out += name;
    out += "_bucket{";
    out += base_labels;
    out += "le=\"" + shortest(le) + "\"} " + std::to_string(cumulative[i]) + "\n";
  }
  std::string plain_labels;
  if (!base_labels.empty()) {
    plain_labels = "{" + base_labels.substr(0, base_labels.size() - 1) + "}";
  }
  out += std::string(name) + "_sum" + plain_labels + " " + shortest(sum_) + "\n";
  out += std::string(name) + "_count" + plain_labels + " " + std::to_string(count_) + "\n";
  return out;
}

// ---------------------------------------------------------------------------- records

std::optional<double> request_record::ttft_s() const {
  if (!first_token_s) return std::nullopt;
  return *first_token_s - arrival_s;
}

std::optional<double> request_record::tpot_s() const {
  if (!first_token_s || output_tokens <= 1) return std::nullopt;
  return (finish_s - *first_token_s) / static_cast<double>(output_tokens - 1);
}

std::vector<double> request_record::token_times_s() const {
  std::vector<double> t;
  if (!first_token_s) return t;
  t.reserve(itl_s.size() + 1);
  double now = *first_token_s;
  t.push_back(now);
  for (double gap : itl_s) t.push_back(now += gap);
  return t;
}

bool latency_slo::limits_anything() const {
  return std::isfinite(ttft_s) || std::isfinite(tpot_s);
}

bool meets_slo(const request_record& record, const latency_slo& slo) {
  if (!record.succeeded()) return false;
  const double ttft = record.ttft_s().value_or(record.e2e_s());
  if (!(ttft <= slo.ttft_s)) return false;
  if (const auto tpot = record.tpot_s(); tpot && !(*tpot <= slo.tpot_s)) return false;
  return true;
}

namespace {

latency_summary summarize_impl(std::span<const request_record> records, const latency_slo& slo,
                               std::optional<double> duration_s, percentile_method method) {
  latency_summary s;
  s.requests = records.size();
  s.slo = slo;
  s.method = method;
  std::vector<double> ttft, tpot, itl, second, e2e;
  ttft.reserve(records.size());
  tpot.reserve(records.size());
  e2e.reserve(records.size());
  size_t gaps = 0;
  for (const auto& r : records) {
    if (r.succeeded()) gaps += r.itl_s.size();
  }
  itl.reserve(gaps);

  double first_arrival = std::numeric_limits<double>::infinity();
  double last_finish = -std::numeric_limits<double>::infinity();
  for (const auto& r : records) {
    first_arrival = std::min(first_arrival, r.arrival_s);
    last_finish = std::max(last_finish, r.finish_s);
    ++s.outcomes[r.outcome];
    if (!r.succeeded()) {
      ++s.failed;
      continue;
    }
    ++s.completed;
    s.input_tokens += r.prompt_tokens;
    s.output_tokens += r.output_tokens;
    e2e.push_back(r.e2e_s());
    if (const auto t = r.ttft_s()) ttft.push_back(*t);
    if (const auto t = r.tpot_s()) tpot.push_back(*t);
    itl.insert(itl.end(), r.itl_s.begin(), r.itl_s.end());
    if (!r.itl_s.empty()) second.push_back(r.itl_s.front());
    if (meets_slo(r, slo)) ++s.good;
  }
  if (duration_s) {
    s.duration_s = *duration_s;
  } else if (!records.empty()) {
    s.duration_s = std::max(0.0, last_finish - first_arrival);
  }
  if (s.duration_s > 0) {
    s.request_throughput = static_cast<double>(s.completed) / s.duration_s;
    s.output_token_throughput = static_cast<double>(s.output_tokens) / s.duration_s;
    s.total_token_throughput = static_cast<double>(s.input_tokens + s.output_tokens) / s.duration_s;
    s.goodput = static_cast<double>(s.good) / s.duration_s;
  }
  if (s.requests > 0) {
    s.slo_attainment = static_cast<double>(s.good) / static_cast<double>(s.requests);
  }
  s.ttft_s = summarize_owned(ttft, method);
  s.tpot_s = summarize_owned(tpot, method);
  s.itl_s = summarize_owned(itl, method);
  s.second_token_s = summarize_owned(second, method);
  s.e2e_s = summarize_owned(e2e, method);
  return s;
}

}  // namespace

latency_summary summarize(std::span<const request_record> records, const latency_slo& slo,
                          percentile_method method) {
  return summarize_impl(records, slo, std::nullopt, method);
}

latency_summary summarize(std::span<const request_record> records, const latency_slo& slo,
                          double duration_s, percentile_method method) {
  return summarize_impl(records, slo, duration_s, method);
}

// ---------------------------------------------------------------------------- tables

namespace {

std::string printf_string(const char* fmt, auto... args) {
  char buf[256];
  const int n = std::snprintf(buf, sizeof buf, fmt, args...);
  if (n < 0) return {};
  return std::string(buf, static_cast<size_t>(std::min<int>(n, sizeof buf - 1)));
}

/// Milliseconds with 3-4 significant digits: 0.123, 12.35, 1234.5.
std::string format_ms(double seconds) {
  const double ms = seconds * 1000.0;
  if (!std::isfinite(ms)) return ms > 0 ? "inf" : "-";
  const double a = std::abs(ms);
  if (a < 1) return printf_string("%.3f", ms);
  if (a < 100) return printf_string("%.2f", ms);
  return printf_string("%.1f", ms);
}

std::string pad_left(std::string s, size_t width) {
  if (s.size() < width) s.insert(0, width - s.size(), ' ');
  return s;
}

std::string pad_right(std::string s, size_t width) {
  if (s.size() < width) s.append(width - s.size(), ' ');
  return s;
}

std::string slo_phrase(const latency_slo& slo) {
  std::string p;
  if (std::isfinite(slo.ttft_s)) p += "TTFT <= " + format_ms(slo.ttft_s) + " ms";
  if (std::isfinite(slo.tpot_s)) {
    if (!p.empty()) p += " and ";
    p += "TPOT <= " + format_ms(slo.tpot_s) + " ms";
  }
  return p.empty() ? "no SLO" : p;
}

std::string failures_phrase(const latency_summary& s) {
  std::string p;
  for (const auto& [outcome, n] : s.outcomes) {
    if (outcome == request_outcome_ok) continue;
    if (!p.empty()) p += ", ";
    p += outcome + " " + std::to_string(n);
  }
  return p;
}

}  // namespace

std::string format_summary_table(const latency_summary& s, std::string_view title) {
  std::string out;
  if (!title.empty()) {
    out += title;
    out += '\n';
    out += std::string(std::min<size_t>(title.size(), 78), '=');
    out += '\n';
  }
  out += printf_string("requests    %zu completed, %zu failed in %.2f s\n", s.completed, s.failed,
                       s.duration_s);
  if (s.failed > 0) out += "failures    " + failures_phrase(s) + "\n";
  out += printf_string("throughput  %.2f req/s, %.1f output tok/s, %.1f total tok/s\n",
                       s.request_throughput, s.output_token_throughput, s.total_token_throughput);
  out += "SLO         " + slo_phrase(s.slo) + "\n";
  out += printf_string("goodput     %.2f req/s (%.1f%% of requests meet the SLO)\n", s.goodput,
                       100.0 * s.slo_attainment);
  out += '\n';
  constexpr size_t name_w = 10, col_w = 10;
  out += pad_right("(ms)", name_w);
  for (const char* h : {"mean", "P50", "P90", "P99", "max", "count"}) out += pad_left(h, col_w);
  out += '\n';
  const std::pair<const char*, const percentile_summary*> rows[] = {
      {"TTFT", &s.ttft_s}, {"TPOT", &s.tpot_s}, {"ITL", &s.itl_s}, {"2nd token", &s.second_token_s},
      {"E2E", &s.e2e_s}};
  for (const auto& [name, p] : rows) {
    out += pad_right(name, name_w);
    if (p->count == 0) {
      for (int i = 0; i < 5; ++i) out += pad_left("-", col_w);
    } else {
      for (double v : {p->mean, p->p50, p->p90, p->p99, p->max}) {
        out += pad_left(format_ms(v), col_w);
      }
    }
    out += pad_left(std::to_string(p->count), col_w);
    out += '\n';
  }
  return out;
}

std::string format_comparison_table(std::span<const std::pair<std::string, latency_summary>> runs) {
  constexpr size_t name_w = 24, min_col_w = 12;
  std::vector<size_t> widths;
  for (const auto& [name, s] : runs) widths.push_back(std::max(min_col_w, name.size() + 2));
  std::string out = pad_right("", name_w);
  for (size_t i = 0; i < runs.size(); ++i) out += pad_left(runs[i].first, widths[i]);
  out += '\n';
  auto row = [&](const char* label, auto&& cell) {
    out += pad_right(label, name_w);
    for (size_t i = 0; i < runs.size(); ++i) out += pad_left(cell(runs[i].second), widths[i]);
    out += '\n';
  };
  row("completed / requests", [](const latency_summary& s) {
    return std::to_string(s.completed) + "/" + std::to_string(s.requests);
  });
  row("duration (s)", [](const latency_summary& s) { return printf_string("%.2f", s.duration_s); });
  row("throughput (req/s)",
      [](const latency_summary& s) { return printf_string("%.3f", s.request_throughput); });
  row("output tok/s",
      [](const latency_summary& s) { return printf_string("%.1f", s.output_token_throughput); });
  row("goodput (req/s)", [](const latency_summary& s) { return printf_string("%.3f", s.goodput); });
  row("SLO attainment (%)",
      [](const latency_summary& s) { return printf_string("%.1f", 100.0 * s.slo_attainment); });
  const std::pair<const char*, percentile_summary latency_summary::*> metrics[] = {
      {"TTFT", &latency_summary::ttft_s},
      {"TPOT", &latency_summary::tpot_s},
      {"ITL", &latency_summary::itl_s},
      {"2nd token", &latency_summary::second_token_s},
      {"E2E", &latency_summary::e2e_s}};
  for (const auto& [metric, member] : metrics) {
    const std::pair<const char*, double percentile_summary::*> stats[] = {
        {"P50", &percentile_summary::p50},
        {"P90", &percentile_summary::p90},
        {"P99", &percentile_summary::p99}};
    for (const auto& [stat, field] : stats) {
      const std::string label = std::string(metric) + " " + stat + " (ms)";
      row(label.c_str(), [&](const latency_summary& s) {
        const percentile_summary& p = s.*member;
        return p.count == 0 ? std::string("-") : format_ms(p.*field);
      });
    }
  }
  return out;
}

// ---------------------------------------------------------------------------- json

namespace {

nlohmann::json limit_to_json(double v) {
  return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
}

double limit_from_json(const nlohmann::json& j) {
  return j.is_null() ? std::numeric_limits<double>::infinity() : j.get<double>();
}

}  // namespace

void to_json(nlohmann::json& j, const percentile_summary& s) {
  j = nlohmann::json{{"count", s.count}, {"mean", s.mean}, {"min", s.min}, {"p50", s.p50},
                     {"p90", s.p90},     {"p99", s.p99},   {"max", s.max}};
}

void from_json(const nlohmann::json& j, percentile_summary& s) {
  j.at("count").get_to(s.count);
  j.at("mean").get_to(s.mean);
  j.at("min").get_to(s.min);
  j.at("p50").get_to(s.p50);
  j.at("p90").get_to(s.p90);
  j.at("p99").get_to(s.p99);
  j.at("max").get_to(s.max);
}

void to_json(nlohmann::json& j, const latency_summary& s) {
  j = nlohmann::json::object();
  j["requests"] = s.requests;
  j["completed"] = s.completed;
  j["failed"] = s.failed;
  j["outcomes"] = s.outcomes;
  j["duration_s"] = s.duration_s;
  j["input_tokens"] = s.input_tokens;
  j["output_tokens"] = s.output_tokens;
  j["request_throughput_rps"] = s.request_throughput;
  j["output_token_throughput_tps"] = s.output_token_throughput;
  j["total_token_throughput_tps"] = s.total_token_throughput;
  j["slo"] = {{"ttft_s", limit_to_json(s.slo.ttft_s)}, {"tpot_s", limit_to_json(s.slo.tpot_s)}};
  j["good_requests"] = s.good;
  j["goodput_rps"] = s.goodput;
  j["slo_attainment"] = s.slo_attainment;
  j["percentile_method"] = to_string(s.method);
  j["ttft_s"] = s.ttft_s;
  j["tpot_s"] = s.tpot_s;
  j["itl_s"] = s.itl_s;
  j["second_token_s"] = s.second_token_s;
  j["e2e_s"] = s.e2e_s;
}

nlohmann::json to_json(const latency_summary& summary) {
  nlohmann::json j;
  to_json(j, summary);
  return j;
}

void from_json(const nlohmann::json& j, latency_summary& s) {
  j.at("requests").get_to(s.requests);
  j.at("completed").get_to(s.completed);
  j.at("failed").get_to(s.failed);
  s.outcomes = j.at("outcomes").get<std::map<std::string, size_t>>();
  j.at("duration_s").get_to(s.duration_s);
  j.at("input_tokens").get_to(s.input_tokens);
  j.at("output_tokens").get_to(s.output_tokens);
  j.at("request_throughput_rps").get_to(s.request_throughput);
  j.at("output_token_throughput_tps").get_to(s.output_token_throughput);
  j.at("total_token_throughput_tps").get_to(s.total_token_throughput);
  s.slo.ttft_s = limit_from_json(j.at("slo").at("ttft_s"));
  s.slo.tpot_s = limit_from_json(j.at("slo").at("tpot_s"));
  j.at("good_requests").get_to(s.good);
  j.at("goodput_rps").get_to(s.goodput);
  j.at("slo_attainment").get_to(s.slo_attainment);
  const auto method = j.at("percentile_method").get<std::string>();
  if (method == "linear") {
    s.method = percentile_method::linear;
  } else if (method == "nearest_rank") {
    s.method = percentile_method::nearest_rank;
  } else {
    throw nlohmann::json::other_error::create(501, "unknown percentile_method \"" + method + "\"",
                                              &j);
  }
  j.at("ttft_s").get_to(s.ttft_s);
  j.at("tpot_s").get_to(s.tpot_s);
  j.at("itl_s").get_to(s.itl_s);
  if (j.contains("second_token_s")) j.at("second_token_s").get_to(s.second_token_s);  // since 2026-12-05
  j.at("e2e_s").get_to(s.e2e_s);
}

}  // namespace duet
