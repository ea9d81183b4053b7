#include "runtime/gpu_catalog.hpp"

#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>

#ifndef DUET_CONFIG_DIR
#define DUET_CONFIG_DIR ""
#endif

namespace duet {

namespace {

std::string where(const std::filesystem::path& file, const toml::node* node, std::string_view key) {
  std::string out = file.string();
  if (node && node->source().begin.line > 0) out += ":" + std::to_string(node->source().begin.line);
  out += ": ";
  if (!key.empty()) out += "key '" + std::string(key) + "': ";
  return out;
}

[[noreturn]] void fail(const std::filesystem::path& file, const toml::node* node,
                       std::string_view key, const std::string& what) {
  throw gpu_catalog_error(where(file, node, key) + what);
}

toml::table parse_file(const std::filesystem::path& file) {
  try {
    return toml::parse_file(file.string());
  } catch (const toml::parse_error& e) {
    const auto& pos = e.source().begin;
    throw gpu_catalog_error(file.string() + ":" + std::to_string(pos.line) + ":" +
                            std::to_string(pos.column) +
                            ": syntax error: " + std::string(e.description()));
  }
}

/// A number (integer or float) that is finite and, when `positive`, above zero.
double number(const std::filesystem::path& file, const toml::node& node, std::string_view key,
              bool positive) {
  std::optional<double> v;
  if (auto f = node.as_floating_point())
    v = f->get();
  else if (auto i = node.as_integer())
    v = static_cast<double>(i->get());
  if (!v || !std::isfinite(*v)) fail(file, &node, key, "must be a finite number");
  if (positive ? *v <= 0 : *v < 0)
    fail(file, &node, key, positive ? "must be above 0" : "must not be negative");
  return *v;
}

double fraction(const std::filesystem::path& file, const toml::node& node, std::string_view key) {
  const double v = number(file, node, key, true);
  if (v > 1.0) fail(file, &node, key, "is a fraction of peak: must be in (0, 1]");
  return v;
}

/// Points (shape, value) with ascending shapes: fractions of a peak in (0, 1], or, with
/// `factors`, any positive multipliers.
efficiency_curve curve(const std::filesystem::path& file, const toml::node& node,
                       std::string_view key, bool factors = false) {
  const char* value_name = factors ? "factor" : "fraction";
  const auto* array = node.as_array();
  if (!array || array->empty())
    fail(file, &node, key,
         std::string("must be a non-empty array of [shape, ") + value_name + "] pairs");
  efficiency_curve out;
  for (const auto& item : *array) {
    const auto* pair = item.as_array();
    if (!pair || pair->size() != 2)
      fail(file, &item, key, std::string("each entry must be a [shape, ") + value_name + "] pair");
    const double shape = number(file, *pair->get(0), key, true);
    const double f =
        factors ? number(file, *pair->get(1), key, true) : fraction(file, *pair->get(1), key);
    if (!out.points.empty() && shape <= out.points.back().first) {
      fail(file, &item, key, "shapes must be strictly ascending");
    }
    out.points.emplace_back(shape, f);
  }
  return out;
}

gpu_calibration calibration_from(const toml::table& root, const std::filesystem::path& file,
                                 std::string_view expected_gpu) {
  static const std::set<std::string, std::less<>> keys = {
      "gpu", "measured", "source", "step_overhead_s", "decode_sequence_overhead_s",
      "gemm", "attention", "memory", "prefill_memory", "prefill_gemm_row_tile", "prefill_roofline_exponent", "split_bandwidth", "split_kv_bandwidth", "split_compute",
      "split_decode_slowdown", "split_prefill_slowdown", "concurrent_decode_slowdown",
      "concurrent_prefill_slowdown", "concurrent_decode_delay_s", "concurrent_decode_tile_keys",
      "concurrent_decode_delay_by_overlap", "concurrent_overlap_on_prefill_start", "concurrent_prefill_yield", "concurrent_prefill_attention_yield",
      "concurrent_prefill_yield_scale", "concurrent_decode_delay_scale", "concurrent_decode_slowdown_scale",
      "concurrent_decode_delay_batch_scale", "reserve_decode_delay_scale", "reserve_decode_delay_batch_scale", "reserve_prefill_yield_scale",
      "reserve_prefill_yield_batch_scale", "reserve_prefill_attention_yield",
      "shared_prefill_delay_s", "shared_decode_lag_s", "front_end_s", "front_end_token_s", "sm_shares"};
  gpu_calibration cal;
  cal.source = file.string();
  for (const auto& [k, v] : root) {
    if (!keys.contains(k.str())) {
      std::string known;
      for (const auto& key : keys) known += (known.empty() ? "" : ", ") + key;
      fail(file, &v, k.str(), "unknown key (known: " + known + ")");
    }
  }
  if (const auto* gpu = root.get("gpu")) {
    const auto* text = gpu->as_string();
    if (!text) fail(file, gpu, "gpu", "must be a string");
    if (!expected_gpu.empty() && text->get() != expected_gpu) {
      fail(file, gpu, "gpu",
           "names '" + text->get() + "' but calibrates '" + std::string(expected_gpu) + "'");
    }
  }
  for (const char* text_key : {"measured", "source"}) {
    if (const auto* n = root.get(text_key); n && !n->is_string())
      fail(file, n, text_key, "must be a string");
  }
  if (const auto* n = root.get("step_overhead_s"))
    cal.step_overhead_s = number(file, *n, "step_overhead_s", false);
  if (const auto* n = root.get("gemm")) cal.gemm = curve(file, *n, "gemm");
  if (const auto* n = root.get("attention")) cal.attention = curve(file, *n, "attention");
  if (const auto* n = root.get("memory")) cal.memory = curve(file, *n, "memory");
  if (const auto* n = root.get("decode_sequence_overhead_s"))
    cal.decode_sequence_overhead_s = number(file, *n, "decode_sequence_overhead_s", false);
  for (auto [key, slot] : {std::pair{"concurrent_decode_slowdown", &cal.concurrent_decode_slowdown},
                           std::pair{"concurrent_prefill_slowdown", &cal.concurrent_prefill_slowdown},
                           std::pair{"split_decode_slowdown", &cal.split_decode_slowdown}}) {
    if (const auto* n = root.get(key)) {
      *slot = number(file, *n, key, false);
      if (**slot < 1.0) fail(file, n, key, "a slowdown is at least 1");
    }
  }
  if (const auto* n = root.get("concurrent_decode_delay_s"))
    cal.concurrent_decode_delay_s = number(file, *n, "concurrent_decode_delay_s", false);
  if (const auto* n = root.get("concurrent_decode_tile_keys"))
    cal.concurrent_decode_tile_keys = number(file, *n, "concurrent_decode_tile_keys", true);
  if (const auto* n = root.get("concurrent_decode_delay_by_overlap")) {
    const auto* flag = n->as_boolean();
    if (!flag) fail(file, n, "concurrent_decode_delay_by_overlap", "must be true or false");
    cal.concurrent_decode_delay_by_overlap = flag->get();
  }
  if (const auto* n = root.get("sm_shares")) {
    const auto* text = n->as_string();
    if (!text || (text->get() != "partition" && text->get() != "nominal"))
      fail(file, n, "sm_shares", "must be \"partition\" or \"nominal\"");
    cal.nominal_sm_shares = text->get() == "nominal";
  }
  if (const auto* n = root.get("concurrent_overlap_on_prefill_start")) {
    const auto* flag = n->as_boolean();
    if (!flag) fail(file, n, "concurrent_overlap_on_prefill_start", "must be true or false");
    cal.concurrent_overlap_on_prefill_start = flag->get();
  }
  if (const auto* n = root.get("concurrent_prefill_yield"))
    cal.concurrent_prefill_yield = fraction(file, *n, "concurrent_prefill_yield");
  if (const auto* n = root.get("concurrent_prefill_attention_yield"))
    cal.concurrent_prefill_attention_yield =
        fraction(file, *n, "concurrent_prefill_attention_yield");
  if (const auto* n = root.get("reserve_prefill_attention_yield"))
    cal.reserve_prefill_attention_yield = fraction(file, *n, "reserve_prefill_attention_yield");
  for (auto [key, slot] :
       {std::pair{"concurrent_prefill_yield_scale", &cal.concurrent_prefill_yield_scale},
        std::pair{"concurrent_decode_delay_scale", &cal.concurrent_decode_delay_scale},
        std::pair{"concurrent_decode_slowdown_scale", &cal.concurrent_decode_slowdown_scale},
        std::pair{"concurrent_decode_delay_batch_scale", &cal.concurrent_decode_delay_batch_scale},
        std::pair{"reserve_decode_delay_batch_scale", &cal.reserve_decode_delay_batch_scale},
        std::pair{"reserve_prefill_yield_batch_scale", &cal.reserve_prefill_yield_batch_scale},
        std::pair{"shared_decode_lag_s", &cal.shared_decode_lag_s}}) {
    if (const auto* n = root.get(key)) *slot = curve(file, *n, key, true);
  }
  for (auto [key, slot] : {std::pair{"reserve_decode_delay_scale", &cal.reserve_decode_delay_scale},
                           std::pair{"reserve_prefill_yield_scale", &cal.reserve_prefill_yield_scale}}) {
    if (const auto* n = root.get(key)) {
      *slot = curve(file, *n, key, true);
      for (const auto& [reserved, factor] : slot->points) {
        if (reserved > 1.0) fail(file, n, key, "SM fractions must be at most 1");
      }
    }
  }
  if (const auto* n = root.get("split_prefill_slowdown")) {
    cal.split_prefill_slowdown = curve(file, *n, "split_prefill_slowdown", true);
    for (const auto& [share, factor] : cal.split_prefill_slowdown.points) {
      if (share > 1.0) fail(file, n, "split_prefill_slowdown", "SM shares must be at most 1");
      if (factor < 1.0) fail(file, n, "split_prefill_slowdown", "a slowdown is at least 1");
    }
  }
  if (const auto* n = root.get("prefill_memory")) cal.prefill_memory = fraction(file, *n, "prefill_memory");
  if (const auto* n = root.get("prefill_gemm_row_tile")) {
    const auto rows = n->as_integer();
    if (!rows || rows->get() < 1 || rows->get() > 4096)
      fail(file, n, "prefill_gemm_row_tile", "must be a whole number of rows from 1 to 4096");
    cal.prefill_gemm_row_tile = static_cast<uint32_t>(rows->get());
  }
  if (const auto* n = root.get("prefill_roofline_exponent")) {
    const double p = number(file, *n, "prefill_roofline_exponent", false);
    if (p < 1.0 || p > 64.0) fail(file, n, "prefill_roofline_exponent", "must be from 1 (the sum) to 64");
    cal.prefill_roofline_exponent = p;
  }
  if (const auto* n = root.get("shared_prefill_delay_s"))
    cal.shared_prefill_delay_s = number(file, *n, "shared_prefill_delay_s", false);
  if (const auto* n = root.get("front_end_s")) cal.front_end_s = number(file, *n, "front_end_s", false);
  if (const auto* n = root.get("front_end_token_s"))
    cal.front_end_token_s = number(file, *n, "front_end_token_s", false);
  for (auto [key, slot] : {std::pair{"split_bandwidth", &cal.split_bandwidth},
                           std::pair{"split_kv_bandwidth", &cal.split_kv_bandwidth},
                           std::pair{"split_compute", &cal.split_compute}}) {
    if (const auto* n = root.get(key)) {
      // split_compute is a factor on the whole GPU's fractions: a share may use its SMs better.
      *slot = curve(file, *n, key, std::string_view(key) == "split_compute");
      for (const auto& [share, fraction] : slot->points) {
        if (share > 1.0) fail(file, n, key, "SM shares must be at most 1");
      }
    }
  }
  return cal;
}

gpu_spec spec_from(const std::string& name, const toml::table& table,
                   const std::filesystem::path& file) {
  gpu_spec s;
  s.name = name;
  struct field {
    const char* key;
    double* target;
    enum { positive, non_negative, efficiency } rule;
    bool required;
  };
  double sms = 0, partition_min = 0, partition_step = 0;
  const field fields[] = {
      {"bf16_flops", &s.bf16_flops, field::positive, true},
      {"memory_bandwidth", &s.memory_bandwidth, field::positive, true},
      {"memory_bytes", &s.memory_bytes, field::positive, true},
      {"sms", &sms, field::positive, true},
      {"gemm_efficiency", &s.gemm_efficiency, field::efficiency, false},
      {"bandwidth_efficiency", &s.bandwidth_efficiency, field::efficiency, false},
      {"step_overhead_s", &s.step_overhead_s, field::non_negative, false},
      {"nvlink_bandwidth", &s.nvlink_bandwidth, field::non_negative, false},
      {"pcie_bandwidth", &s.pcie_bandwidth, field::non_negative, false},
      {"nic_bandwidth", &s.nic_bandwidth, field::non_negative, false},
      {"link_efficiency", &s.link_efficiency, field::efficiency, false},
      {"sm_partition_min", &partition_min, field::non_negative, false},
      {"sm_partition_step", &partition_step, field::non_negative, false},
  };
  const std::string prefix = "gpus." + name + ".";
  for (const auto& [k, v] : table) {
    const bool known = k.str() == "calibration" || k.str() == "description" ||
                       std::any_of(std::begin(fields), std::end(fields),
                                   [&](const field& f) { return k.str() == f.key; });
    if (!known) fail(file, &v, prefix + std::string(k.str()), "unknown key");
  }
  for (const auto& f : fields) {
    const auto* node = table.get(f.key);
    if (!node) {
      if (f.required) fail(file, &table, prefix + f.key, "is required");
      continue;
    }
    *f.target = f.rule == field::efficiency
                    ? fraction(file, *node, prefix + f.key)
                    : number(file, *node, prefix + f.key, f.rule == field::positive);
  }
  if (sms != std::floor(sms))
    fail(file, table.get("sms"), prefix + "sms", "must be a whole number");
  s.sms = static_cast<uint32_t>(sms);
  for (const auto& [key, value] : {std::pair{"sm_partition_min", partition_min},
                                   std::pair{"sm_partition_step", partition_step}}) {
    if (value != std::floor(value) || value > sms)
      fail(file, table.get(key), prefix + key, "must be a whole number of SMs, at most sms");
  }
  s.sm_partition_min = static_cast<uint32_t>(partition_min);
  s.sm_partition_step = static_cast<uint32_t>(partition_step);
  if (const auto* d = table.get("description"); d && !d->is_string()) {
    fail(file, d, prefix + "description", "must be a string");
  }
  std::filesystem::path cal_file;
  if (const auto* c = table.get("calibration")) {
    const auto* text = c->as_string();
    if (!text || text->get().empty()) fail(file, c, prefix + "calibration", "must be a file name");
    cal_file = file.parent_path() / text->get();
    if (!std::filesystem::exists(cal_file)) {
      fail(file, c, prefix + "calibration", "file " + cal_file.string() + " does not exist");
    }
  } else {
    const auto beside = file.parent_path() / "calibration" / (name + ".toml");
    if (std::filesystem::exists(beside)) cal_file = beside;
  }
  if (!cal_file.empty()) s.calibration = calibration_from(parse_file(cal_file), cal_file, name);
  return s;
}

struct cache_entry {
  std::filesystem::file_time_type mtime;
  std::vector<gpu_spec> specs;
};

}  // namespace

std::vector<gpu_spec> load_gpu_specs(const std::filesystem::path& file) {
  const toml::table root = parse_file(file);
  std::vector<gpu_spec> out;
  for (const auto& [k, v] : root) {
    if (k.str() != "gpus") fail(file, &v, k.str(), "unknown table (GPU specs go in [gpus.NAME])");
  }
  const auto* gpus = root.get("gpus");
  if (!gpus) return out;
  const auto* table = gpus->as_table();
  if (!table) fail(file, gpus, "gpus", "must be a table of [gpus.NAME] tables");
  for (const auto& [name, node] : *table) {
    const auto* spec = node.as_table();
    if (!spec) fail(file, &node, "gpus." + std::string(name.str()), "must be a table");
    out.push_back(spec_from(std::string(name.str()), *spec, file));
  }
  return out;
}

gpu_calibration load_gpu_calibration(const std::filesystem::path& file) {
  return calibration_from(parse_file(file), file, {});
}

std::filesystem::path gpu_spec_file() {
  if (const char* env = std::getenv("DUET_GPU_SPECS"); env && *env) {
    if (!std::filesystem::exists(env)) {
      throw gpu_catalog_error(std::string(env) +
                              ": DUET_GPU_SPECS names a file that does not exist");
    }
    return env;
  }
  std::error_code ec;
  const std::filesystem::path local = "config/gpus.toml";
  if (std::filesystem::exists(local, ec)) return local;
  const std::string built_from = DUET_CONFIG_DIR;
  if (!built_from.empty()) {
    const auto tree = std::filesystem::path(built_from) / "gpus.toml";
    if (std::filesystem::exists(tree, ec)) return tree;
  }
  return {};
}

std::optional<gpu_spec> find_gpu_spec_in_file(std::string_view name) {
  const auto file = gpu_spec_file();
  if (file.empty()) return std::nullopt;
  static std::mutex mutex;
  static std::map<std::filesystem::path, cache_entry> cache;
  std::error_code ec;
  const auto mtime = std::filesystem::last_write_time(file, ec);
  std::lock_guard lock(mutex);
  auto it = cache.find(file);
  if (it == cache.end() || it->second.mtime != mtime) {
    auto specs = load_gpu_specs(file);
    it = cache.insert_or_assign(file, cache_entry{mtime, std::move(specs)}).first;
  }
  for (const auto& s : it->second.specs) {
    if (s.name == name) return s;
  }
  return std::nullopt;
}

std::vector<std::string> known_gpu_names() {
  std::vector<std::string> out = {"a100", "h100", "h20", "h200", "l40s"};
  if (const auto file = gpu_spec_file(); !file.empty()) {
    for (const auto& s : load_gpu_specs(file)) out.push_back(s.name);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace duet
