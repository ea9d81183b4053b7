// Fault tests with real processes and real sockets: a three-process deployment over ipc://
// (node a: router + broker; node b: prefill0; node c: decode0) on a tiny random checkpoint
// served by the CPU engine, so KV bytes really stream between pools (the stream path). Nodes
// are killed with SIGKILL, and messages are dropped or delayed by the transport's fault hook
// ($DUET_TRANSPORT_FAULT, docs/protocol.md "Faults and what happens"). After each fault:
// every request got one final answer within a bound, successful requests carry the tokens of
// a fault-free run, and every surviving pool is full again (broker live_handles == 0).
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "runtime/client.hpp"
#include "runtime/config.hpp"
#include "runtime/transport.hpp"
#include "tests/process_util.hpp"

using namespace duet;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

using steady = std::chrono::steady_clock;

double seconds_since(steady::time_point t) { return std::chrono::duration<double>(steady::now() - t).count(); }

std::string unique(const std::string& stem) {
  return stem + "-" + std::to_string(getpid()) + "-" + std::to_string(std::random_device{}() % 100000);
}

/// A directory removed (with what it holds) when it goes out of scope.
struct temp_dir {
  fs::path path = fs::temp_directory_path() / unique("duet-faults");
  temp_dir() { fs::create_directories(path); }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

/// The tiny random Llama checkpoint (2 layers, hidden 32, one KV head: 4 KiB per KV block),
/// written once per test process by the duet binary itself.
const fs::path& tiny_checkpoint() {
  static temp_dir dir;
  static const fs::path model = [] {
    const fs::path out = dir.path / "tiny-llama";
    testing::child_process p({testing::duet_binary(), "model", "random", "--preset", "tiny-llama", "--layers", "2",
                              "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--ffn", "48", "--seed", "11",
                              "--dtype", "f32", "--out", out.string()},
                             {{}, (dir.path / "model-random.log").string()});
    const auto until = steady::now() + 60s;
    while (p.running() && steady::now() < until) std::this_thread::sleep_for(20ms);
    const int status = p.stop();
    REQUIRE_MESSAGE((WIFEXITED(status) && WEXITSTATUS(status) == 0), "duet model random failed, status ", status);
    return out;
  }();
  return model;
}

/// What a deployment is run with: short leases and timeouts so recovery fits a CI budget.
struct deployment_params {
  uint32_t lease_ms = 1500;
  uint32_t transfer_timeout_ms = 1000;
  uint32_t request_timeout_ms = 15000;
  uint32_t stream_chunk_bytes = 1024;  // below one block: one block per kv_chunk
  uint32_t stream_window = 2;
  uint32_t prefill_blocks = 1024;
  uint32_t decode_blocks = 1024;
  std::string stream_prefill = "off";  // "chunks": KV streams during prefill
  std::map<char, std::string> faults;  // node ('a', 'b', 'c') -> $DUET_TRANSPORT_FAULT
};

const std::vector<std::string> all_pools = {"a/broker", "b/prefill0", "c/decode0"};

/// Three `duet node` processes; one client for requests, another for stats (client::stats
/// swallows request events, so the two never share a socket).
class deployment {
 public:
  explicit deployment(deployment_params p) : params_(std::move(p)) {
    for (char n : {'a', 'b', 'c'}) endpoints_[n] = "ipc://" + (dir_.path / (std::string(1, n) + ".sock")).string();
    config_ = dir_.path / "deploy.toml";
    std::ofstream(config_) << toml();
    for (char n : {'a', 'b', 'c'}) start(n);
    requests_ = std::make_unique<client>(endpoints_['a'], "a/router");
    observer_ = std::make_unique<client>(endpoints_['a'], "a/router");
  }

  void start(char n) {
    testing::child_options o;
    o.log = log_path(n).string();
    if (auto it = params_.faults.find(n); it != params_.faults.end()) o.env.emplace_back(transport_fault_env, it->second);
    nodes_[n] = std::make_unique<testing::child_process>(
        std::vector<std::string>{testing::duet_binary(), "node", "--config", config_.string(), "--name",
                                 std::string(1, n)},
        o);
  }
  void kill9(char n) { nodes_.at(n)->kill9(); }
  [[nodiscard]] bool running(char n) const { return nodes_.at(n)->running(); }

