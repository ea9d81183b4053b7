#include "sim/deployment_spec.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

namespace duet {

namespace {

struct worker_defaults {
  uint32_t prefill_batch = actor_config{}.max_batch;
  uint32_t decode_batch = actor_config{}.max_batch;
  uint32_t chunk_tokens = actor_config{}.chunk_tokens;
  kv_allocation decode_allocation = kv_allocation::on_demand;
};

worker_defaults defaults_of(const deployment_config& config) {
  worker_defaults d;
  bool prefill_seen = false, decode_seen = false;
  for (const auto& n : config.nodes) {
    for (const auto& a : n.actors) {
      if (a.role == actor_role::prefill && !prefill_seen) {
        prefill_seen = true;
        d.prefill_batch = a.max_batch;
        d.chunk_tokens = a.chunk_tokens;
      } else if (a.role == actor_role::decode && !decode_seen) {
        decode_seen = true;
        d.decode_batch = a.max_batch;
        d.decode_allocation = kv_allocation_of(a);
      }
    }
  }
  return d;
}

[[noreturn]] void bad(std::string_view spec, const std::string& what) {
  throw deployment_spec_error("deployment '" + std::string(spec) + "': " + what);
}

uint32_t to_count(std::string_view spec, std::string_view key, std::string_view text,
                  uint32_t min_value) {
  uint32_t v = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  if (r.ec != std::errc{} || r.ptr != text.data() + text.size() || v < min_value) {
    bad(spec, std::string(key) + " must be a whole number of at least " +
                  std::to_string(min_value) + ", not '" + std::string(text) + "'");
  }
  return v;
}

double to_fraction(std::string_view spec, std::string_view key, std::string_view text) {
  double v = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  if (r.ec != std::errc{} || r.ptr != text.data() + text.size() || !(v > 0 && v < 1)) {
    bad(spec, std::string(key) + " must be a number between 0 and 1 (exclusive), not '" +
                  std::string(text) + "'");
  }
  return v;
}

}  // namespace

sim_deployment deployment_from_config(const deployment_config& config) {
  sim_deployment d;
  d.name = config.source.empty() ? std::string("config") : config.source.stem().string();
  d.policy = step_policy::stream;  // what stream = "shared" actors of one device do
  std::map<std::pair<uint32_t, int>, uint32_t> gpu_of;  // (node, device) -> GPU index
  for (uint32_t n = 0; n < config.nodes.size(); ++n) {
    const auto& node = config.nodes[n];
    for (const auto& a : node.actors) {
      if (a.role != actor_role::prefill && a.role != actor_role::decode) continue;
      auto [it, added] = gpu_of.try_emplace({n, a.device}, static_cast<uint32_t>(d.gpus.size()));
      if (added) d.gpus.push_back({config.engine.gpu, n});
      sim_worker w;
      w.address = node.name + "/" + a.name;
      w.role = a.role;
      w.gpu = it->second;
      w.sm_share = a.sm_share;
      w.kv_blocks = a.kv_blocks;
      w.max_batch = a.max_batch;
      w.chunk_tokens = a.chunk_tokens;
      w.own_stream = a.stream != "shared";
      w.kv_allocation = kv_allocation_of(a);
      d.workers.push_back(std::move(w));
    }
  }
  return d;
}

sim_deployment parse_deployment_spec(std::string_view spec, const deployment_config& config,
                                     const std::string& gpu) {
  const auto colon = spec.find(':');
  std::string kind(spec.substr(0, colon));
  std::transform(kind.begin(), kind.end(), kind.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  std::map<std::string, std::string, std::less<>> options;
  if (colon != std::string_view::npos) {
    std::string_view rest = spec.substr(colon + 1);
    while (!rest.empty()) {
      const auto comma = rest.find(',');
      const std::string_view item = rest.substr(0, comma);
      const auto eq = item.find('=');
      if (eq == std::string_view::npos || eq == 0 || eq + 1 == item.size()) {
        bad(spec, "options are key=value, separated by commas; got '" + std::string(item) + "'");
      }
      if (!options.emplace(std::string(item.substr(0, eq)), std::string(item.substr(eq + 1)))
               .second) {
        bad(spec, "option '" + std::string(item.substr(0, eq)) + "' is given twice");
      }
      if (comma == std::string_view::npos) break;
      rest = rest.substr(comma + 1);
    }
  }
  uint32_t prefill_gpus = 0, decode_gpus = 0;
  // Kinds with prefill and decode on each GPU; "streams": both on the whole GPU, each on a stream
  // of its own; "reserve": prefill on a partition, decode on the whole GPU on a stream of its
  // own (docs/sim.md, "A prefill partition beside the whole GPU").
  const bool shared =
      kind == "colocated" || kind == "streams" || kind == "split" || kind == "reserve";
  if (!shared) {
    const auto p = kind.find('p');
    const auto dpos = kind.find('d');
    if (p == std::string::npos || dpos != kind.size() - 1 || p == 0 || dpos == p + 1) {
      bad(spec,
          "the kind must be colocated, streams, split, reserve, or XPYD such as 1P1D or 2P6D");
    }
    prefill_gpus = to_count(spec, "the prefill count", std::string_view(kind).substr(0, p), 1);
    decode_gpus =
        to_count(spec, "the decode count", std::string_view(kind).substr(p + 1, dpos - p - 1), 1);
  }
  const std::set<std::string, std::less<>> allowed =
      kind == "colocated"
          ? std::set<std::string, std::less<>>{"gpus",  "gpu",    "link",  "per_host",
                                               "batch", "pbatch", "chunk", "pmem",
                                               "policy", "name",  "kv_allocation"}
      : kind == "streams"
          ? std::set<std::string, std::less<>>{"gpus",  "gpu",    "link",  "per_host", "batch",
                                               "pbatch", "chunk", "pmem", "name",  "kv_allocation"}
      : kind == "split" || kind == "reserve"
          ? std::set<std::string, std::less<>>{"gpus",  "gpu",    "sm",    "link", "per_host",
                                               "batch", "pbatch", "chunk", "pmem", "name",
                                               "kv_allocation"}
          : std::set<std::string, std::less<>>{"gpu",   "p",      "d",     "link", "per_host",
                                               "batch", "pbatch", "chunk", "name", "kv_allocation"};
  for (const auto& [k, v] : options) {
    if (!allowed.contains(k)) {
      std::string list;
      for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
      bad(spec, "unknown option '" + k + "' for " + (shared ? kind : std::string("XPYD")) +
                    " (known: " + list + ")");
    }
  }
  auto option = [&](std::string_view key) -> const std::string* {
    auto it = options.find(key);
    return it == options.end() ? nullptr : &it->second;
  };
  const worker_defaults defaults = defaults_of(config);
  const uint32_t decode_batch =
      option("batch") ? to_count(spec, "batch", *option("batch"), 1) : defaults.decode_batch;
  const uint32_t prefill_batch =
      option("pbatch") ? to_count(spec, "pbatch", *option("pbatch"), 1) : defaults.prefill_batch;
  const uint32_t chunk =
      option("chunk") ? to_count(spec, "chunk", *option("chunk"), 1) : defaults.chunk_tokens;
  const uint32_t per_host =
      option("per_host") ? to_count(spec, "per_host", *option("per_host"), 1) : 8;
  const std::string every = option("gpu") ? *option("gpu") : gpu;
  const double pmem = option("pmem") ? to_fraction(spec, "pmem", *option("pmem")) : 0.2;
  kv_allocation allocation = defaults.decode_allocation;
  if (const auto* a = option("kv_allocation")) {
    const auto mode = kv_allocation_from_string(*a);
    if (!mode) bad(spec, "kv_allocation must be on_demand or reserve, not '" + *a + "'");
    allocation = *mode;
  }

  sim_deployment d;
  d.name = option("name") ? *option("name") : std::string(spec);
  if (const auto* l = option("link")) {
    d.link = link_kind_from_string(*l);
    if (!d.link) bad(spec, "link must be same, nvlink, pcie or network, not '" + *l + "'");
  }
  if (const auto* p = option("policy")) {
    const auto policy = step_policy_from_string(*p);
    if (!policy)
      bad(spec, "policy must be alternate, prefill_first, decode_first or stream, not '" + *p + "'");
    d.policy = *policy;
  }
  auto add_gpu = [&](const std::string& type) {
    const auto index = static_cast<uint32_t>(d.gpus.size());
    d.gpus.push_back({type, index / per_host});
    return index;
  };
  auto add_worker = [&](uint32_t g, actor_role role, double sm, double memory_share,
                        bool own_stream = false) {
    sim_worker w;
    w.address =
        "gpu" + std::to_string(g) + "/" + (role == actor_role::prefill ? "prefill" : "decode");
    w.role = role;
    w.gpu = g;
    w.sm_share = sm;
    w.kv_memory_share = memory_share;
    w.max_batch = role == actor_role::prefill ? prefill_batch : decode_batch;
    w.chunk_tokens = chunk;
    w.kv_allocation = allocation;
    w.own_stream = own_stream;
    d.workers.push_back(std::move(w));
  };
  if (shared) {
    const uint32_t n = option("gpus") ? to_count(spec, "gpus", *option("gpus"), 1) : 1;
    const double sm = kind == "colocated" || kind == "streams" ? 1.0
                      : option("sm")                            ? to_fraction(spec, "sm", *option("sm"))
                      : kind == "split"                         ? 0.5
                                                                : 0.7;
    const bool own_streams = kind == "streams" || kind == "reserve";
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t g = add_gpu(every);
      add_worker(g, actor_role::prefill, sm, pmem, own_streams);
      add_worker(g, actor_role::decode, kind == "split" ? 1.0 - sm : 1.0, 1.0 - pmem, own_streams);
    }
  } else {
    const std::string p_type = option("p") ? *option("p") : every;
    const std::string d_type = option("d") ? *option("d") : every;
    for (uint32_t i = 0; i < prefill_gpus; ++i)
      add_worker(add_gpu(p_type), actor_role::prefill, 1.0, 1.0);
    for (uint32_t i = 0; i < decode_gpus; ++i)
      add_worker(add_gpu(d_type), actor_role::decode, 1.0, 1.0);
  }
  return d;
}

std::string describe(const sim_deployment& d) {
  std::string out = std::to_string(d.gpus.size()) + (d.gpus.size() == 1 ? " GPU:" : " GPUs:");
  for (uint32_t g = 0; g < d.gpus.size(); ++g) {
    out += (g == 0 ? " gpu" : ", gpu") + std::to_string(g) + " " + d.gpus[g].type;
    if (d.gpus.back().host > 0) out += "@host" + std::to_string(d.gpus[g].host);
    out += " [";
    bool first = true;
    for (const auto& w : d.workers) {
      if (w.gpu != g) continue;
      out += (first ? "" : " + ") + std::string(to_string(w.role));
      if (w.sm_share < 1) {
        char share[16];
        std::snprintf(share, sizeof share, " %.0f%%", w.sm_share * 100);
        out += share;
      }
      first = false;
    }
    out += "]";
  }
  return out;
}

}  // namespace duet
