// Transport benchmarks (docs/benchmarks.md, "Transport and control plane"):
//   round_trip     A sends to B, B's deliver callback sends it back; per round trip, over
//                  inproc://, ipc:// and tcp://127.0.0.1, driven by a caller thread that
//                  waits for each reply (what an actor pays) or chained in the callbacks
//                  (the transport alone, no caller hand-off)
//   fan_in         one-way messages/s into one node from several sender nodes, counted at
//                  delivery (and through the local short-circuit, for reference)
//   codec          encode + decode of one message, no transport
//   client         client -> router node -> reply (an empty prompt, rejected by the router)
//   kv_chunk_stream the stream path's transport part: kv_chunk messages of 4 or 16 MiB one
//                  way, encoded and checksummed per message, 4 in flight, decoded and
//                  checked on arrival (GB/s)
//   kv_chunk_floor the same bytes in the same chunks through a bare socket of the same kind
//                  (a Unix stream socket for ipc://, TCP on loopback for tcp://), filled by
//                  memcpy as the stream's sender fills them, read whole by a second thread: the
//                  kernel's part alone, the floor the stream's GB/s is a ratio to
//   kv_checksum    kv_checksum (XXH3) over one chunk, which both ends of the stream compute
// Latencies are reported as percentiles of every round trip of a run (counters p50_us,
// p90_us, p99_us); run with --benchmark_repetitions to see the spread between runs.
#include <benchmark/benchmark.h>
#include <linux/futex.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <ctime>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "actors/node.hpp"
#include "runtime/client.hpp"
#include "runtime/config.hpp"
#include "runtime/kv_stream.hpp"
#include "runtime/transport.hpp"

using namespace duet;
using clock_type = std::chrono::steady_clock;

