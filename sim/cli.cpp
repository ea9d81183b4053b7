#include "sim/cli.hpp"

#include <toml++/toml.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "runtime/clock.hpp"
#include "runtime/config.hpp"
#include "runtime/decode_core.hpp"
#include "runtime/engine_bench.hpp"
#include "runtime/gpu_catalog.hpp"
#include "runtime/hop_stats.hpp"
#include "runtime/decode_buckets.hpp"
#include "runtime/sim_engine.hpp"
#include "runtime/http_frontend.hpp"
#include "sim/deployment_spec.hpp"
#include "sim/event_sim.hpp"
#include "sim/http_replay.hpp"
#include "sim/live_replay.hpp"
#include "sim/planner.hpp"
#include "sim/report.hpp"
#include "sim/trace_spec.hpp"

namespace duet {

latency_slo parse_slo(std::string_view text) {
  latency_slo slo;
  std::string_view rest = text;
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    const auto eq = item.find('=');
    if (eq == std::string_view::npos)
      throw std::invalid_argument("SLO '" + std::string(item) + "': expected ttft=... or tpot=...");
    const std::string_view key = item.substr(0, eq);
    std::string_view value = item.substr(eq + 1);
    double factor = 1;
    if (value.ends_with("ms"))
      factor = 1e-3, value.remove_suffix(2);
    else if (value.ends_with("us"))
      factor = 1e-6, value.remove_suffix(2);
    else if (value.ends_with("s"))
      value.remove_suffix(1);
    double v = 0;
    const auto r = std::from_chars(value.data(), value.data() + value.size(), v);
    if (r.ec != std::errc{} || r.ptr != value.data() + value.size() || !(v > 0) ||
        !std::isfinite(v)) {
      throw std::invalid_argument("SLO '" + std::string(item) +
                                  "': the limit must be a positive time such as 2s or 50ms");
    }
    if (key == "ttft")
      slo.ttft_s = v * factor;
    else if (key == "tpot")
      slo.tpot_s = v * factor;
    else
      throw std::invalid_argument("SLO '" + std::string(item) + "': the keys are ttft and tpot");
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return slo;
}

struct sim_commands::state {
  CLI::App* sim = nullptr;
  CLI::App* plan = nullptr;
  // both
  std::string config_path, trace, out, gpu, slo, calibration, link;
  double rate_scale = 1.0, start_s = 0.0, duration_s = 0.0, hop_us = 50.0;
  // sim
  size_t max_requests = 0;
  std::vector<std::string> deployments;
  std::string title;
  double speed_spread = 0.0;
  // plan
  uint32_t gpus = 8;
  uint32_t jobs = 0;
  size_t requests = 1000;
  double attainment = 0.9;
  std::string shares = "0.3,0.4,0.5,0.6,0.7";
  std::string reserve_shares = "0.7,0.85";
  uint32_t top = 6;
  // bench serve
  CLI::App* bench = nullptr;
  CLI::App* serve = nullptr;
  std::string url, router, run_name = "live", model, api_key;
  std::vector<std::string> sim_deployments;
  double time_limit_s = 0, wait_s = 60, temperature = 0;
  uint32_t prompt_vocab = 30000, max_context = 0;
  // bench engine
  CLI::App* engine_bench = nullptr;
  std::string engine_kind = "cpu", dtype = "bf16", json_out;
  uint32_t threads = 0, chunk_tokens = 2048;
  int device = 0;
  double sm_share = 1.0;
  std::vector<std::string> prefill_mixes;
  engine_bench_options rows;
};

namespace {

bool terminal() {
  return isatty(STDERR_FILENO) == 1;
}

std::string fmt(const char* format, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, format, args...);
  return buf;
}

/// The trace the command asked for: loaded, windowed, rate-scaled, limited, clipped.
std::vector<trace_request> prepared_trace(const sim_commands::state& s,
                                          const deployment_config& config, size_t max_requests) {
  auto trace = load_trace_spec(s.trace);
  trace_transform t;
  t.window_start_s = s.start_s;
  if (s.duration_s > 0) t.window_duration_s = s.duration_s;
  t.rate_scale = s.rate_scale;
  t.max_requests = max_requests;
  t.max_context = config.model.max_context;
  trace = apply_transform(std::move(trace), t);
  if (trace.empty()) throw trace_error("trace '" + s.trace + "': no request in the chosen window");
  return trace;
}

std::string trace_line(const sim_commands::state& s, std::span<const trace_request> trace) {
  const auto stats = compute_trace_stats(trace);
  const std::string name = s.trace.starts_with("synthetic:")
                               ? s.trace
                               : std::filesystem::path(s.trace).filename().string();
  return fmt(
      "trace %s: %zu requests over %.0f s (%.2f req/s, rate x%g), prompt mean %.0f, output mean "
      "%.0f tokens",
      name.c_str(), stats.count, stats.duration_s, stats.mean_rate, s.rate_scale, stats.input_mean,
      stats.output_mean);
}

sim_options options_from(const sim_commands::state& s, const std::string& default_gpu) {
  sim_options o;
  o.hop_s = s.hop_us * 1e-6;
  if (!s.calibration.empty()) {
    const auto root = toml::parse_file(s.calibration);
    const std::string gpu = root["gpu"].value<std::string>().value_or(default_gpu);
    o.calibrations[gpu] = load_gpu_calibration(s.calibration);
  }
  return o;
}

nlohmann::json run_json(const sim_result& r, const std::string& description) {
  nlohmann::json j;
  j["name"] = r.name;
  j["deployment"] = description;
  j["gpus"] = r.gpus;
  j["workers"] = r.worker_lines;
  j["events"] = r.events;
  j["simulated_s"] = r.simulated_s;
  j["wall_s"] = r.wall_s;
  j["cpu_s"] = r.cpu_s;
  j["events_per_cpu_s"] = r.cpu_s > 0 ? double(r.events) / r.cpu_s : 0.0;
  j["counters"] = r.counters;
  const auto steps = r.counters.contains("decode.steps") ? r.counters.at("decode.steps") : 0;
  const auto batched = r.counters.contains("decode.batched_sequences")
                           ? r.counters.at("decode.batched_sequences")
                           : 0;
  j["mean_decode_batch"] = steps > 0 ? double(batched) / double(steps) : 0.0;
  auto counter = [&](const char* name) -> uint64_t {
    const auto it = r.counters.find(name);
    return it == r.counters.end() ? 0 : it->second;
  };
  j["peak_decode_batch"] = counter("sim.peak_decode_batch");
  // on_demand KV: sequences that gave their blocks up, and the KV positions rebuilt for them.
  j["preemptions"] = counter("decode.preemptions");
  j["recomputed_tokens"] = counter("decode.recomputed_tokens");
  return j;
}

/// Adds `extra` under `key` to the summary.json write_report wrote.
void annotate_summary(const report_files& files, const char* key, nlohmann::json extra) {
  nlohmann::json summary;
  {
    std::ifstream in(files.summary_json);
    summary = nlohmann::json::parse(in);
  }
  summary[key] = std::move(extra);
  std::ofstream out(files.summary_json, std::ios::trunc);
  out << summary.dump(2) << '\n';
  if (!out) throw report_error("cannot write " + files.summary_json.string());
}

/// The deployment simulated with every GPU's engine `1 - spread` and `1 + spread` times as fast:
/// TTFT, ITL and goodput of each, printed and returned for summary.json.
nlohmann::json speed_band(const deployment_config& config, const sim_deployment& d, const std::vector<trace_request>& trace,
                          const sim_options& base, const latency_slo& slo, double spread) {
  nlohmann::json band;
  band["spread"] = spread;
  for (const auto& [label, factor] : {std::pair{"slower", 1.0 - spread}, {"faster", 1.0 + spread}}) {
    sim_options o = base;
    o.progress = nullptr;
    for (const auto& g : d.gpus) {
      const auto spec = find_gpu_spec(g.type);
      if (!spec) continue;
      const auto known = base.calibrations.find(g.type);
      o.calibrations[g.type] =
          with_engine_speed(known != base.calibrations.end() ? known->second : spec->calibration, *spec, factor);
    }
    auto result = run_simulation(config, d, trace, o);
    const auto summary = make_report_run(result.name, std::move(result.records), slo).summary;
    band[label] = {{"ttft_p50_s", summary.ttft_s.p50}, {"ttft_p99_s", summary.ttft_s.p99},
                   {"itl_p50_s", summary.itl_s.p50},   {"itl_p99_s", summary.itl_s.p99},
                   {"goodput", summary.goodput}};
  }
  const auto& slow = band["slower"];
  const auto& fast = band["faster"];
  std::printf("%-24s engine %.0f %% faster / slower: TTFT P50 %.1f / %.1f ms, P99 %.1f / %.1f ms; ITL P50 %.2f / %.2f ms, "
              "P99 %.2f / %.2f ms; goodput %.2f / %.2f req/s\n",
              "", spread * 100, fast["ttft_p50_s"].get<double>() * 1e3, slow["ttft_p50_s"].get<double>() * 1e3,
              fast["ttft_p99_s"].get<double>() * 1e3, slow["ttft_p99_s"].get<double>() * 1e3,
              fast["itl_p50_s"].get<double>() * 1e3, slow["itl_p50_s"].get<double>() * 1e3,
              fast["itl_p99_s"].get<double>() * 1e3, slow["itl_p99_s"].get<double>() * 1e3,
              fast["goodput"].get<double>(), slow["goodput"].get<double>());
  return band;
}

int run_sim(const sim_commands::state& s) {
  const auto config = s.config_path.empty() ? default_config() : load_config(s.config_path);
  const auto trace = prepared_trace(s, config, s.max_requests);
  const std::string gpu = s.gpu.empty() ? config.engine.gpu : s.gpu;
  std::vector<sim_deployment> deployments;
  if (s.deployments.empty()) deployments.push_back(deployment_from_config(config));
  for (const auto& spec : s.deployments)
    deployments.push_back(parse_deployment_spec(spec, config, gpu));
  if (!s.link.empty()) {
    const auto link = link_kind_from_string(s.link);
    if (!link) throw std::invalid_argument("--link must be same, nvlink, pcie or network");
    for (auto& d : deployments) d.link = link;
  }
  std::set<std::string> names;
  for (auto& d : deployments) {
    std::string name = d.name;
    for (int i = 2; names.contains(name); ++i) name = d.name + " #" + std::to_string(i);
    d.name = name;
    names.insert(name);
  }
  const latency_slo slo = s.slo.empty() ? latency_slo{} : parse_slo(s.slo);
  sim_options options = options_from(s, gpu);
  const bool tty = terminal();
  std::vector<report_run> runs;
  nlohmann::json sim_json;
  sim_json["trace"] = s.trace;
  sim_json["trace_stats"] = compute_trace_stats(trace);
  sim_json["rate_scale"] = s.rate_scale;
  sim_json["model"] = config.model.preset;
  sim_json["hop_s"] = options.hop_s;
  sim_json["runs"] = nlohmann::json::array();
  std::printf("%s\n", trace_line(s, trace).c_str());
  for (const auto& d : deployments) {
    if (tty) {
      options.progress = [&](const sim_progress& p) {
        std::fprintf(stderr, "\r  %-24s %8.0f s simulated  %zu / %zu requests  %.1fM events ",
                     d.name.c_str(), p.virtual_s, p.finished, p.requests, double(p.events) / 1e6);
      };
    }
    auto result = run_simulation(config, d, trace, options);
    if (tty) std::fprintf(stderr, "\r%*s\r", 100, "");
    std::printf("%-24s %s\n", d.name.c_str(), describe(d).c_str());
    const auto steps = result.counters["decode.steps"];
    const double batch =
        steps > 0 ? double(result.counters["decode.batched_sequences"]) / steps : 0.0;
    std::printf(
        "%-24s %llu events in %.2f s CPU (%.2f s wall): %.2fM events/s; %.0f s simulated; "
        "mean decode batch %.1f (peak %llu); %llu preemptions\n",
        "", static_cast<unsigned long long>(result.events), result.cpu_s, result.wall_s,
        result.cpu_s > 0 ? double(result.events) / result.cpu_s / 1e6 : 0.0, result.simulated_s,
        batch, static_cast<unsigned long long>(result.counters["sim.peak_decode_batch"]),
        static_cast<unsigned long long>(result.counters["decode.preemptions"]));
    sim_json["runs"].push_back(run_json(result, describe(d)));
    if (s.speed_spread > 0) sim_json["runs"].back()["speed_band"] = speed_band(config, d, trace, options, slo, s.speed_spread);
    runs.push_back(
        make_report_run(result.name, std::move(result.records), slo, std::move(result.series)));
  }
  std::printf("\n");
  if (runs.size() == 1) {
    std::printf("%s", format_summary_table(runs[0].summary, runs[0].name).c_str());
  } else {
    std::vector<std::pair<std::string, latency_summary>> table;
    for (const auto& r : runs) table.emplace_back(r.name, r.summary);
    std::printf("%s", format_comparison_table(table).c_str());
  }
  report_options ro;
  ro.title = s.title.empty() ? "duet sim: " + config.model.preset : s.title;
  ro.subtitle = trace_line(s, trace) + fmt("; hop %.0f us", s.hop_us);
  const auto files = write_report(s.out, runs, ro);
  annotate_summary(files, "simulation", std::move(sim_json));
  std::printf("\nwrote %s, %s, %s\n", files.summary_json.c_str(), files.requests_csv.c_str(),
              files.report_html.c_str());
  return 0;
}

/// A comma-separated list of SM shares, each strictly between 0 and 1 ("" or "none": no share).
std::vector<double> parse_shares(const std::string& flag, std::string_view text) {
  std::vector<double> shares;
  if (text == "none") return shares;
  for (std::string_view rest = text; !rest.empty();) {
    const auto comma = rest.find(',');
    const std::string_view part = rest.substr(0, comma);
    double share = 0;
    const auto r = std::from_chars(part.data(), part.data() + part.size(), share);
    if (r.ec != std::errc{} || r.ptr != part.data() + part.size() || !(share > 0 && share < 1)) {
      throw std::invalid_argument(flag + ": '" + std::string(part) +
                                  "' is not a share between 0 and 1 (exclusive)");
    }
    shares.push_back(share);
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return shares;
}

int run_plan(const sim_commands::state& s) {
  const auto config = s.config_path.empty() ? default_config() : load_config(s.config_path);
  const auto trace = prepared_trace(s, config, s.requests);
  plan_options po;
  po.gpu = s.gpu.empty() ? std::string("h20") : s.gpu;
  if (!find_gpu_spec(po.gpu)) throw std::invalid_argument("unknown GPU '" + po.gpu + "'");
  po.gpu_budget = s.gpus;
  po.slo = parse_slo(s.slo);
  po.attainment = s.attainment;
  po.sm_shares = parse_shares("--sm-shares", s.shares);
  po.reserve_shares = parse_shares("--reserve-shares", s.reserve_shares);
  po.jobs = s.jobs > 0 ? s.jobs : std::max(1u, std::thread::hardware_concurrency());
  po.sim = options_from(s, po.gpu);
  const bool tty = terminal();
  if (tty) {
    po.progress = [](size_t done, size_t total, const std::string& name) {
      std::fprintf(stderr, "\r  searched %zu / %zu deployments (last: %s)      ", done, total,
                   name.c_str());
    };
  }
  std::printf("%s\n", trace_line(s, trace).c_str());
  const double trace_rate =
      trace.size() > 1
          ? double(trace.size() - 1) / (trace.back().arrival_s - trace.front().arrival_s)
          : 0.0;
  auto ranked = plan_deployments(config, trace, po);
  if (tty) std::fprintf(stderr, "\r%*s\r", 100, "");
  std::printf("%s", format_plan_table(ranked, po, trace_rate).c_str());
  // The report: the best few, plus the best colocated and SM-split ones for comparison.
  std::vector<report_run> runs;
  nlohmann::json plan_json = nlohmann::json::array();
  bool colocated_shown = false, split_shown = false;
  for (size_t i = 0; i < ranked.size(); ++i) {
    auto& e = ranked[i];
    const bool colocated = e.deployment.name == "colocated";
    const bool split = e.deployment.name.starts_with("split");
    plan_json.push_back({{"rank", i + 1},
                         {"deployment", e.deployment.name},
                         {"gpus", e.gpus},
                         {"rate_scale", e.rate_scale},
                         {"goodput", e.goodput},
                         {"goodput_per_gpu", e.goodput_per_gpu},
                         {"replicas", e.replicas},
                         {"total_goodput", e.goodput * e.replicas},
                         {"attainment", e.attainment},
                         {"simulations", e.simulations}});
    const bool show = i < s.top || (colocated && !colocated_shown) || (split && !split_shown);
    if (!show || e.run.records.empty()) continue;
    colocated_shown = colocated_shown || colocated;
    split_shown = split_shown || split;
    const std::string name = fmt("%s @ %.2f req/s", e.deployment.name.c_str(),
                                 e.rate_scale > 0 ? e.goodput : trace_rate / 64);
    runs.push_back(
        make_report_run(name, std::move(e.run.records), po.slo, std::move(e.run.series)));
  }
  report_options ro;
  ro.title = fmt("duet plan: %s on up to %u x %s", config.model.preset.c_str(), po.gpu_budget,
                 po.gpu.c_str());
  ro.subtitle = trace_line(s, trace) + "; each run at its highest rate meeting the SLO";
  const auto files = write_report(s.out, runs, ro);
  nlohmann::json extra;
  extra["trace"] = s.trace;
  extra["gpu"] = po.gpu;
  extra["gpu_budget"] = po.gpu_budget;
  extra["attainment_target"] = po.attainment;
  extra["plan"] = std::move(plan_json);
  annotate_summary(files, "simulation", std::move(extra));
  std::printf("\nwrote %s, %s, %s\n", files.summary_json.c_str(), files.requests_csv.c_str(),
              files.report_html.c_str());
  return 0;
}

/// Where `bench serve` sends its requests.
struct serve_target {
  bool http = false;
  http_target web;
  std::string endpoint, router;  // ZeroMQ
  std::string label;
};

serve_target resolve_target(const sim_commands::state& s, const deployment_config* config) {
  serve_target t;
  if (s.url.starts_with("http://") || s.url.starts_with("https://")) {
    t.http = true;
    t.web = parse_http_url(s.url);
    t.label = s.url;
    return t;
  }
  if (!s.url.empty() && !s.url.starts_with("ipc://") && !s.url.starts_with("tcp://"))
    throw std::invalid_argument("--url '" + s.url + "': give http://HOST:PORT, ipc://PATH or tcp://HOST:PORT");
  t.endpoint = s.url;
  t.router = s.router;
  if (config && (t.endpoint.empty() || t.router.empty())) {
    const auto loc = find_router(*config);
    if (t.endpoint.empty()) t.endpoint = loc.endpoint;
    if (t.router.empty()) t.router = loc.address;
  }
  if (t.endpoint.empty()) throw std::invalid_argument("give --url (http:// or a ZeroMQ endpoint) or --config");
  if (t.router.empty()) throw std::invalid_argument("--url " + t.endpoint + " is a ZeroMQ endpoint: give --router NODE/ACTOR or --config");
  if (t.endpoint.starts_with("inproc://"))
    throw std::invalid_argument(t.endpoint + " is in-process only; the deployment needs ipc:// or tcp:// endpoints");
  t.label = t.endpoint + " (" + t.router + ")";
  return t;
}

/// The GPU `duet bench engine --engine sim` prices: --gpu, else the one its calibration file names.
std::string priced_gpu(const sim_commands::state& s) {
  std::string named;
  if (!s.calibration.empty()) named = toml::parse_file(s.calibration)["gpu"].value<std::string>().value_or("");
  if (!s.gpu.empty() && !named.empty() && named != s.gpu)
    throw std::invalid_argument("--gpu " + s.gpu + " but " + s.calibration + " calibrates " + named);
  const std::string gpu = s.gpu.empty() ? named : s.gpu;
  if (gpu.empty()) throw std::invalid_argument("--engine sim needs --gpu or a --calibration file naming its gpu");
  return gpu;
}

/// `duet bench engine --engine sim`: the simulator's cost model prices the rows (the sim engine's
/// modelled step times), for the model preset of --model on the GPU of --gpu or of the
/// calibration file, with that file's curves.
std::unique_ptr<engine> bench_sim_engine(const sim_commands::state& s, uint32_t max_context, uint32_t max_batch) {
  const auto shape = find_model_shape(s.model);
  if (!shape) {
    throw std::invalid_argument("--engine sim prices a model preset, not '" + s.model +
                                "' (r1-distill-llama-8b, r1-distill-qwen-1.5b, r1-distill-qwen-7b, smollm2-135m, tiny)");
  }
  const std::string gpu = priced_gpu(s);
  auto spec = find_gpu_spec(gpu);
  if (!spec) throw std::invalid_argument("unknown GPU '" + gpu + "'");
  if (!s.calibration.empty()) spec->calibration = load_gpu_calibration(s.calibration);
  auto e = std::make_unique<sim_engine>(*shape, *spec, shape->name, max_context, deployment_config{}.model.block_tokens,
                                        s.sm_share, 1.0);
  e->set_decode_graph_buckets(decode_graph_buckets(max_batch, decode_bucket_step_from_env()));
  return e;
}

/// The engine `duet bench engine` measures: the model at --model on one actor sized for every row.
std::unique_ptr<engine> bench_engine_for(const sim_commands::state& s) {
  deployment_config config;
  config.source = "duet bench engine";
  config.model.path = s.model;
  config.model.name = std::filesystem::path(s.model).filename().string();
  config.model.dtype = s.dtype;
  uint32_t longest = 0;
  for (uint32_t t : s.rows.prefill_tokens) longest = std::max(longest, t);
  for (const auto& mix : s.rows.prefill_mixes) {
    for (const auto& p : mix.parts) longest = std::max(longest, p.prior + p.tokens);
  }
  for (uint32_t c : s.rows.contexts) longest = std::max(longest, c + s.rows.warmup + s.rows.steps + 1);
  config.model.max_context = std::max<uint32_t>(longest, 16);
  uint32_t max_batch = 1;
  for (uint32_t b : s.rows.batches) max_batch = std::max(max_batch, b);
  if (s.engine_kind == "sim") return bench_sim_engine(s, config.model.max_context, max_batch);
  config.engine.kind = s.engine_kind;
  config.engine.threads = s.threads;
  actor_config actor;
  actor.name = "bench";
  actor.role = actor_role::decode;
  actor.device = s.device;
  actor.kv_blocks = engine_bench_blocks(s.rows, config.model.block_tokens);
  actor.max_batch = max_batch;
  actor.chunk_tokens = s.chunk_tokens;
  actor.sm_share = s.sm_share;
  return make_engine(config, actor);
}

/// With --prefill-mix, the rows' defaults step aside: only the rows given run.
void apply_prefill_mixes(sim_commands::state& s) {
  for (const auto& text : s.prefill_mixes) s.rows.prefill_mixes.push_back(parse_prefill_mix(text));
  if (s.prefill_mixes.empty()) return;
  if (s.engine_bench->count("--prefill") == 0) s.rows.prefill_tokens.clear();
  if (s.engine_bench->count("--batch") == 0 && s.engine_bench->count("--context") == 0) s.rows.batches.clear();
}

int run_bench_engine(sim_commands::state& s) {
  apply_prefill_mixes(s);
  if (s.sm_share < 1.0 && s.engine_kind == "cpu") {
    throw std::invalid_argument("--sm-share needs --engine cuda (a green context holding that share of the SMs) or sim");
  }
  const bool modelled = s.engine_kind == "sim";
  if (!modelled && (!s.gpu.empty() || !s.calibration.empty()))
    throw std::invalid_argument("--gpu and --calibration price rows with --engine sim; the " + s.engine_kind + " engine is timed");
  if (s.rows.prefill_tokens.empty() && s.rows.prefill_mixes.empty() &&
      (s.rows.batches.empty() || s.rows.contexts.empty())) {
    throw std::invalid_argument("nothing to measure: give --prefill and/or --batch with --context");
  }
  if (!modelled && !std::filesystem::exists(s.model)) throw std::invalid_argument("no model at '" + s.model + "'");
  const bool tty = terminal();
  if (tty) std::fprintf(stderr, "loading %s on the %s engine...\n", s.model.c_str(), s.engine_kind.c_str());
  auto engine = bench_engine_for(s);
  const auto progress = [tty](const std::string& line) {
    if (tty) std::fprintf(stderr, "  %s...\n", line.c_str());
  };
  const auto rows = run_engine_bench(*engine, s.rows, progress);
  std::printf("%s engine, %s: %u prefill repeats, %u decode steps per row (median, p10-p90 of each call)\n",
              s.engine_kind.c_str(), s.model.c_str(), s.rows.prefill_repeats, s.rows.steps);
  std::printf("%-11s %6s %8s %12s %22s %14s\n", "", "batch", "tokens", "ms", "p10 - p90 ms", "tokens/s");
  nlohmann::json out = nlohmann::json::array();
  bool agree = true;
  for (const auto& r : rows) {
    std::string flag;
    if (!r.sequences_agree) {
      flag = "  (sequences disagree: " + r.disagreement + ")";
    } else if (r.near_tie_divergences > 0 && r.kind == "prefill_mix") {
      flag = "  (" + std::to_string(r.near_tie_divergences) + " of " + std::to_string(r.batch) +
             " chunks chose another near-tie than their whole prompt)";
    } else if (r.near_tie_divergences > 0) {
      flag = "  (" + std::to_string(r.near_tie_divergences) + " of " + std::to_string(r.batch) +
             " left sequence 0's tokens on near-ties from step " + std::to_string(r.first_divergence_step) + ")";
    }
    if (!r.mix.empty()) flag = "  " + r.mix + flag;
    std::printf("%-11s %6u %8u %12.3f %10.3f - %9.3f %14.1f%s\n", r.kind.c_str(), r.batch, r.tokens, r.ms_median,
                r.ms_p10, r.ms_p90, r.tokens_per_s, flag.c_str());
    agree = agree && r.sequences_agree;
    out.push_back(to_json(r));
  }
  if (!s.json_out.empty()) {
    std::ofstream f(s.json_out);
    nlohmann::json top{{"engine", s.engine_kind}, {"model", s.model}, {"sm_share", s.sm_share}, {"rows", out}};
    if (modelled) {
      top["gpu"] = priced_gpu(s);
      top["calibration"] = s.calibration;
    }
    f << top.dump(2) << "\n";
    if (!f) throw std::runtime_error("cannot write " + s.json_out);
  }
  if (!agree) {
    std::fprintf(stderr, "duet bench engine: identical sequences decoded differently in one batch\n");
    return 1;
  }
  return 0;
}

/// Every actor's counters summed per role, named as the simulator names them
/// ("router.hop_ttft_us"). Empty when some actor does not answer within the timeout.
std::map<std::string, uint64_t> deployment_counters(const deployment_config& config) {
  const auto router = find_router(config);
  std::vector<std::string> actors;
  std::map<std::string, std::string> role_of;
  for (const auto& n : config.nodes) {
    for (const auto& a : n.actors) {
      actors.push_back(n.name + "/" + a.name);
      role_of[actors.back()] = std::string(to_string(a.role));
    }
  }
  client c(router.endpoint, router.address);
  const auto replies = c.stats(actors, std::chrono::milliseconds(3000));
  std::map<std::string, uint64_t> out;
  if (replies.size() != actors.size()) return out;
  for (const auto& r : replies) {
    for (const auto& [k, v] : r.counters) out[role_of[r.actor] + "." + k] += v;
  }
  return out;
}

/// The hop counters of `after` less those of `before`: one replay's share of a deployment
/// that served requests (a warm-up, an earlier run) before it.
std::map<std::string, uint64_t> hop_delta(const std::map<std::string, uint64_t>& before,
                                          const std::map<std::string, uint64_t>& after) {
  std::map<std::string, uint64_t> out;
  for (const auto& [k, v] : after) {
    static const std::set<std::string> per_step = {"prefill.tokens", "prefill.steps", "decode.steps",
                                                   "decode.batched_sequences"};
    const bool batch_bucket = k.starts_with("decode." + std::string(decode_batch_counter_prefix));
    if (k.find(".hop_") == std::string::npos && !per_step.contains(k) && !batch_bucket) continue;
    const auto b = before.find(k);
    out[k] = v - (b == before.end() ? 0 : std::min(b->second, v));
  }
  return out;
}

/// Decode step batch sizes at the 50th, 90th and 99th percentile of steps and the largest, from
/// the per-step histogram counters (each the upper bound of its bucket: 16 wide up to 256).
std::map<std::string, double> decode_batch_quantiles(const std::map<std::string, uint64_t>& counters) {
  const std::string prefix = "decode." + std::string(decode_batch_counter_prefix);
  std::map<uint64_t, uint64_t> steps_by_bound;
  uint64_t total = 0;
  for (auto it = counters.lower_bound(prefix); it != counters.end() && it->first.starts_with(prefix); ++it) {
    steps_by_bound[std::stoull(it->first.substr(prefix.size()))] += it->second;
    total += it->second;
  }
  std::map<std::string, double> out;
  if (total == 0) return out;
  for (const auto& [name, q] : {std::pair{"decode.batch_p50", 0.5}, {"decode.batch_p90", 0.9}, {"decode.batch_p99", 0.99}}) {
    uint64_t seen = 0;
    for (const auto& [bound, steps] : steps_by_bound) {
      seen += steps;
      if (static_cast<double>(seen) >= q * static_cast<double>(total)) {
        out[name] = static_cast<double>(bound);
        break;
      }
    }
  }
  for (const auto& [bound, steps] : steps_by_bound) {
    if (steps > 0) out["decode.batch_max"] = static_cast<double>(bound);
  }
  return out;
}

/// The TTFT hop means of one run (ms; -1 where not recorded), and what the client saw
/// beyond the router's own submit-to-first-token: HTTP or ZeroMQ, the front end, the client.
nlohmann::json ttft_hops_json(const std::map<std::string, uint64_t>& counters, double client_ttft_mean_ms) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& hop : ttft_hops()) j[hop.counter] = hop_mean_ms(counters, hop.counter);
  const double router_ms = hop_mean_ms(counters, "router.hop_ttft");
  const auto steps = counters.find("prefill.steps");
  const auto tokens = counters.find("prefill.tokens");
  j["prefill.tokens_per_step"] = steps == counters.end() || steps->second == 0 || tokens == counters.end()
                                     ? 0.0
                                     : double(tokens->second) / double(steps->second);
  const auto dsteps = counters.find("decode.steps");
  const auto batched = counters.find("decode.batched_sequences");
  j["decode.mean_batch"] = dsteps == counters.end() || dsteps->second == 0 || batched == counters.end()
                               ? 0.0
                               : double(batched->second) / double(dsteps->second);
  for (const auto& [key, value] : decode_batch_quantiles(counters)) j[key] = value;
  const auto n = counters.find("router.hop_ttft_count");
  j["requests"] = n == counters.end() ? 0 : n->second;
  j["client_ttft"] = client_ttft_mean_ms;
  j["outside_router"] = router_ms < 0 ? -1.0 : client_ttft_mean_ms - router_ms;
  return j;
}

