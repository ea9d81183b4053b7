#include "sim/planner.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "sim/deployment_spec.hpp"

namespace duet {

namespace {

std::string fmt(const char* format, auto... args) {
  char buf[256];
  std::snprintf(buf, sizeof buf, format, args...);
  return buf;
}

std::string ms(double seconds) {
  if (seconds >= 10) return fmt("%.1f s", seconds);
  if (seconds >= 1) return fmt("%.2f s", seconds);
  return fmt("%.1f ms", seconds * 1e3);
}

struct trial {
  bool pass = false;
  latency_summary summary;
  sim_result run;
};

plan_entry search(const deployment_config& config, const sim_deployment& d,
                  std::span<const trace_request> trace, const plan_options& options,
                  double trace_rate) {
  plan_entry e;
  e.deployment = d;
  e.gpus = static_cast<uint32_t>(d.gpus.size());
  sim_options so = options.sim;
  so.progress = nullptr;
  auto evaluate = [&](double scale) {
    trial t;
    const auto scaled = scale_rate(std::vector<trace_request>(trace.begin(), trace.end()), scale);
    t.run = run_simulation(config, d, scaled, so);
    t.summary = summarize(t.run.records, options.slo);
    t.pass = t.summary.slo_attainment >= options.attainment;
    ++e.simulations;
    return t;
  };
  constexpr double lowest = 1.0 / 64, highest = 1024;
  double lo = 0, hi = 0;  // lo passes (0: none yet), hi fails (0: none yet)
  trial best, lowest_tried;
  double scale = std::max(1.0, double(e.gpus) / 2);
  for (;;) {
    trial t = evaluate(scale);
    if (t.pass) {
      lo = scale;
      best = std::move(t);
      if (hi > 0 || scale >= highest) break;
      scale *= 2;
    } else {
      hi = scale;
      if (lo > 0 || scale <= lowest) {
        lowest_tried = std::move(t);
        break;
      }
      lowest_tried = std::move(t);
      scale /= 2;
    }
  }
  if (lo > 0 && hi > 0) {
    for (uint32_t i = 0; i < options.search_steps; ++i) {
      const double mid = std::sqrt(lo * hi);
      trial t = evaluate(mid);
      if (t.pass) {
        lo = mid;
        best = std::move(t);
      } else {
        hi = mid;
      }
    }
  }
  const trial& shown = lo > 0 ? best : lowest_tried;
  e.rate_scale = lo;
  e.goodput = lo * trace_rate;
  e.goodput_per_gpu = e.gpus > 0 ? e.goodput / e.gpus : 0.0;
  e.replicas = e.gpus > 0 ? options.gpu_budget / e.gpus : 0;
  e.attainment = shown.summary.slo_attainment;
  e.summary = shown.summary;
  e.run = shown.run;
  return e;
}

}  // namespace

std::vector<sim_deployment> plan_candidates(const deployment_config& config,
                                            const plan_options& options) {
  std::vector<sim_deployment> out;
  const uint32_t budget = std::max<uint32_t>(options.gpu_budget, 1);
  out.push_back(parse_deployment_spec("colocated", config, options.gpu));
  out.push_back(parse_deployment_spec("streams", config, options.gpu));
  auto check_share = [](double share) {
    if (!(share > 0 && share < 1)) throw std::invalid_argument("SM shares must be between 0 and 1");
  };
  for (double share : options.sm_shares) {
    check_share(share);
    auto d = parse_deployment_spec(fmt("split:sm=%g", share), config, options.gpu);
    d.name = fmt("split %.0f/%.0f", share * 100, (1 - share) * 100);
    out.push_back(std::move(d));
  }
  for (double share : options.reserve_shares) {
    check_share(share);
    auto d = parse_deployment_spec(fmt("reserve:sm=%g", share), config, options.gpu);
    d.name = fmt("reserve %.0f", share * 100);
    out.push_back(std::move(d));
  }
  for (uint32_t total = 2; total <= budget; ++total) {
    for (uint32_t p = 1; p < total; ++p) {
      out.push_back(parse_deployment_spec(fmt("%uP%uD", p, total - p), config, options.gpu));
    }
  }
  return out;
}

std::vector<plan_entry> plan_deployments(const deployment_config& config,
                                         std::span<const trace_request> trace,
                                         const plan_options& options) {
  if (trace.size() < 2 || trace.back().arrival_s <= trace.front().arrival_s) {
    throw std::invalid_argument(
        "the trace needs at least two requests at different times to have a rate");
  }
  const double trace_rate =
      double(trace.size() - 1) / (trace.back().arrival_s - trace.front().arrival_s);
  const auto candidates = plan_candidates(config, options);
  std::vector<plan_entry> entries(candidates.size());
  std::atomic<size_t> next{0};
  std::mutex mutex;
  size_t done = 0;
  std::exception_ptr failure;
  auto work = [&] {
    for (size_t i = next++; i < candidates.size(); i = next++) {
      try {
        entries[i] = search(config, candidates[i], trace, options, trace_rate);
      } catch (...) {
        std::lock_guard lock(mutex);
        if (!failure) failure = std::current_exception();
        next = candidates.size();
        return;
      }
      std::lock_guard lock(mutex);
      ++done;
      if (options.progress) options.progress(done, candidates.size(), candidates[i].name);
    }
  };
  const uint32_t jobs =
      std::clamp<uint32_t>(options.jobs, 1, static_cast<uint32_t>(candidates.size()));
  std::vector<std::thread> threads;
  for (uint32_t j = 1; j < jobs; ++j) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  if (failure) std::rethrow_exception(failure);
  std::stable_sort(entries.begin(), entries.end(), [](const plan_entry& a, const plan_entry& b) {
    if (a.goodput_per_gpu != b.goodput_per_gpu) return a.goodput_per_gpu > b.goodput_per_gpu;
    return a.gpus < b.gpus;
  });
  return entries;
}

std::string format_plan_table(std::span<const plan_entry> ranked, const plan_options& options,
                              double trace_rate) {
  std::string out;
  out += fmt("goodput: the highest request rate with at least %.0f%% of requests within",
             options.attainment * 100);
  out += " TTFT " +
         (std::isinf(options.slo.ttft_s) ? std::string("(any)") : ms(options.slo.ttft_s)) +
         " and TPOT " +
         (std::isinf(options.slo.tpot_s) ? std::string("(any)") : ms(options.slo.tpot_s)) +
         fmt("; trace rate %.2f req/s; %u x %s\n\n", trace_rate, options.gpu_budget,
             options.gpu.c_str());
  out +=
      fmt("%-4s %-14s %4s %10s %12s %8s %13s %9s %9s %7s\n", "rank", "deployment", "GPUs",
          "rate req/s", "goodput/GPU", "replicas", "total req/s", "P90 TTFT", "P90 TPOT", "attain");
  size_t rank = 0;
  for (const auto& e : ranked) {
    ++rank;
    out += fmt("%-4zu %-14s %4u %10.2f %12.3f %8u %13.2f %9s %9s %6.1f%%\n", rank,
               e.deployment.name.c_str(), e.gpus, e.goodput, e.goodput_per_gpu, e.replicas,
               e.goodput * e.replicas, ms(e.summary.ttft_s.p90).c_str(),
               ms(e.summary.tpot_s.p90).c_str(), e.attainment * 100);
  }
  return out;
}

}  // namespace duet