namespace {

// ------------------------------------------------------------------ helpers

enum class endpoint_kind : int { inproc = 0, ipc = 1, tcp = 2, local = 3 };

const char* kind_name(endpoint_kind kind) {
  switch (kind) {
    case endpoint_kind::inproc:
      return "inproc";
    case endpoint_kind::ipc:
      return "ipc";
    case endpoint_kind::tcp:
      return "tcp";
    case endpoint_kind::local:
      return "local";
  }
  return "unknown";
}

/// A TCP port on 127.0.0.1 that was free a moment ago (the kernel picked it).
int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(fd);
    throw std::runtime_error("cannot find a free TCP port");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::string endpoint_for(endpoint_kind kind, const std::string& tag) {
  // A fresh name every time: ZeroMQ releases an inproc name only once its reaper has closed
  // the socket, which can be after the next benchmark wants to bind it.
  static std::atomic<uint32_t> serial{0};
  const std::string stem =
      "duet-bench-" + std::to_string(::getpid()) + "-" + std::to_string(serial++) + "-" + tag;
  switch (kind) {
    case endpoint_kind::inproc:
    case endpoint_kind::local:
      return "inproc://" + stem;
    case endpoint_kind::ipc:
      return "ipc:///tmp/" + stem + ".sock";
    case endpoint_kind::tcp:
      return "tcp://127.0.0.1:" + std::to_string(free_tcp_port());
  }
  throw std::invalid_argument("endpoint kind");
}

/// A counter one thread bumps and another sleeps on (futex, with a bound on the wait).
class wait_counter {
 public:
  void add() {
    value_.fetch_add(1);
    if (sleepers_.load() != 0)
      ::syscall(SYS_futex, &value_, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
  }
  [[nodiscard]] uint32_t get() const { return value_.load(std::memory_order_acquire); }
  /// Waits until the value reaches `target`; false after `timeout`.
  bool wait_for(uint32_t target, std::chrono::milliseconds timeout) {
    const auto until = clock_type::now() + timeout;
    for (uint32_t seen = value_.load(); static_cast<int32_t>(seen - target) < 0;
         seen = value_.load()) {
      if (clock_type::now() >= until) return false;
      const timespec slice{0, 2'000'000};
      sleepers_.fetch_add(1);
      ::syscall(SYS_futex, &value_, FUTEX_WAIT_PRIVATE, seen, &slice, nullptr, 0);
      sleepers_.fetch_sub(1);
    }
    return true;
  }

 private:
  std::atomic<uint32_t> value_{0};
  std::atomic<uint32_t> sleepers_{0};
};

double process_cpu_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

/// Sets p50_us, p90_us and p99_us from round-trip samples in nanoseconds, and
/// cpu_us_per_round_trip: the CPU time of every thread of the process over the run, per
/// round trip (the work done, as opposed to the time spent waiting for threads to wake).
void report_round_trips(benchmark::State& state, std::vector<double>& samples_ns,
                        double process_cpu_s) {
  if (samples_ns.empty()) return;
  state.counters["cpu_us_per_round_trip"] =
      process_cpu_s * 1e6 / static_cast<double>(samples_ns.size());
  std::sort(samples_ns.begin(), samples_ns.end());
  auto at = [&](double q) {
    return samples_ns[std::min(
               samples_ns.size() - 1,
               static_cast<std::size_t>(q * static_cast<double>(samples_ns.size())))] /
           1e3;
  };
  state.counters["p50_us"] = at(0.50);
  state.counters["p90_us"] = at(0.90);
  state.counters["p99_us"] = at(0.99);
}

msg::frames small_message(const std::string& src, const std::string& dst) {
  msg::envelope env;
  env.src = src;
  env.dst = dst;
  return msg::encode(env, msg::cancel{42});
}

msg::token_batch token_batch_of(uint32_t tokens) {
  msg::token_batch batch;
  for (uint32_t i = 0; i < tokens; ++i) {
    batch.request_ids.push_back(1000 + i);
    batch.tokens.push_back(static_cast<int32_t>(7 * i + 3));
    batch.positions.push_back(i);
  }
  return batch;
}

/// arg 0: cancel (one uint64); arg 1: a token_batch of 64 tokens.
msg::frames message_of(int64_t which, const std::string& src, const std::string& dst) {
  if (which == 0) return small_message(src, dst);
  msg::envelope env;
  env.src = src;
  env.dst = dst;
  return msg::encode(env, token_batch_of(64));
}

transport_settings settings_for(std::string node, std::string endpoint,
                                std::map<std::string, std::string> peers, std::string actor) {
  transport_settings s;
  s.node = std::move(node);
  s.endpoint = std::move(endpoint);
  s.peers = std::move(peers);
  s.local_actors = {std::move(actor)};
  return s;
}

// ------------------------------------------------------------------ round trip

/// Two nodes, "a" and "b": b echoes every message back to its sender with a new envelope.
class echo_pair {
 public:
  explicit echo_pair(endpoint_kind kind) {
    const std::string ea = endpoint_for(kind, "a"), eb = endpoint_for(kind, "b");
    b_ = std::make_unique<transport>(settings_for("b", eb, {{"a", ea}}, "echo"),
                                     [this](msg::envelope&& env, msg::frames&& frames) {
                                       echo(std::move(env), std::move(frames));
                                     });
    a_ = std::make_unique<transport>(settings_for("a", ea, {{"b", eb}}, "echo"),
                                     [this](msg::envelope&&, msg::frames&&) { on_reply(); });
    b_->start();
    a_->start();
  }
  ~echo_pair() {
    a_->stop();
    b_->stop();
  }

  /// One round trip from this thread; nanoseconds, or a negative value when no reply came.
  double round_trip(const msg::frames& ping) {
    const uint32_t target = replies_.get() + 1;
    const auto start = clock_type::now();
    if (!a_->send({"b/echo", ping})) return -1;
    if (!replies_.wait_for(target, std::chrono::seconds(2))) return -1;
    return std::chrono::duration<double, std::nano>(clock_type::now() - start).count();
  }