/// Over HTTP: the requests whose first token came without text (its text held back by the
/// front end until a later token completed it), and the mean wait from the first token to the
/// first text over all completed requests, in ms (-1 when no request has both times).
std::pair<uint64_t, double> first_text_hold(const std::vector<request_record>& records) {
  uint64_t held = 0, n = 0;
  double sum_s = 0;
  for (const auto& r : records) {
    if (!r.succeeded() || !r.first_token_s || !r.first_text_s) continue;
    const double wait = std::max(0.0, *r.first_text_s - *r.first_token_s);
    ++n;
    sum_s += wait;
    if (wait > 0) ++held;
  }
  return {held, n == 0 ? -1.0 : sum_s / double(n) * 1e3};
}

/// Live and simulated TTFT means hop by hop, so a miss is found where it happens.
std::string format_hop_table(const nlohmann::json& live, const std::vector<std::pair<std::string, nlohmann::json>>& sims) {
  std::string out = "\nTTFT by hop, mean ms (live";
  for (const auto& [name, j] : sims) out += " / " + name;
  out += "):\n";
  auto row = [&](const std::string& key, const std::string& what) {
    char line[160];
    std::snprintf(line, sizeof line, "  %-62s %9.1f", what.c_str(), live.value(key, -1.0));
    out += line;
    for (const auto& [name, j] : sims) {
      std::snprintf(line, sizeof line, " / %9.1f", j.value(key, -1.0));
      out += line;
    }
    out += "\n";
  };
  for (const auto& hop : ttft_hops()) row(hop.counter, hop.what);
  row("prefill.tokens_per_step", "prefill: tokens per step");
  row("decode.mean_batch", "decode: sequences per step");
  if (live.contains("decode.batch_p99")) {
    row("decode.batch_p90", "decode: sequences per step, P90 (at most)");
    row("decode.batch_p99", "decode: sequences per step, P99 (at most)");
    row("decode.batch_max", "decode: sequences per step, largest (at most)");
  }
  row("outside_router", "client: beyond the router (front end, sockets, client)");
  row("client_ttft", "client: TTFT");
  if (live.contains("client_first_text_held")) {
    row("client_first_text_held", "client: requests whose first token came without text");
    row("client_first_text_wait", "client: first token to first text (mean, all requests)");
  }
  return out;
}

