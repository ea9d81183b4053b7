#include "sim/trace_spec.hpp"

#include <charconv>
#include <cmath>
#include <limits>
#include <map>
#include <string>

namespace duet {

namespace {

[[noreturn]] void bad(std::string_view spec, const std::string& what) {
  throw trace_error("trace '" + std::string(spec) + "': " + what);
}

double to_number(std::string_view spec, const std::string& key, std::string_view text) {
  double v = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  if (r.ec != std::errc{} || r.ptr != text.data() + text.size() || !std::isfinite(v) || v < 0) {
    bad(spec, key + " must be a non-negative number, not '" + std::string(text) + "'");
  }
  return v;
}

uint32_t to_tokens(std::string_view spec, const std::string& key, std::string_view text) {
  const double v = to_number(spec, key, text);
  if (v < 1 || v > std::numeric_limits<uint32_t>::max() || v != std::floor(v)) {
    bad(spec,
        key + " must be a whole number of tokens of at least 1, not '" + std::string(text) + "'");
  }
  return static_cast<uint32_t>(v);
}

}  // namespace

synthetic_trace_params parse_synthetic_spec(std::string_view spec) {
  const std::string_view whole = spec;
  if (spec.starts_with("synthetic:")) spec.remove_prefix(10);
  const auto colon = spec.find(':');
  const std::string_view process = spec.substr(0, colon);
  synthetic_trace_params p;
  if (process == "poisson")
    p.process = arrival_process::poisson;
  else if (process == "gamma")
    p.process = arrival_process::gamma;
  else if (process == "onoff" || process == "on_off")
    p.process = arrival_process::on_off;
  else
    bad(whole,
        "the arrival process must be poisson, gamma or onoff, not '" + std::string(process) + "'");
  std::map<std::string, std::string_view> kv;
  if (colon != std::string_view::npos) {
    std::string_view rest = spec.substr(colon + 1);
    while (!rest.empty()) {
      const auto comma = rest.find(',');
      const std::string_view item = rest.substr(0, comma);
      const auto eq = item.find('=');
      if (eq == std::string_view::npos || eq == 0)
        bad(whole, "expected key=value, got '" + std::string(item) + "'");
      if (!kv.emplace(std::string(item.substr(0, eq)), item.substr(eq + 1)).second) {
        bad(whole, "key '" + std::string(item.substr(0, eq)) + "' is given twice");
      }
      if (comma == std::string_view::npos) break;
      rest = rest.substr(comma + 1);
    }
  }
  double in_mean = 512, out_mean = 128, in_cv = 0, out_cv = 0;
  uint32_t in_min = 1, out_min = 1;
  uint32_t in_max = std::numeric_limits<uint32_t>::max(),
           out_max = std::numeric_limits<uint32_t>::max();
  for (const auto& [key, value] : kv) {
    if (key == "rate")
      p.rate = to_number(whole, key, value);
    else if (key == "count")
      p.count = static_cast<size_t>(to_tokens(whole, key, value));
    else if (key == "duration")
      p.duration_s = to_number(whole, key, value);
    else if (key == "cv")
      p.cv = to_number(whole, key, value);
    else if (key == "on")
      p.on_s = to_number(whole, key, value);
    else if (key == "off")
      p.off_s = to_number(whole, key, value);
    else if (key == "seed")
      p.seed = static_cast<uint64_t>(to_number(whole, key, value));
    else if (key == "in")
      in_mean = to_tokens(whole, key, value);
    else if (key == "out")
      out_mean = to_tokens(whole, key, value);
    else if (key == "in_cv")
      in_cv = to_number(whole, key, value);
    else if (key == "out_cv")
      out_cv = to_number(whole, key, value);
    else if (key == "in_min")
      in_min = to_tokens(whole, key, value);
    else if (key == "in_max")
      in_max = to_tokens(whole, key, value);
    else if (key == "out_min")
      out_min = to_tokens(whole, key, value);
    else if (key == "out_max")
      out_max = to_tokens(whole, key, value);
    else {
      bad(whole, "unknown key '" + key +
                     "' (known: rate, count, duration, cv, on, off, in, out, in_cv, out_cv, "
                     "in_min, in_max, "
                     "out_min, out_max, seed)");
    }
  }
  if (p.count == 0 && p.duration_s <= 0) p.duration_s = 60;
  if (in_min > in_max || out_min > out_max) bad(whole, "a minimum length is above its maximum");
  auto lengths = [](double mean, double cv, uint32_t lo, uint32_t hi) {
    if (cv > 0) return length_distribution::lognormal(mean, cv, lo, hi);
    auto d = length_distribution::fixed(static_cast<uint32_t>(mean));
    d.min = lo;
    d.max = hi;
    return d;
  };
  p.input = lengths(in_mean, in_cv, in_min, in_max);
  p.output = lengths(out_mean, out_cv, out_min, out_max);
  return p;
}

std::vector<trace_request> load_trace_spec(std::string_view spec) {
  if (spec.starts_with("synthetic:")) return generate_synthetic_trace(parse_synthetic_spec(spec));
  return load_trace(std::filesystem::path(std::string(spec)));
}

}  // namespace duet