  /// `count` round trips chained in the callbacks: a's deliver sends the next ping. Appends
  /// each round trip's nanoseconds to `samples`; false when the chain broke.
  bool chain(const msg::frames& ping, uint32_t count, std::vector<double>& samples) {
    chain_ping_ = ping;
    chain_stamps_.assign(count, clock_type::time_point{});
    chain_next_ = 0;
    chain_count_ = count;
    const uint32_t target = chain_done_.get() + 1;
    const auto start = clock_type::now();
    if (!a_->send({"b/echo", ping})) return false;
    const bool done = chain_done_.wait_for(target, std::chrono::seconds(10));
    chain_count_ = 0;
    if (!done) {
      a_->stop();  // the transport thread must not touch the chain state after this returns
      return false;
    }
    auto previous = start;
    for (const auto& t : chain_stamps_) {
      samples.push_back(std::chrono::duration<double, std::nano>(t - previous).count());
      previous = t;
    }
    return true;
  }

  [[nodiscard]] const transport& a() const { return *a_; }

 private:
  void echo(msg::envelope&& env, msg::frames&& frames) {
    env.dst = std::move(env.src);
    env.src = "b/echo";
    msgpack::sbuffer buffer;
    msgpack::pack(buffer, env);
    frames[0].assign(buffer.data(), buffer.size());
    [[maybe_unused]] bool queued = b_->send({env.dst, std::move(frames)});
  }

  // On a's transport thread.
  void on_reply() {
    if (chain_count_ == 0) {
      replies_.add();
      return;
    }
    chain_stamps_[chain_next_++] = clock_type::now();
    if (chain_next_ < chain_count_) {
      [[maybe_unused]] bool queued = a_->send({"b/echo", chain_ping_});
    } else {
      chain_done_.add();
    }
  }