int run_bench_serve(const sim_commands::state& s) {
  std::optional<deployment_config> loaded;
  if (!s.config_path.empty()) loaded = load_config(s.config_path);
  auto config = loaded ? *loaded : default_config();
  if (s.max_context > 0) config.model.max_context = s.max_context;
  const auto target = resolve_target(s, loaded ? &*loaded : nullptr);
  const auto trace = prepared_trace(s, config, s.max_requests);
  const latency_slo slo = s.slo.empty() ? latency_slo{} : parse_slo(s.slo);
  const auto stats = compute_trace_stats(trace);
  const double limit_s = s.time_limit_s > 0 ? s.time_limit_s : stats.duration_s + 300.0;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(limit_s * 1e3));
  const auto wait = std::chrono::milliseconds(static_cast<int64_t>(s.wait_s * 1e3));
  const bool tty = terminal();
  std::printf("%s\n", trace_line(s, trace).c_str());
  std::printf("target %s; every request ends within %.0f s of the start\n", target.label.c_str(), limit_s);
  std::fflush(stdout);

  std::vector<request_record> records;
  // The deployment's hop counters around the replay (with --config): TTFT by hop.
  std::map<std::string, uint64_t> counters_before;
  const auto snapshot = [&] {
    try {
      return loaded ? deployment_counters(*loaded) : std::map<std::string, uint64_t>{};
    } catch (const std::exception& e) {
      std::fprintf(stderr, "duet bench serve: no deployment counters: %s\n", e.what());
      return std::map<std::string, uint64_t>{};
    }
  };
  const double t0 = std::chrono::duration<double>(steady::now().time_since_epoch()).count();
  if (target.http) {
    raise_fd_limit();
    http_replay_options o;
    const std::string served = wait_for_http_model(target.web, s.api_key, wait);
    o.model = s.model.empty() ? served : s.model;
    counters_before = snapshot();
    o.api_key = s.api_key;
    o.temperature = s.temperature;
    o.prompt_vocab = s.prompt_vocab;
    o.timeout = timeout;
    if (tty) {
      o.progress = [](size_t sent, size_t done, size_t total) {
        std::fprintf(stderr, "\r  sent %zu / %zu, finished %zu   ", sent, total, done);
      };
    }
    records = replay_http(target.web, trace, o);
  } else {
    client c(target.endpoint, target.router);
    if (!wait_ready(c, target.router, wait))
      throw std::runtime_error("the router " + target.router + " at " + target.endpoint +
                               " reported no ready prefill and decode workers within " +
                               std::to_string(wait.count() / 1000) + " s");
    counters_before = snapshot();
    live_replay_options o;
    o.timeout = timeout;
    o.prompt_vocab = s.prompt_vocab;
    if (tty) {
      o.progress = [](size_t done, size_t total) {
        std::fprintf(stderr, "\r  finished %zu / %zu   ", done, total);
      };
    }
    records = replay_live(c, trace, o);
  }
  const double wall_s = std::chrono::duration<double>(steady::now().time_since_epoch()).count() - t0;
  if (tty) std::fprintf(stderr, "\r%*s\r", 60, "");
  const auto counters_after = snapshot();

  const auto [text_held, text_wait_ms] = first_text_hold(records);
  std::vector<report_run> runs;
  runs.push_back(make_report_run(s.run_name, std::move(records), slo));
  nlohmann::json bench_json;
  bench_json["target"] = target.label;
  bench_json["protocol"] = target.http ? "http" : "zmq";
  bench_json["trace"] = s.trace;
  bench_json["trace_stats"] = stats;
  bench_json["rate_scale"] = s.rate_scale;
  bench_json["wall_s"] = wall_s;
  bench_json["time_limit_s"] = limit_s;
  bench_json["simulated"] = nlohmann::json::array();
  const auto ms = [](const report_run& r) { return r.summary.ttft_s.mean * 1e3; };
  if (!counters_after.empty()) {
    bench_json["ttft_hops"] = ttft_hops_json(hop_delta(counters_before, counters_after), ms(runs[0]));
    if (target.http) {
      bench_json["ttft_hops"]["client_first_text_held"] = text_held;
      bench_json["ttft_hops"]["client_first_text_wait"] = text_wait_ms;
    }
  }
  std::vector<std::pair<std::string, nlohmann::json>> sim_hops;
  // The simulator on the same trace, for the side-by-side report (fidelity, issue 9).
  if (!s.sim_deployments.empty()) {
    const std::string gpu = s.gpu.empty() ? config.engine.gpu : s.gpu;
    sim_options options = options_from(s, gpu);
    for (const auto& spec : s.sim_deployments) {
      auto d = spec == "config" ? deployment_from_config(config) : parse_deployment_spec(spec, config, gpu);
      d.name = "sim " + d.name;
      auto result = run_simulation(config, d, trace, options);
      bench_json["simulated"].push_back(run_json(result, describe(d)));
      runs.push_back(make_report_run(d.name, std::move(result.records), slo, std::move(result.series)));
      sim_hops.emplace_back(d.name, ttft_hops_json(result.counters, ms(runs.back())));
      bench_json["simulated"].back()["ttft_hops"] = sim_hops.back().second;
    }
  }
  if (runs.size() == 1) {
    std::printf("%s", format_summary_table(runs[0].summary, runs[0].name).c_str());
  } else {
    std::vector<std::pair<std::string, latency_summary>> table;
    for (const auto& r : runs) table.emplace_back(r.name, r.summary);
    std::printf("%s", format_comparison_table(table).c_str());
  }
  if (bench_json.contains("ttft_hops")) std::printf("%s", format_hop_table(bench_json["ttft_hops"], sim_hops).c_str());
  report_options ro;
  ro.title = s.title.empty() ? "duet bench serve: " + s.run_name : s.title;
  ro.subtitle = trace_line(s, trace) + "; target " + target.label;
  const auto files = write_report(s.out, runs, ro);
  annotate_summary(files, "bench", std::move(bench_json));
  std::printf("\nwrote %s, %s, %s\n", files.summary_json.c_str(), files.requests_csv.c_str(),
              files.report_html.c_str());
  const auto& live = runs[0].summary;
  return live.completed > 0 ? 0 : 1;
}

}  // namespace