  /// True once the router sees a live prefill and decode worker (bounded).
  bool wait_ready(std::chrono::milliseconds timeout) {
    const auto until = steady::now() + timeout;
    while (steady::now() < until) {
      for (auto& r : observer_->stats({"a/router"}, 200ms)) {
        if (r.actor == "a/router" && r.counters["ready_prefill"] > 0 && r.counters["ready_decode"] > 0) return true;
      }
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }

  /// Polls until every listed pool is full and the broker holds no handle; returns the
  /// seconds it took, or nullopt at the timeout (with the last state in `detail`).
  std::optional<double> wait_pools_full(const std::vector<std::string>& actors, std::chrono::milliseconds timeout,
                                        std::string& detail) {
    const auto start = steady::now();
    while (steady::now() < start + timeout) {
      auto replies = observer_->stats(actors, 300ms);
      // A late reply to an earlier request may be among them: count only the asked actors.
      std::erase_if(replies, [&](const msg::stats_reply& r) {
        return std::find(actors.begin(), actors.end(), r.actor) == actors.end();
      });
      std::set<std::string> answered;
      for (const auto& r : replies) answered.insert(r.actor);
      bool full = answered.size() == actors.size();
      detail.clear();
      for (auto& r : replies) {
        if (r.role == "broker") full = full && r.counters["live_handles"] == 0;
        else full = full && r.free_blocks == r.total_blocks;
        detail += r.actor + " " + std::to_string(r.free_blocks) + "/" + std::to_string(r.total_blocks) +
                  " live_handles=" + std::to_string(r.counters["live_handles"]) + "; ";
      }
      if (full) return seconds_since(start);
      std::this_thread::sleep_for(50ms);
    }
    return std::nullopt;
  }

  /// The actor's counters; empty when three asks of a second each got no reply (a loaded
  /// machine can keep one stats reply past a second).
  [[nodiscard]] std::map<std::string, uint64_t> counters(const std::string& actor) {
    for (int attempt = 0; attempt < 3; ++attempt) {
      for (auto& r : observer_->stats({actor}, 1s)) {
        if (r.actor == actor) return r.counters;
      }
    }
    return {};
  }

  /// Lines of a node's log that contain `text` (e.g. "dropped kv_chunk").
  [[nodiscard]] std::size_t log_count(char n, const std::string& text) const {
    std::ifstream in(log_path(n));
    std::size_t count = 0;
    for (std::string line; std::getline(in, line);) count += line.find(text) != std::string::npos;
    return count;
  }
  [[nodiscard]] std::string log(char n) const {
    std::ifstream in(log_path(n));
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

  client& requests() { return *requests_; }
  client& observer() { return *observer_; }
  [[nodiscard]] const deployment_params& params() const { return params_; }

 private:
  [[nodiscard]] fs::path log_path(char n) const { return dir_.path / (std::string(1, n) + ".log"); }

  [[nodiscard]] std::string toml() const {
    const auto& p = params_;
    std::ostringstream t;
    t << "[model]\nname = \"tiny-faults\"\npath = \"" << tiny_checkpoint().string() << "\"\nmax_context = 4096\n"
      << "[engine]\nkind = \"cpu\"\nthreads = 1\n"
      << "[router]\nrequest_timeout_ms = " << p.request_timeout_ms << "\n"
      << "[broker]\nlease_ms = " << p.lease_ms << "\nreclaim_interval_ms = 50\ntransfer_timeout_ms = "
      << p.transfer_timeout_ms << "\nstream_chunk_bytes = " << p.stream_chunk_bytes
      << "\nstream_window = " << p.stream_window << "\n";
    // Every transfer takes the stream path (the one these faults are about), also where a
    // same-host shared-pool path exists and would be chosen by default.
    const auto keys = config_keys();
    if (std::find(keys.begin(), keys.end(), "broker.transfer") != keys.end()) t << "transfer = \"stream\"\n";
    if (p.stream_prefill != "off") t << "stream_prefill = \"" << p.stream_prefill << "\"\n";
    t
      << "[transport]\npeer_timeout_ms = 1000\nheartbeat_ms = 200\n"
      << "[[nodes]]\nname = \"a\"\nendpoint = \"" << endpoints_.at('a') << "\"\n"
      << "[[nodes.actors]]\nname = \"router\"\nrole = \"router\"\n"
      << "[[nodes.actors]]\nname = \"broker\"\nrole = \"broker\"\n"
      << "[[nodes]]\nname = \"b\"\nendpoint = \"" << endpoints_.at('b') << "\"\n"
      << "[[nodes.actors]]\nname = \"prefill0\"\nrole = \"prefill\"\nkv_blocks = " << p.prefill_blocks
      << "\nchunk_tokens = 1024\nmax_batch = 8\n"
      << "[[nodes]]\nname = \"c\"\nendpoint = \"" << endpoints_.at('c') << "\"\n"
      << "[[nodes.actors]]\nname = \"decode0\"\nrole = \"decode\"\nkv_blocks = " << p.decode_blocks
      << "\nmax_batch = 16\n";
    return t.str();
  }

  deployment_params params_;
  temp_dir dir_;
  fs::path config_;
  std::map<char, std::string> endpoints_;
  std::map<char, std::unique_ptr<testing::child_process>> nodes_;
  std::unique_ptr<client> requests_;
  std::unique_ptr<client> observer_;
};

/// One request as the client saw it.
struct outcome {
  bool admitted = false;
  std::map<uint32_t, int32_t> tokens;  // by position
  std::optional<msg::finish> finish;
  std::optional<msg::rejected> rejection;
  steady::time_point submitted;
  double final_s = -1;  // submit to the final answer
  uint64_t reference = 0;  // workload item with the same prompt and sampling (0: none)
  [[nodiscard]] bool final() const { return finish || rejection; }
  [[nodiscard]] bool ok() const {
    return finish && (finish->reason == msg::finish_reason::stop || finish->reason == msg::finish_reason::length);
  }
  [[nodiscard]] std::vector<int32_t> token_list() const {
    std::vector<int32_t> out;
    for (const auto& [pos, t] : tokens) out.push_back(t);
    return out;
  }
  [[nodiscard]] std::string describe() const {
    if (rejection) return "rejected " + std::to_string(static_cast<int>(rejection->code)) + " " + rejection->message;
    if (!finish) return "no final answer";
    return std::string(msg::to_string(finish->reason)) + " " + std::to_string(static_cast<int>(finish->code)) + " '" +
           finish->message + "' after " + std::to_string(finish->completion_tokens) + " tokens";
  }
};

/// Submits requests and gathers what comes back, on one client.
class tracker {
 public:
  explicit tracker(client& c) : c_(c) {}

  /// `reference` names the workload item whose fault-free tokens this request must match (0: none).
  void submit(uint64_t id, const std::vector<int32_t>& prompt, uint32_t max_new_tokens, bool ignore_eos = false,
              uint64_t reference = 0) {
    msg::submit s;
    s.request_id = id;
    s.prompt_tokens = prompt;
    s.sampling.max_new_tokens = max_new_tokens;
    s.sampling.ignore_eos = ignore_eos;
    auto& o = outcomes_[id];
    o.submitted = steady::now();
    o.reference = reference;
    REQUIRE(c_.submit(s));
  }
  void cancel(uint64_t id) { REQUIRE(c_.cancel(id)); }

  void pump(std::chrono::milliseconds timeout) {
    for (auto& e : c_.poll(timeout)) {
      auto it = outcomes_.find(e.request_id);
      if (it == outcomes_.end()) continue;
      auto& o = it->second;
      switch (e.what) {
        case client_event::kind::admitted: o.admitted = true; break;
        case client_event::kind::rejected:
          if (!o.final()) o.final_s = seconds_since(o.submitted);
          o.rejection = e.rejection;
          break;
        case client_event::kind::tokens:
          for (std::size_t k = 0; k < e.tokens.size(); ++k) o.tokens[e.positions.at(k)] = e.tokens[k];
          break;
        case client_event::kind::finished:
          if (!o.final()) {  // a second final would be a protocol violation: keep the first, count it
            o.final_s = seconds_since(o.submitted);
            o.finish = e.finish;
          } else {
            ++duplicate_finals_;
          }
          break;
      }
    }
  }

  /// Pumps until `done()` or the timeout; true when done.
  template <class Pred>
  bool wait_until(Pred done, std::chrono::milliseconds timeout) {
    const auto until = steady::now() + timeout;
    while (!done()) {
      if (steady::now() >= until) return false;
      pump(10ms);
    }
    return true;
  }
  bool wait_all_final(std::chrono::milliseconds timeout) {
    return wait_until([&] { return std::all_of(outcomes_.begin(), outcomes_.end(), [](auto& kv) { return kv.second.final(); }); },
                      timeout);
  }

  [[nodiscard]] std::map<uint64_t, outcome>& outcomes() { return outcomes_; }
  [[nodiscard]] const outcome& at(uint64_t id) const { return outcomes_.at(id); }
  [[nodiscard]] uint32_t duplicate_finals() const { return duplicate_finals_; }
  [[nodiscard]] double slowest_final_s() const {
    double worst = 0;
    for (const auto& [id, o] : outcomes_) worst = std::max(worst, o.final_s);
    return worst;
  }

 private:
  client& c_;
  std::map<uint64_t, outcome> outcomes_;
  uint32_t duplicate_finals_ = 0;
};

/// A deterministic prompt of `length` ordinary Llama-3 token ids.
std::vector<int32_t> prompt_of(uint32_t length, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> out(length);
  for (auto& t : out) t = static_cast<int32_t>(1000 + rng() % 100000);
  return out;
}

/// The standard workload: greedy prompts of several lengths (up to 125 KV blocks each).
struct workload_item {
  uint64_t id;
  uint32_t length;
};
const std::vector<workload_item> workload = {{1, 2000}, {2, 1500}, {3, 1000}, {4, 700},
                                             {5, 400},  {6, 200},  {7, 64},   {8, 1800}};
constexpr uint32_t workload_new_tokens = 8;

void submit_workload(tracker& t) {
  for (const auto& w : workload) {
    t.submit(w.id, prompt_of(w.length, static_cast<uint32_t>(w.id)), workload_new_tokens, false, w.id);
  }
}

/// The tokens of the standard workload on a fault-free deployment (run once per process).
const std::map<uint64_t, std::vector<int32_t>>& reference_tokens() {
  static const std::map<uint64_t, std::vector<int32_t>> tokens = [] {
    deployment d({});
    REQUIRE(d.wait_ready(10s));
    tracker t(d.requests());
    submit_workload(t);
    REQUIRE(t.wait_all_final(20s));
    std::map<uint64_t, std::vector<int32_t>> out;
    for (auto& [id, o] : t.outcomes()) {
      REQUIRE_MESSAGE(o.ok(), "fault-free request ", id, ": ", o.describe());
      REQUIRE(o.tokens.size() == o.finish->completion_tokens);
      out[id] = o.token_list();
    }
    return out;
  }();
  return tokens;
}

/// Every request has one final answer; the successful ones carry the fault-free tokens.
void check_finals_and_tokens(const tracker& t) {
  const auto& reference = reference_tokens();
  CHECK(t.duplicate_finals() == 0);
  for (const auto& [id, o] : const_cast<tracker&>(t).outcomes()) {
    CHECK_MESSAGE(o.final(), "request ", id, " has no final answer");
    if (o.finish && (o.finish->reason == msg::finish_reason::error || o.finish->reason == msg::finish_reason::timeout)) {
      CHECK_MESSAGE(!o.finish->message.empty(), "request ", id, " failed without a reason");
      CHECK_MESSAGE(o.finish->code != msg::error_code::none, "request ", id, " failed without an error code");
    }
    if (o.ok() && o.reference != 0) {
      CHECK_MESSAGE(o.token_list() == reference.at(o.reference), "request ", id, " (workload item ", o.reference, ")");
    }
  }
}

std::map<std::string, int> outcome_histogram(tracker& t) {
  std::map<std::string, int> h;
  for (auto& [id, o] : t.outcomes()) {
    ++h[o.rejection ? "rejected" : o.finish ? std::string(msg::to_string(o.finish->reason)) : "none"];
  }
  return h;
}

std::string histogram_text(const std::map<std::string, int>& h) {
  std::string s;
  for (const auto& [k, v] : h) s += k + "=" + std::to_string(v) + " ";
  return s;
}

}  // namespace

TEST_CASE("a transport fault list parses, and a bad item is refused by name") {
  uint64_t seed = 0;
  const auto faults = parse_transport_faults("drop:kv_chunk:0.05, delay:kv_confirm:200ms ,seed:9,drop:kv_moved", &seed);
  REQUIRE(faults.size() == 3);
  CHECK(faults[0].what == transport_fault::kind::drop);
  CHECK(faults[0].type == static_cast<uint16_t>(msg::type_id::kv_chunk));
  CHECK(faults[0].probability == doctest::Approx(0.05));
  CHECK(faults[1].what == transport_fault::kind::delay);
  CHECK(faults[1].type == static_cast<uint16_t>(msg::type_id::kv_confirm));
  CHECK(faults[1].delay_ms == 200);
  CHECK(faults[1].probability == 1.0);
  CHECK(faults[2].type == static_cast<uint16_t>(msg::type_id::kv_moved));
  CHECK(seed == 9);
  CHECK(parse_transport_faults("").empty());
  for (const char* bad : {"drop:kv_chunks", "drop:kv_chunk:1.5", "drop:kv_chunk:0", "delay:kv_chunk",
                          "delay:kv_chunk:soon", "lose:kv_chunk", "seed:x"}) {
    CHECK_THROWS_WITH_AS(parse_transport_faults(bad), doctest::Contains(bad), std::invalid_argument);
  }
}

TEST_CASE("three processes on the CPU engine stream KV between pools and leak nothing without faults") {
  const auto& reference = reference_tokens();
  CHECK(reference.size() == workload.size());
  deployment d({});
  REQUIRE(d.wait_ready(10s));
  tracker t(d.requests());
  submit_workload(t);
  REQUIRE(t.wait_all_final(20s));
  check_finals_and_tokens(t);
  for (auto& [id, o] : t.outcomes()) CHECK_MESSAGE(o.ok(), "request ", id, ": ", o.describe());
  std::string detail;
  CHECK_MESSAGE(d.wait_pools_full(all_pools, 3s, detail), detail);
  auto broker = d.counters("a/broker");
  CHECK(broker["transfers_tcp"] == workload.size());
}

TEST_CASE("a decode process killed mid-transfer: every request ends, the prefill pool is full again, "
          "and a restarted decode node serves the fault-free tokens") {
  deployment_params p;
  p.stream_window = 1;
  p.faults['c'] = "delay:kv_chunk_ack:20ms";  // ~20 ms per block: a 125-block transfer takes ~2.5 s
  deployment d(p);
  REQUIRE(d.wait_ready(10s));
  tracker t(d.requests());
  submit_workload(t);
  // Mid-transfer: the decode worker has received KV bytes, and no request is done yet.
  const bool streaming = t.wait_until(
      [&] {
        auto c = d.counters("c/decode0");
        return c["stream_bytes_received"] > 0;
      },
      10s);
  REQUIRE(streaming);
  const auto killed = steady::now();
  d.kill9('c');
  const auto before = outcome_histogram(t);
  // The router notices the silent worker after peer_timeout_ms (1 s) and answers for it.
  REQUIRE(t.wait_all_final(5s));
  const double finals_s = seconds_since(killed);
  check_finals_and_tokens(t);
  std::string detail;
  const auto full = d.wait_pools_full({"a/broker", "b/prefill0"}, 6s, detail);
  CHECK_MESSAGE(full, detail);
  const double recovered_s = seconds_since(killed);
  MESSAGE("decode killed mid-transfer: outcomes ", histogram_text(outcome_histogram(t)), "(before the kill: ",
          histogram_text(before), "); every final ", finals_s, " s after the kill, prefill pool full and no live "
          "handle ", recovered_s, " s after it");
  int failed = 0;
  for (auto& [id, o] : t.outcomes()) failed += !o.ok();
  CHECK(failed > 0);  // the kill did hit requests in flight

  d.start('c');
  REQUIRE(d.wait_ready(10s));
  tracker again(d.requests());
  for (const auto& w : workload) {
    again.submit(100 + w.id, prompt_of(w.length, static_cast<uint32_t>(w.id)), workload_new_tokens, false, w.id);
  }
  REQUIRE(again.wait_all_final(20s));
  for (const auto& w : workload) {
    const auto& o = again.at(100 + w.id);
    CHECK_MESSAGE(o.ok(), "after the restart, request ", w.id, ": ", o.describe());
    if (o.ok()) CHECK(o.token_list() == reference_tokens().at(w.id));
  }
  CHECK_MESSAGE(d.wait_pools_full(all_pools, 6s, detail), detail);
}

TEST_CASE("a prefill process killed after registering its KV: every request ends and the decode pool is full "
          "again") {
  deployment_params p;
  p.transfer_timeout_ms = 2500;
  p.faults['c'] = "delay:kv_pull:1200ms";  // adopted, blocks reserved, pull not yet at the broker
  deployment d(p);
  REQUIRE(d.wait_ready(10s));
  tracker t(d.requests());
  submit_workload(t);
  // Registered: the first token came back (prefill_done), so every handle is at the broker.
  REQUIRE(t.wait_until(
      [&] {
        return std::all_of(t.outcomes().begin(), t.outcomes().end(),
                           [](auto& kv) { return !kv.second.tokens.empty() || kv.second.final(); });
      },
      10s));
  const auto killed = steady::now();
  d.kill9('b');
  REQUIRE(t.wait_all_final(8s));
  const double finals_s = seconds_since(killed);
  check_finals_and_tokens(t);
  std::string detail;
  const auto full = d.wait_pools_full({"a/broker", "c/decode0"}, 6s, detail);
  CHECK_MESSAGE(full, detail);
  MESSAGE("prefill killed after registering: outcomes ", histogram_text(outcome_histogram(t)), "; every final ",
          finals_s, " s after the kill, decode pool full and no live handle ", seconds_since(killed),
          " s after it");
  for (auto& [id, o] : t.outcomes()) CHECK_MESSAGE(!o.ok(), "request ", id, " cannot have its KV: ", o.describe());

  d.start('b');
  REQUIRE(d.wait_ready(10s));
  tracker again(d.requests());
  again.submit(201, prompt_of(workload[0].length, 1), workload_new_tokens, false, 1);
  REQUIRE(again.wait_all_final(10s));
  CHECK_MESSAGE(again.at(201).ok(), again.at(201).describe());
  if (again.at(201).ok()) CHECK(again.at(201).token_list() == reference_tokens().at(1));
  CHECK_MESSAGE(d.wait_pools_full(all_pools, 6s, detail), detail);
}

namespace {

struct loss_case {
  const char* name;
  char node;            // the node whose transport loses the message
  std::string faults;
  const char* counted;  // log text of the injected fault
};

}  // namespace

TEST_CASE("lost kv_chunk, kv_chunk_ack, kv_confirm, kv_release or kv_moved: every request ends, successful ones "
          "with the fault-free tokens, and no block is leaked after the lease") {
  const std::vector<loss_case> cases = {
      {"kv_chunk", 'b', "seed:1,drop:kv_chunk:0.03", "dropped kv_chunk"},
      {"kv_chunk_ack", 'c', "seed:2,drop:kv_chunk_ack:0.03", "dropped kv_chunk_ack"},
      {"kv_confirm", 'c', "seed:3,drop:kv_confirm:0.5", "dropped kv_confirm"},
      {"kv_release", 'a', "seed:4,drop:kv_release:0.5", "dropped kv_release"},
      // kv_moved travels only on failures: the decode worker's renewals are lost and the
      // transfer outlasts the lease, so the broker expires the handle and tells the adopter
      // with kv_moved(timeout) — which is lost too.
      {"kv_moved", 'a', "drop:kv_moved", "dropped kv_moved"},
  };
  for (const auto& lc : cases) {
    SUBCASE(lc.name) {
      deployment_params p;
      p.faults[lc.node] = lc.faults;
      if (std::string(lc.name) == "kv_moved") {
        p.lease_ms = 800;
        p.stream_window = 1;
        p.faults['c'] = "drop:kv_renew,delay:kv_chunk_ack:20ms";
      }
      deployment d(p);
      REQUIRE(d.wait_ready(10s));
      tracker t(d.requests());
      const auto start = steady::now();
      submit_workload(t);
      // Bounded: a stalled transfer ends by transfer_timeout_ms after its last chunk.
      REQUIRE(t.wait_all_final(15s));
      const double finals_s = seconds_since(start);
      check_finals_and_tokens(t);
      const std::size_t injected = d.log_count(lc.node, lc.counted);
      CHECK_MESSAGE(injected > 0, "no ", std::string(lc.name), " was lost: the case proves nothing");
      // The owner's own reclaim is the slowest path: lease + its 2 s grace after the last renewal.
      std::string detail;
      const auto full = d.wait_pools_full(all_pools, std::chrono::milliseconds(p.lease_ms + 2000 + 3000), detail);
      CHECK_MESSAGE(full, detail);
      MESSAGE("lost ", std::string(lc.name), " (", injected, " injected): outcomes ", histogram_text(outcome_histogram(t)),
              "; all final within ", finals_s, " s; pools full ", full.value_or(-1), " s after that");
    }
  }
}

TEST_CASE("KV streamed during prefill with chunks and acks lost and delayed: every request ends, successful "
          "ones with the fault-free tokens, and no block is leaked") {
  deployment_params p;
  p.stream_prefill = "chunks";
  p.faults['b'] = "seed:6,drop:kv_chunk:0.02,delay:kv_chunk:30ms:0.05";
  p.faults['c'] = "seed:7,drop:kv_chunk_ack:0.02";
  deployment d(p);
  REQUIRE(d.wait_ready(10s));
  tracker t(d.requests());
  submit_workload(t);
  REQUIRE(t.wait_all_final(15s));
  check_finals_and_tokens(t);
  CHECK(d.log_count('b', "dropped kv_chunk") > 0);
  CHECK(d.log_count('c', "dropped kv_chunk_ack") > 0);
  std::string detail;
  const auto full = d.wait_pools_full(all_pools, std::chrono::milliseconds(p.lease_ms + 2000 + 3000), detail);
  CHECK_MESSAGE(full, detail);
  std::map<std::string, std::map<std::string, uint64_t>> counters;
  for (int attempt = 0; attempt < 10 && counters.size() < 2; ++attempt) {
    for (auto& r : d.observer().stats({"c/decode0", "b/prefill0"}, 1s)) {
      if (r.actor == "c/decode0" || r.actor == "b/prefill0") counters[r.actor] = r.counters;
    }
  }
  REQUIRE(counters.size() == 2);
  const uint64_t early = counters["c/decode0"]["early_adoptions"];
  CHECK(counters["b/prefill0"]["stream_prefill_streams"] == workload.size());  // every prompt began during prefill
  CHECK(early > 0);
  // Lost chunks were sent again after the adopter acked what it had.
  CHECK(counters["c/decode0"]["stream_gaps"] > 0);
  CHECK(counters["b/prefill0"]["stream_resends"] > 0);
  MESSAGE("decode: stream_gaps ", counters["c/decode0"]["stream_gaps"], ", prefill: stream_resends ",
          counters["b/prefill0"]["stream_resends"]);
  MESSAGE("streamed during prefill: outcomes ", histogram_text(outcome_histogram(t)), "; ", early,
          " adoptions found their KV begun; pools full ", full.value_or(-1), " s after the last final");
}

TEST_CASE("delayed and reordered KV messages: every request ends, successful ones with the fault-free tokens, "
          "and no block is leaked") {
  deployment_params p;
  p.faults['b'] = "seed:5,delay:kv_chunk:30ms:0.05";  // a delayed chunk arrives after its successors
  p.faults['c'] = "delay:kv_confirm:300ms,delay:kv_chunk_ack:5ms";
  p.faults['a'] = "delay:kv_release:300ms,delay:kv_send:100ms";
  deployment d(p);
  REQUIRE(d.wait_ready(10s));
  tracker t(d.requests());
  submit_workload(t);
  REQUIRE(t.wait_all_final(15s));
  check_finals_and_tokens(t);
  CHECK(d.log_count('b', "delayed kv_chunk") > 0);
  CHECK(d.log_count('c', "delayed kv_confirm") > 0);
  std::string detail;
  const auto full = d.wait_pools_full(all_pools, 6s, detail);
  CHECK_MESSAGE(full, detail);
  MESSAGE("delayed messages: outcomes ", histogram_text(outcome_histogram(t)), "; slowest final ",
          t.slowest_final_s(), " s; pools full ", full.value_or(-1), " s after the last final");
}

TEST_CASE("a request cancelled while queued for prefill, registering, registered, or transferring ends with "
          "reason cancelled and leaks nothing") {
  // Each stage is held for a while by a delay, so a cancel lands in it.
  deployment_params p;
  p.stream_window = 1;
  p.transfer_timeout_ms = 2500;  // above the delays: they hold a stage, they do not fail it
  // The lease starts at registration and the first renewal comes lease/3 after adoption: with
  // kv_registered held back 1 s, a 1.5 s lease would run out before it.
  p.lease_ms = 3000;
  p.faults['a'] = "delay:prefill_request:1000ms,delay:kv_registered:1000ms";
  p.faults['c'] = "delay:kv_pull:1000ms,delay:kv_chunk_ack:20ms";
  deployment d(p);
  REQUIRE(d.wait_ready(10s));
  tracker t(d.requests());
  const auto start = steady::now();
  // Timeline of each request: prefill_request arrives at ~1 s, kv_registered at ~2 s (first
  // token), the pull at ~3 s, then ~2.5 s of streaming (125 blocks x 20 ms).
  for (uint64_t id = 1; id <= 5; ++id) t.submit(id, prompt_of(2000, 40 + static_cast<uint32_t>(id)), 8);
  auto at = [&](double s) { return t.wait_until([&] { return seconds_since(start) >= s; }, 20s); };
  REQUIRE(at(0.4));
  t.cancel(1);  // queued: the prefill worker has not seen it
  REQUIRE(at(1.5));
  t.cancel(2);  // registering: the prefill worker waits for the broker's kv_registered
  REQUIRE(t.wait_until([&] { return !t.at(3).tokens.empty(); }, 5s));
  REQUIRE(at(seconds_since(start) + 0.4));
  t.cancel(3);  // registered and adopted: the decode worker's pull is on its way
  REQUIRE(t.wait_until([&] { return d.counters("c/decode0")["stream_bytes_received"] > 0; }, 5s));
  t.cancel(4);  // transferring
  REQUIRE(t.wait_all_final(10s));
  check_finals_and_tokens(t);
  for (uint64_t id = 1; id <= 4; ++id) {
    CHECK_MESSAGE(t.at(id).finish.has_value(), "request ", id, ": ", t.at(id).describe());
    if (t.at(id).finish) CHECK_MESSAGE(t.at(id).finish->reason == msg::finish_reason::cancelled, "request ", id, ": ", t.at(id).describe());
  }
  CHECK_MESSAGE(t.at(5).ok(), "request 5 (not cancelled): ", t.at(5).describe());
  std::string detail;
  const auto full = d.wait_pools_full(all_pools, 5s, detail);
  CHECK_MESSAGE(full, detail);
  MESSAGE("cancel in four states: finals after ", t.at(1).final_s, " / ", t.at(2).final_s, " / ", t.at(3).final_s,
          " / ", t.at(4).final_s, " s from submit; pools full ", full.value_or(-1), " s after the last final");
}

TEST_CASE("a request cancelled while waiting for decode memory or while decoding ends with reason cancelled and "
          "leaks nothing") {
  deployment_params p;
  p.decode_blocks = 160;  // one long generation fills it: the next adoption waits for memory
  deployment d(p);
  REQUIRE(d.wait_ready(10s));
  tracker t(d.requests());
  t.submit(1, prompt_of(500, 51), 2000, /*ignore_eos=*/true);  // 156 blocks, ~2000 decode steps
  REQUIRE(t.wait_until([&] { return t.at(1).tokens.size() >= 3; }, 10s));
  t.submit(2, prompt_of(100, 52), 8);
  REQUIRE(t.wait_until([&] { return !t.at(2).tokens.empty() || t.at(2).final(); }, 5s));
  REQUIRE(t.wait_until([&] { return d.counters("c/decode0")["adopted"] >= 2; }, 3s));
  t.cancel(2);  // waiting for memory (the pool is held by request 1)
  REQUIRE(t.wait_until([&] { return t.at(2).final(); }, 3s));
  CHECK_MESSAGE(t.at(2).finish->reason == msg::finish_reason::cancelled, t.at(2).describe());
  CHECK(t.at(2).final_s < 3.0);
  CHECK_FALSE(t.at(1).final());
  t.cancel(1);  // decoding
  REQUIRE(t.wait_until([&] { return t.at(1).final(); }, 3s));
  CHECK_MESSAGE(t.at(1).finish->reason == msg::finish_reason::cancelled, t.at(1).describe());
  CHECK(t.at(1).tokens.size() < 2000);
  check_finals_and_tokens(t);
  std::string detail;
  CHECK_MESSAGE(d.wait_pools_full(all_pools, 3s, detail), detail);
}

TEST_CASE("leases expire: a handle whose adopter stops renewing is reclaimed on the broker's timer, and the late "
          "pull is refused with a readable error") {
  deployment_params p;
  p.lease_ms = 600;
  p.transfer_timeout_ms = 3000;
  p.faults['c'] = "drop:kv_renew,delay:kv_pull:1500ms";  // the pull arrives after the lease ran out
  deployment d(p);
  REQUIRE(d.wait_ready(10s));
  tracker t(d.requests());
  const auto start = steady::now();
  submit_workload(t);
  REQUIRE(t.wait_all_final(10s));
  check_finals_and_tokens(t);
  for (auto& [id, o] : t.outcomes()) {
    REQUIRE_MESSAGE(o.finish.has_value(), "request ", id, ": ", o.describe());
    CHECK_MESSAGE(o.finish->reason == msg::finish_reason::error, "request ", id, ": ", o.describe());
    CHECK_MESSAGE(o.finish->code == msg::error_code::not_found, "request ", id, ": ", o.describe());
  }
  std::string detail;
  const auto full = d.wait_pools_full(all_pools, 5s, detail);
  CHECK_MESSAGE(full, detail);
  auto broker = d.counters("a/broker");
  CHECK(broker["lease_expiries"] == workload.size());
  MESSAGE("lease expiry: all final ", t.slowest_final_s(), " s after submit (", seconds_since(start),
          " s incl. pools full)");
}