  std::unique_ptr<transport> a_, b_;
  wait_counter replies_;
  // Chain state: written by the caller before the first ping, then only by a's thread.
  msg::frames chain_ping_;
  std::vector<clock_type::time_point> chain_stamps_;
  uint32_t chain_next_ = 0;
  std::atomic<uint32_t> chain_count_{0};
  wait_counter chain_done_;
};

std::map<endpoint_kind, std::unique_ptr<echo_pair>>& echo_pairs() {
  static std::map<endpoint_kind, std::unique_ptr<echo_pair>> pairs;
  return pairs;
}

/// The pair of this kind, built (and warmed up: connections made, hellos exchanged) once.
echo_pair& echo_pair_of(endpoint_kind kind) {
  auto& slot = echo_pairs()[kind];
  if (!slot) {
    slot = std::make_unique<echo_pair>(kind);
    const auto ping = small_message("a/echo", "b/echo");
    for (int i = 0; i < 200; ++i) {
      if (slot->round_trip(ping) < 0)
        throw std::runtime_error("echo pair: no reply during warm-up");
    }
  }
  return *slot;
}

/// Args: endpoint kind, message (0 cancel, 1 token_batch of 64).
void BM_round_trip(benchmark::State& state) {
  const auto kind = static_cast<endpoint_kind>(state.range(0));
  state.SetLabel(std::string(kind_name(kind)) +
                 (state.range(1) == 0 ? " cancel" : " token_batch/64"));
  auto& pair = echo_pair_of(kind);
  const auto ping = message_of(state.range(1), "a/echo", "b/echo");
  std::vector<double> samples;
  samples.reserve(1 << 16);
  const double cpu_start = process_cpu_seconds();
  for (auto _ : state) {
    const double ns = pair.round_trip(ping);
    if (ns < 0) {
      state.SkipWithError("no reply within 2 s");
      break;
    }
    state.SetIterationTime(ns * 1e-9);
    samples.push_back(ns);
  }
  report_round_trips(state, samples, process_cpu_seconds() - cpu_start);
}

/// Same, chained in the callbacks: each iteration is 1000 round trips, timed one by one.
void BM_round_trip_chained(benchmark::State& state) {
  const auto kind = static_cast<endpoint_kind>(state.range(0));
  state.SetLabel(std::string(kind_name(kind)) +
                 (state.range(1) == 0 ? " cancel" : " token_batch/64"));
  auto& pair = echo_pair_of(kind);
  const auto ping = message_of(state.range(1), "a/echo", "b/echo");
  constexpr uint32_t per_iteration = 1000;
  std::vector<double> samples;
  samples.reserve(1 << 16);
  const double cpu_start = process_cpu_seconds();
  for (auto _ : state) {
    const std::size_t before = samples.size();
    if (!pair.chain(ping, per_iteration, samples)) {
      echo_pairs().erase(kind);
      state.SkipWithError("the chain broke: a reply did not come");
      break;
    }
    double total = 0;
    for (std::size_t i = before; i < samples.size(); ++i) total += samples[i];
    state.SetIterationTime(total * 1e-9);
  }
  state.SetItemsProcessed(static_cast<int64_t>(samples.size()));
  report_round_trips(state, samples, process_cpu_seconds() - cpu_start);
}

// ------------------------------------------------------------------ fan-in throughput

/// One sink node and `senders` sender nodes, each with its own producer thread; the sink
/// counts deliveries. Kind `local`: the producers hand messages to the sink's own transport
/// for one of its local actors (the short-circuit, no socket).
class fan_in {
 public:
  fan_in(endpoint_kind kind, int senders) : kind_(kind) {
    const std::string sink_endpoint = endpoint_for(kind, "sink");
    std::map<std::string, std::string> sender_endpoints;
    if (kind != endpoint_kind::local) {
      for (int i = 0; i < senders; ++i)
        sender_endpoints["s" + std::to_string(i)] = endpoint_for(kind, "s" + std::to_string(i));
    }
    sink_ =
        std::make_unique<transport>(settings_for("sink", sink_endpoint, sender_endpoints, "count"),
                                    [this](msg::envelope&&, msg::frames&&) { delivered_.add(); });
    sink_->start();
    for (int i = 0; i < senders; ++i) {
      const std::string name = "s" + std::to_string(i);
      if (kind == endpoint_kind::local) {
        pings_.push_back(small_message("sink/emit", "sink/count"));
        continue;
      }
      senders_.push_back(std::make_unique<transport>(
          settings_for(name, sender_endpoints[name], {{"sink", sink_endpoint}}, "emit"),
          [](msg::envelope&&, msg::frames&&) {}));
      senders_.back()->start();
      pings_.push_back(small_message(name + "/emit", "sink/count"));
    }
  }
  ~fan_in() {
    for (auto& s : senders_) s->stop();
    sink_->stop();
  }