sim_commands::sim_commands(CLI::App& app) : state_(std::make_unique<state>()) {
  auto& s = *state_;
  s.sim = app.add_subcommand(
      "sim", "replay a trace through the real policies on a virtual clock; write a report");
  s.sim->add_option("--config", s.config_path,
                    "deployment TOML file (model, router, broker; its actors unless --deployment)");
  s.sim
      ->add_option("--trace", s.trace,
                   "trace: Azure .csv, Mooncake .jsonl, or synthetic:PROCESS:key=value,...")
      ->required();
  s.sim->add_option("--out", s.out, "report directory (summary.json, requests.csv, report.html)")
      ->required();
  s.sim->add_option(
      "--deployment", s.deployments,
      "colocated[:gpus=N], split[:sm=F], XPYD[:p=GPU,d=GPU] ...; repeat to compare side by side");
  s.sim->add_option("--gpu", s.gpu,
                    "GPU type of spec deployments (default: the config's engine.gpu)");
  s.sim->add_option("--rate-scale", s.rate_scale, "multiply the request rate")
      ->check(CLI::PositiveNumber);
  s.sim->add_option("--start", s.start_s, "skip the trace's first seconds")
      ->check(CLI::NonNegativeNumber);
  s.sim->add_option("--duration", s.duration_s, "replay this many seconds of the trace")
      ->check(CLI::NonNegativeNumber);
  s.sim->add_option("--max-requests", s.max_requests, "replay at most this many requests");
  s.sim->add_option("--slo", s.slo, "goodput objective, e.g. ttft=2s,tpot=50ms");
  s.sim->add_option("--hop-us", s.hop_us, "latency of one message between actors, microseconds")
      ->check(CLI::NonNegativeNumber);
  s.sim->add_option("--link", s.link,
                    "force the KV path between GPUs: same, nvlink, pcie, network");
  s.sim->add_option("--calibration", s.calibration,
                    "calibration TOML file for its GPU (docs/sim.md)");
  s.sim->add_option("--title", s.title, "report title");
  s.sim->add_option("--speed-spread", s.speed_spread,
                    "also simulate each deployment with the engine this fraction slower and faster "
                    "(its GEMM, attention and memory efficiencies scaled), e.g. 0.03: the prediction's "
                    "range over machines that differ by that much")
      ->check(CLI::Range(0.0, 0.5));

  s.plan = app.add_subcommand(
      "plan", "search deployments of a GPU budget for the best goodput per GPU under an SLO");
  s.plan->add_option("--config", s.config_path,
                     "deployment TOML file (model, router, broker, actor defaults)");
  s.plan->add_option("--trace", s.trace, "trace: Azure .csv, Mooncake .jsonl, or synthetic:...")
      ->required();
  s.plan->add_option("--gpu", s.gpu, "GPU type (default h20)");
  s.plan->add_option("--gpus", s.gpus, "GPU budget")->check(CLI::PositiveNumber);
  s.plan->add_option("--slo", s.slo, "objective, e.g. ttft=2s,tpot=50ms")->required();
  s.plan->add_option("--attainment", s.attainment, "fraction of requests that must meet the SLO")
      ->check(CLI::Range(0.01, 1.0));
  s.plan
      ->add_option("--requests", s.requests, "requests replayed per trial, from the window's start")
      ->check(CLI::PositiveNumber);
  s.plan->add_option("--start", s.start_s, "skip the trace's first seconds")
      ->check(CLI::NonNegativeNumber);
  s.plan->add_option("--duration", s.duration_s, "use this many seconds of the trace")
      ->check(CLI::NonNegativeNumber);
  s.plan->add_option("--sm-shares", s.shares,
                     "prefill SM shares of the one-GPU splits, comma separated (none: no split)");
  s.plan->add_option("--reserve-shares", s.reserve_shares,
                     "prefill partitions beside decode on the whole GPU, comma separated (none: no such candidate)");
  s.plan->add_option("--hop-us", s.hop_us, "latency of one message between actors, microseconds")
      ->check(CLI::NonNegativeNumber);
  s.plan->add_option("--calibration", s.calibration, "calibration TOML file for the GPU");
  s.plan->add_option("--jobs", s.jobs, "deployments simulated in parallel (default: every core)");
  s.plan->add_option("--top", s.top,
                     "deployments drawn in the report (plus the best colocated and split)");
  s.plan->add_option("--out", s.out, "report directory")->default_val("duet-plan");

  s.bench = app.add_subcommand("bench", "benchmarks against a live deployment");
  s.bench->require_subcommand(1);
  s.serve = s.bench->add_subcommand(
      "serve", "replay a trace open-loop against a live deployment (HTTP or ZeroMQ); write a report");
  auto* serve = s.serve;
  serve->add_option("--trace", s.trace, "trace: Azure .csv, Mooncake .jsonl, or synthetic:...")->required();
  serve->add_option("--out", s.out, "report directory (summary.json, requests.csv, report.html)")->required();
  serve->add_option("--url", s.url,
                    "http://HOST:PORT (the OpenAI API) or a ZeroMQ endpoint ipc://... / tcp://... "
                    "(default: the --config deployment's router endpoint)");
  serve->add_option("--router", s.router, "router actor address NODE/ACTOR for a ZeroMQ --url");
  serve->add_option("--config", s.config_path,
                    "deployment TOML: its router endpoint, model.max_context, and the simulated runs' deployment");
  serve->add_option("--name", s.run_name, "name of the live run in the report")->default_val("live");
  serve->add_option("--model", s.model, "HTTP: the model field (default: the first of GET /v1/models)");
  serve->add_option("--api-key", s.api_key, "HTTP: bearer token");
  serve->add_option("--temperature", s.temperature, "sampling temperature")->check(CLI::NonNegativeNumber);
  serve->add_option("--rate-scale", s.rate_scale, "multiply the request rate")->check(CLI::PositiveNumber);
  serve->add_option("--start", s.start_s, "skip the trace's first seconds")->check(CLI::NonNegativeNumber);
  serve->add_option("--duration", s.duration_s, "replay this many seconds of the trace")
      ->check(CLI::NonNegativeNumber);
  serve->add_option("--max-requests", s.max_requests, "replay at most this many requests");
  serve->add_option("--time-limit", s.time_limit_s,
                    "seconds; requests still open then are cancelled (default: trace span + 300)")
      ->check(CLI::PositiveNumber);
  serve->add_option("--wait", s.wait_s, "seconds to wait for the deployment to be ready")
      ->check(CLI::NonNegativeNumber);
  serve->add_option("--max-context", s.max_context,
                    "clip prompt + output to this many tokens (default: the config's model.max_context)");
  serve->add_option("--prompt-vocab", s.prompt_vocab, "prompt token ids are drawn below this")
      ->check(CLI::Range(2u, 1u << 30));
  serve->add_option("--slo", s.slo, "goodput objective, e.g. ttft=2s,tpot=50ms");
  serve->add_option("--sim-deployment", s.sim_deployments,
                    "also simulate this deployment spec on the same trace (repeatable; docs/sim.md); "
                    "'config' simulates the --config deployment itself");
  serve->add_option("--gpu", s.gpu, "GPU type of the simulated runs (default: the config's engine.gpu)");
  serve->add_option("--calibration", s.calibration, "calibration TOML for the simulated runs");
  serve->add_option("--hop-us", s.hop_us, "simulated message latency between actors, microseconds")
      ->check(CLI::NonNegativeNumber);
  serve->add_option("--title", s.title, "report title");

  s.engine_bench = s.bench->add_subcommand(
      "engine", "time one engine's prefill and decode steps on a model (cpu or cuda), or price them (sim)");
  auto* eb = s.engine_bench;
  eb->add_option("--model", s.model, "checkpoint directory or .gguf file (sim: a model preset)")->required();
  eb->add_option("--engine", s.engine_kind,
                 "cpu or cuda; sim: the simulator's cost model prices each call (docs/sim.md)")
      ->default_val("cpu");
  eb->add_option("--gpu", s.gpu, "sim: the GPU whose steps it models (default: the calibration's)");
  eb->add_option("--calibration", s.calibration, "sim: calibration TOML file for that GPU");
  eb->add_option("--dtype", s.dtype, "model.dtype (cpu GGUF: f32 for the fp32 path)")->default_val("bf16");
  eb->add_option("--threads", s.threads, "cpu: worker threads (0: every core)");
  eb->add_option("--device", s.device, "cuda: GPU ordinal")->check(CLI::NonNegativeNumber);
  eb->add_option("--chunk-tokens", s.chunk_tokens, "prompt tokens per prefill pass (cpu, cuda; sim prices each call whole)")->check(CLI::Range(16u, 1u << 20));
  eb->add_option("--prefill", s.rows.prefill_tokens, "prompt lengths, comma separated (one sequence each)")
      ->delimiter(',');
  eb->add_option("--prefill-mix", s.prefill_mixes,
                 "prefill steps of several chunks, comma separated: NxT[@P] joined by '+' (N chunks of T tokens "
                 "after P prompt tokens in KV), e.g. 4x256,1x1024@3072; with it only rows given explicitly run")
      ->delimiter(',');
  eb->add_option("--sm-share", s.sm_share,
                 "cuda: run in a green context holding this fraction of the SMs; sim: price steps on that share")
      ->check(CLI::Range(0.01, 1.0));
  eb->add_option("--batch", s.rows.batches, "decode batch sizes, comma separated")->delimiter(',');
  eb->add_option("--context", s.rows.contexts, "decode context lengths, comma separated")->delimiter(',');
  eb->add_option("--steps", s.rows.steps, "timed decode steps per row")->check(CLI::Range(1u, 100000u));
  eb->add_option("--warmup", s.rows.warmup, "untimed decode steps first");
  eb->add_option("--repeats", s.rows.prefill_repeats, "timed prefills per length")->check(CLI::Range(1u, 1000u));
  eb->add_option("--seed", s.rows.seed, "prompt token ids");
  eb->add_option("--tie-margin", s.rows.tie_margin,
                 "nats: identical sequences may swap two candidates whose top-2 margin is within this")
      ->check(CLI::Range(0.0, 10.0));
  eb->add_option("--mix-tie-margin", s.rows.mix_tie_margin,
                 "nats: a mix row's chunk and its whole prompt may choose two tokens each within this of its best")
      ->check(CLI::Range(0.0, 10.0));
  eb->add_option("--json", s.json_out, "write the rows as JSON here");
}

sim_commands::~sim_commands() = default;

bool sim_commands::selected() const {
  return state_->sim->parsed() || state_->plan->parsed() || state_->serve->parsed() ||
         state_->engine_bench->parsed();
}

int sim_commands::run() {
  const char* command = state_->sim->parsed()            ? "sim"
                        : state_->plan->parsed()           ? "plan"
                        : state_->engine_bench->parsed()   ? "bench engine"
                                                           : "bench serve";
  try {
    if (state_->serve->parsed()) return run_bench_serve(*state_);
    if (state_->engine_bench->parsed()) return run_bench_engine(*state_);
    return state_->sim->parsed() ? run_sim(*state_) : run_plan(*state_);
  } catch (const config_error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  } catch (const trace_error& e) {
    std::fprintf(stderr, "duet %s: %s\n", command, e.what());
    return 2;
  } catch (const gpu_catalog_error& e) {
    std::fprintf(stderr, "duet %s: %s\n", command, e.what());
    return 2;
  } catch (const toml::parse_error& e) {
    std::fprintf(stderr, "duet %s: %s: %s\n", command, state_->calibration.c_str(),
                 std::string(e.description()).c_str());
    return 2;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "duet %s: %s\n", command, e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet %s: %s\n", command, e.what());
    return 1;
  }
}

}  // namespace duet