  /// Sends `total` messages spread over the producers, at most `window` in flight, and
  /// waits for every delivery. Returns the seconds it took, or a negative value on a loss.
  double run(uint32_t total, uint32_t window) {
    const uint32_t base = delivered_.get();
    const uint32_t producers = static_cast<uint32_t>(pings_.size());
    std::atomic<uint32_t> handed{0};
    const auto start = clock_type::now();
    std::vector<std::thread> threads;
    for (uint32_t p = 0; p < producers; ++p) {
      threads.emplace_back([&, p] {
        transport& via = kind_ == endpoint_kind::local ? *sink_ : *senders_[p];
        const uint32_t mine = total / producers + (p < total % producers ? 1 : 0);
        for (uint32_t i = 0; i < mine;) {
          if (handed.load(std::memory_order_relaxed) - (delivered_.get() - base) >= window) {
            std::this_thread::sleep_for(std::chrono::microseconds(20));
            continue;
          }
          if (via.send({"sink/count", pings_[p]})) {
            handed.fetch_add(1, std::memory_order_relaxed);
            ++i;
          } else {
            std::this_thread::sleep_for(std::chrono::microseconds(20));
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    const bool all = delivered_.wait_for(base + total, std::chrono::seconds(10));
    const double seconds = std::chrono::duration<double>(clock_type::now() - start).count();
    return all ? seconds : -1;
  }

 private:
  endpoint_kind kind_;
  std::unique_ptr<transport> sink_;
  std::vector<std::unique_ptr<transport>> senders_;
  std::vector<msg::frames> pings_;
  wait_counter delivered_;
};

/// Args: endpoint kind, sender nodes (producer threads).
void BM_fan_in(benchmark::State& state) {
  const auto kind = static_cast<endpoint_kind>(state.range(0));
  const int senders = static_cast<int>(state.range(1));
  state.SetLabel(std::string(kind_name(kind)) + " " + std::to_string(senders) + " senders, cancel");
  fan_in setup(kind, senders);
  if (setup.run(2000, 1000) < 0) {  // connect and exchange hellos before timing
    state.SkipWithError("warm-up messages were lost");
    return;
  }
  constexpr uint32_t per_iteration = 50000;
  double seconds = 0, cpu = 0;
  uint64_t messages = 0;
  for (auto _ : state) {
    const double cpu_before = process_cpu_seconds();
    const double s = setup.run(per_iteration, 20000);
    cpu += process_cpu_seconds() - cpu_before;
    if (s < 0) {
      state.SkipWithError("messages were lost");
      break;
    }
    state.SetIterationTime(s);
    seconds += s;
    messages += per_iteration;
  }
  state.SetItemsProcessed(static_cast<int64_t>(messages));
  if (seconds > 0) {
    state.counters["msgs_per_s"] = static_cast<double>(messages) / seconds;
    state.counters["cpu_us_per_msg"] = cpu * 1e6 / static_cast<double>(messages);
  }
}

// ------------------------------------------------------------------ KV chunk stream

/// The transport's share of the stream path (runtime/kv_stream.cpp): node s sends kv_chunk
/// messages, each filled, checksummed and encoded as kv_stream_sender does, `window` in flight
/// (counted at delivery, standing in for the acks); node d decodes each and checks its
/// checksum, as kv_stream_receiver does before writing the blocks.
class chunk_stream {
 public:
  explicit chunk_stream(endpoint_kind kind) {
    const std::string es = endpoint_for(kind, "s"), ed = endpoint_for(kind, "d");
    dst_ = std::make_unique<transport>(
        settings_for("d", ed, {{"s", es}}, "decode0"), [this](msg::envelope&&, msg::frames&& frames) {
          auto chunk = msg::decode_body<msg::kv_chunk>(std::move(frames));
          if (!chunk || kv_checksum(std::as_bytes(std::span(chunk->bytes))) != chunk->checksum) bad_.fetch_add(1);
          delivered_.add();
        });
    src_ = std::make_unique<transport>(settings_for("s", es, {{"d", ed}}, "prefill0"),
                                       [](msg::envelope&&, msg::frames&&) {});
    dst_->start();
    src_->start();
  }
  ~chunk_stream() {
    src_->stop();
    dst_->stop();
  }

  /// Seconds to move `count` chunks of `chunk_bytes`, or a negative value when one was lost
  /// or arrived corrupted.
  double run(uint32_t count, std::size_t chunk_bytes, uint32_t window) {
    if (payload_.size() != chunk_bytes) {
      payload_.resize(chunk_bytes);
      uint64_t x = 0x9E3779B97F4A7C15ull;
      for (auto& b : payload_) b = static_cast<std::byte>((x = x * 6364136223846793005ull + 1) >> 56);
    }
    const uint32_t base = delivered_.get();
    const auto start = clock_type::now();
    for (uint32_t i = 0; i < count;) {
      if (i - (delivered_.get() - base) >= window) {
        if (!delivered_.wait_for(base + i + 1 - window, std::chrono::seconds(10))) return -1;
        continue;
      }
      msg::kv_chunk chunk;
      chunk.handle_id = 1;
      chunk.first = i;
      chunk.count = 1;
      chunk.total = count;
      chunk.bytes.resize(payload_.size());  // as the sender's read fills each chunk's fresh bytes
      std::memcpy(chunk.bytes.data(), payload_.data(), payload_.size());
      chunk.checksum = kv_checksum(std::as_bytes(std::span(chunk.bytes)));
      msg::envelope env;
      env.src = "s/prefill0";
      env.dst = "d/decode0";
      if (src_->send({"d/decode0", msg::encode(env, std::move(chunk))})) {
        ++i;
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
    const bool all = delivered_.wait_for(base + count, std::chrono::seconds(30));
    const double seconds = std::chrono::duration<double>(clock_type::now() - start).count();
    return all && bad_.load() == 0 ? seconds : -1;
  }

 private:
  std::unique_ptr<transport> src_, dst_;
  std::vector<std::byte> payload_;
  wait_counter delivered_;
  std::atomic<uint32_t> bad_{0};
};

/// Args: endpoint kind, chunk MiB.
void BM_kv_chunk_stream(benchmark::State& state) {
  const auto kind = static_cast<endpoint_kind>(state.range(0));
  const auto chunk_bytes = static_cast<std::size_t>(state.range(1)) << 20;
  state.SetLabel(std::string(kind_name(kind)) + " " + std::to_string(state.range(1)) + " MiB chunks, 4 in flight");
  chunk_stream setup(kind);
  if (setup.run(8, chunk_bytes, 4) < 0) {  // connect and exchange hellos before timing
    state.SkipWithError("warm-up chunks were lost");
    return;
  }
  const auto per_iteration = static_cast<uint32_t>((256ull << 20) / chunk_bytes);  // 256 MiB
  double seconds = 0;
  uint64_t bytes = 0;
  for (auto _ : state) {
    const double s = setup.run(per_iteration, chunk_bytes, 4);
    if (s < 0) {
      state.SkipWithError("chunks were lost or corrupted");
      break;
    }
    state.SetIterationTime(s);
    seconds += s;
    bytes += uint64_t{per_iteration} * chunk_bytes;
  }
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  if (seconds > 0) state.counters["GB_per_s"] = static_cast<double>(bytes) / seconds / 1e9;
}

/// A connected pair of stream sockets: a Unix socket pair (ipc:// is a Unix stream socket) or
/// TCP on 127.0.0.1. Throws when the kernel refuses one.
std::pair<int, int> socket_pair(endpoint_kind kind) {
  if (kind == endpoint_kind::ipc) {
    int fds[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) throw std::runtime_error("socketpair failed");
    return {fds[0], fds[1]};
  }
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (listener < 0 || ::bind(listener, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      ::listen(listener, 1) != 0 || ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    throw std::runtime_error("loopback listener failed");
  const int writer = ::socket(AF_INET, SOCK_STREAM, 0);
  if (writer < 0 || ::connect(writer, reinterpret_cast<sockaddr*>(&addr), len) != 0)
    throw std::runtime_error("loopback connect failed");
  const int reader = ::accept(listener, nullptr, nullptr);
  ::close(listener);
  if (reader < 0) throw std::runtime_error("loopback accept failed");
  return {writer, reader};
}

/// Seconds to write `count` chunks of `source`'s size through `writer` (each first copied into
/// a fresh buffer, as the stream's sender fills a chunk) while a thread reads them from
/// `reader`; negative when a byte went missing.
double raw_socket_run(int writer, int reader, const std::vector<std::byte>& source, uint32_t count) {
  const uint64_t total = uint64_t{count} * source.size();
  uint64_t received = 0;
  std::thread drain([&] {
    std::vector<std::byte> sink(source.size());
    while (received < total) {
      const ssize_t n = ::read(reader, sink.data(), std::min<uint64_t>(sink.size(), total - received));
      if (n <= 0) return;
      received += static_cast<uint64_t>(n);
    }
  });
  const auto start = clock_type::now();
  std::vector<std::byte> chunk(source.size());
  bool ok = true;
  for (uint32_t i = 0; i < count && ok; ++i) {
    std::memcpy(chunk.data(), source.data(), source.size());
    for (std::size_t sent = 0; sent < chunk.size();) {
      const ssize_t n = ::write(writer, chunk.data() + sent, chunk.size() - sent);
      if (n <= 0) {
        ok = false;
        break;
      }
      sent += static_cast<std::size_t>(n);
    }
  }
  if (!ok) ::shutdown(writer, SHUT_RDWR);
  drain.join();
  const double seconds = std::chrono::duration<double>(clock_type::now() - start).count();
  return ok && received == total ? seconds : -1;
}

/// Args: endpoint kind (1 ipc, 2 tcp), chunk MiB. The floor of BM_kv_chunk_stream with the
/// same args: the same bytes per iteration through the bare socket.
void BM_kv_chunk_floor(benchmark::State& state) {
  const auto kind = static_cast<endpoint_kind>(state.range(0));
  const auto chunk_bytes = static_cast<std::size_t>(state.range(1)) << 20;
  state.SetLabel(std::string(kind == endpoint_kind::ipc ? "unix socket" : "tcp socket") + " " +
                 std::to_string(state.range(1)) + " MiB chunks");
  std::vector<std::byte> source(chunk_bytes);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& b : source) b = static_cast<std::byte>((x = x * 6364136223846793005ull + 1) >> 56);
  const auto [writer, reader] = socket_pair(kind);
  const auto per_iteration = static_cast<uint32_t>((256ull << 20) / chunk_bytes);  // 256 MiB
  double seconds = 0;
  uint64_t bytes = 0;
  if (raw_socket_run(writer, reader, source, 2) < 0) state.SkipWithError("warm-up bytes were lost");
  for (auto _ : state) {
    const double s = raw_socket_run(writer, reader, source, per_iteration);
    if (s < 0) {
      state.SkipWithError("bytes were lost");
      break;
    }
    state.SetIterationTime(s);
    seconds += s;
    bytes += uint64_t{per_iteration} * chunk_bytes;
  }
  ::close(writer);
  ::close(reader);
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  if (seconds > 0) state.counters["GB_per_s"] = static_cast<double>(bytes) / seconds / 1e9;
}

/// Arg: chunk MiB. kv_checksum over one chunk (both ends of the stream compute it).
void BM_kv_checksum(benchmark::State& state) {
  std::vector<std::byte> chunk(static_cast<std::size_t>(state.range(0)) << 20);
  uint64_t x = 1;
  for (auto& b : chunk) b = static_cast<std::byte>((x = x * 6364136223846793005ull + 1) >> 56);
  for (auto _ : state) benchmark::DoNotOptimize(kv_checksum(std::as_bytes(std::span(chunk))));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(chunk.size()));
}

// ------------------------------------------------------------------ codec

template <class M>
void codec_round_trip(benchmark::State& state, const M& message) {
  msg::envelope env;
  env.src = "n1/decode0";
  env.dst = "n1/client-4242-123456";
  std::size_t bytes = 0;
  for (auto _ : state) {
    auto frames = msg::encode(env, message);
    auto decoded_env = msg::decode_envelope(frames);
    auto body = msg::decode_body<M>(frames);
    if (!decoded_env || !body) {
      state.SkipWithError("decode failed");
      break;
    }
    benchmark::DoNotOptimize(body->raw());
    for (const auto& f : frames) bytes += f.size();
  }
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
}

void BM_codec_cancel(benchmark::State& state) {
  codec_round_trip(state, msg::cancel{42});
}
void BM_codec_token_batch_64(benchmark::State& state) {
  codec_round_trip(state, token_batch_of(64));
}
void BM_codec_submit_512(benchmark::State& state) {
  msg::submit s;
  s.request_id = 7;
  s.prompt_tokens.assign(512, 1234);
  s.sampling.max_new_tokens = 128;
  codec_round_trip(state, s);
}
void BM_codec_kv_adopt_512(benchmark::State& state) {
  msg::kv_adopt a;
  a.seq_id = 9;
  a.handle_id = 9;
  a.layout_hash = 0x1234567890abcdefull;
  a.client = "n1/client-4242-123456";
  a.request_id = 7;
  a.first_token = 11;
  a.prompt.assign(512, 1234);
  codec_round_trip(state, a);
}

// ------------------------------------------------------------------ client round trip

/// A live single-node deployment (sim engine, time_scale 0) in this process and one client.
class live_node {
 public:
  explicit live_node(endpoint_kind kind) : config_(default_config()) {
    config_.engine.time_scale = 0.0;
    config_.nodes.at(0).endpoint = endpoint_for(kind, "node");
    system_ = std::make_unique<caf::actor_system>(system_config_);
    node_ = std::make_unique<node>(*system_, config_, config_.nodes.at(0).name);
    client_ = std::make_unique<client>(node_->endpoint(), config_.nodes.at(0).name + "/router");
  }
  ~live_node() {
    client_.reset();
    node_->stop();
    node_.reset();
    system_.reset();
  }

  /// Submits an empty prompt and waits for the router's rejection: nanoseconds, or < 0.
  double round_trip() {
    msg::submit s;
    s.request_id = ++request_id_;
    const auto start = clock_type::now();
    if (!client_->submit(s)) return -1;
    const auto until = start + std::chrono::seconds(2);
    while (clock_type::now() < until) {
      for (const auto& e : client_->poll(std::chrono::milliseconds(100))) {
        if (e.request_id == s.request_id && e.what == client_event::kind::rejected) {
          return std::chrono::duration<double, std::nano>(clock_type::now() - start).count();
        }
      }
    }
    return -1;
  }

 private:
  deployment_config config_;
  caf::actor_system_config system_config_;
  std::unique_ptr<caf::actor_system> system_;
  std::unique_ptr<node> node_;
  std::unique_ptr<client> client_;
  uint64_t request_id_ = 0;
};

std::map<endpoint_kind, std::unique_ptr<live_node>>& live_nodes() {
  static std::map<endpoint_kind, std::unique_ptr<live_node>> nodes;
  return nodes;
}

/// Arg: endpoint kind of the node (the client connects to it).
void BM_client_round_trip(benchmark::State& state) {
  const auto kind = static_cast<endpoint_kind>(state.range(0));
  state.SetLabel(std::string(kind_name(kind)) + " submit -> rejected");
  auto& slot = live_nodes()[kind];
  if (!slot) {
    slot = std::make_unique<live_node>(kind);
    for (int i = 0; i < 200; ++i) {
      if (slot->round_trip() < 0) {
        state.SkipWithError("the node did not answer during warm-up");
        return;
      }
    }
  }
  std::vector<double> samples;
  samples.reserve(1 << 16);
  const double cpu_start = process_cpu_seconds();
  for (auto _ : state) {
    const double ns = slot->round_trip();
    if (ns < 0) {
      state.SkipWithError("no rejection within 2 s");
      break;
    }
    state.SetIterationTime(ns * 1e-9);
    samples.push_back(ns);
  }
  report_round_trips(state, samples, process_cpu_seconds() - cpu_start);
}

void kinds_and_messages(benchmark::internal::Benchmark* b) {
  for (int kind : {0, 1, 2}) {
    for (int message : {0, 1}) b->Args({kind, message});
  }
}

}  // namespace

BENCHMARK(BM_round_trip)->Apply(kinds_and_messages)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_round_trip_chained)
    ->Apply(kinds_and_messages)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_fan_in)
    ->Args({0, 4})
    ->Args({1, 1})
    ->Args({1, 4})
    ->Args({2, 4})
    ->Args({3, 4})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_kv_chunk_stream)
    ->Args({1, 4})
    ->Args({2, 4})
    ->Args({1, 16})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_kv_chunk_floor)
    ->Args({1, 4})
    ->Args({2, 4})
    ->Args({1, 16})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_kv_checksum)->Arg(4)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_codec_cancel);
BENCHMARK(BM_codec_token_batch_64);
BENCHMARK(BM_codec_submit_512);
BENCHMARK(BM_codec_kv_adopt_512);
BENCHMARK(BM_client_round_trip)
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  [[maybe_unused]] auto& context = zmq_context();  // outlives every socket the benchmarks open
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  live_nodes().clear();
  echo_pairs().clear();
  benchmark::Shutdown();
  return 0;
}
