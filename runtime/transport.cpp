#include "runtime/transport.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <stdexcept>

#include <zmq_addon.hpp>

namespace duet {

zmq::context_t& zmq_context() {
  static zmq::context_t context(1);
  return context;
}

namespace {
constexpr char hex_digits[] = "0123456789abcdef";

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  for (std::size_t start = 0;;) {
    const auto end = s.find(sep, start);
    out.push_back(trim(s.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start)));
    if (end == std::string_view::npos) return out;
    start = end + 1;
  }
}

template <class T>
bool parse_number(std::string_view s, T& out) {
  const auto r = std::from_chars(s.data(), s.data() + s.size(), out);
  return r.ec == std::errc{} && r.ptr == s.data() + s.size();
}

bool parse_probability(std::string_view s, double& out) {
  // from_chars for double is in libstdc++ 11+; strtod keeps older toolchains working.
  const std::string text(s);
  char* end = nullptr;
  out = std::strtod(text.c_str(), &end);
  return !text.empty() && end == text.c_str() + text.size() && out > 0.0 && out <= 1.0;
}
}  // namespace

std::vector<transport_fault> parse_transport_faults(std::string_view text, uint64_t* seed) {
  std::vector<transport_fault> faults;
  if (trim(text).empty()) return faults;
  for (const auto item : split(text, ',')) {
    const auto bad = [&](const std::string& why) {
      return std::invalid_argument("transport fault '" + std::string(item) + "': " + why);
    };
    const auto parts = split(item, ':');
    if (parts[0] == "seed") {
      uint64_t value = 0;
      if (parts.size() != 2 || !parse_number(parts[1], value)) throw bad("write seed:N");
      if (seed) *seed = value;
      continue;
    }
    transport_fault f;
    if (parts[0] == "drop") f.what = transport_fault::kind::drop;
    else if (parts[0] == "delay") f.what = transport_fault::kind::delay;
    else throw bad("starts with drop, delay or seed");
    const std::size_t fixed = f.what == transport_fault::kind::drop ? 2 : 3;
    if (parts.size() != fixed && parts.size() != fixed + 1) {
      throw bad(f.what == transport_fault::kind::drop ? "write drop:TYPE[:PROBABILITY]"
                                                      : "write delay:TYPE:MILLISECONDSms[:PROBABILITY]");
    }
    bool known = false;
    for (uint32_t id = 0; id < 256 && !known; ++id) {
      if (msg::to_string(static_cast<msg::type_id>(id)) == parts[1]) {
        f.type = static_cast<uint16_t>(id);
        known = true;
      }
    }
    if (!known) throw bad("'" + std::string(parts[1]) + "' is not a message type of docs/protocol.md");
    if (f.what == transport_fault::kind::delay) {
      std::string_view ms = parts[2];
      if (ms.ends_with("ms")) ms.remove_suffix(2);
      if (!parse_number(ms, f.delay_ms)) throw bad("the delay is a whole number of milliseconds, e.g. 200ms");
    }
    if (parts.size() == fixed + 1 && !parse_probability(parts[fixed], f.probability)) {
      throw bad("the probability is a number in (0, 1]");
    }
    faults.push_back(f);
  }
  return faults;
}

std::string transport::client_name(const std::string& identity) const {
  const bool plain = !identity.empty() && identity[0] != '~' && !settings_.local_actors.contains(identity) &&
                     std::all_of(identity.begin(), identity.end(), [](char c) {
                       return c > ' ' && c < 127 && c != '/';
                     });
  if (plain) return identity;
  std::string out = "~";  // ZeroMQ's generated binary ids, and names we must not alias
  for (unsigned char c : identity) {
    out += hex_digits[c >> 4];
    out += hex_digits[c & 15];
  }
  return out;
}

std::string transport::client_identity(const std::string& name) {
  if (name.empty() || name[0] != '~') return name;
  std::string out;
  for (std::size_t i = 1; i + 1 < name.size(); i += 2) {
    auto nibble = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
    out += static_cast<char>(nibble(name[i]) << 4 | nibble(name[i + 1]));
  }
  return out;
}

transport::transport(transport_settings settings, deliver_fn deliver)
    : settings_(std::move(settings)), deliver_(std::move(deliver)) {
  std::string faults = settings_.faults;
  if (faults.empty()) {
    if (const char* env = std::getenv(transport_fault_env)) faults = env;
  }
  uint64_t seed = std::hash<std::string>{}(settings_.node);
  try {
    faults_ = parse_transport_faults(faults, &seed);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string(settings_.faults.empty() ? transport_fault_env : "faults") + ": " +
                                e.what());
  }
  fault_rng_.seed(seed);
  if (!faults_.empty()) {
    std::fprintf(stderr, "duet node %s: transport fault injection on (%s)\n", settings_.node.c_str(),
                 faults.c_str());
  }
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) throw std::runtime_error("transport: eventfd failed");
}

transport::~transport() {
  stop();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void transport::start() {
  if (running_.exchange(true)) return;
  std::promise<std::string> bound;
  auto result = bound.get_future();
  bind_result_ = &bound;
  thread_ = std::thread([this] { run(); });
  const std::string error = result.get();
  if (!error.empty()) {
    thread_.join();
    running_ = false;
    throw std::runtime_error("node '" + settings_.node + "' cannot bind " + settings_.endpoint + ": " + error);
  }
}

void transport::stop() {
  if (!running_.exchange(false)) return;
  const uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof one);
  if (thread_.joinable()) thread_.join();
}

std::string transport::bound_endpoint() const {
  std::lock_guard lock(mutex_);
  return bound_;
}

bool transport::send(outgoing message) {
  const auto slash = message.dst.find('/');
  if (slash == std::string::npos) {
    ++counters_.unroutable;
    return false;
  }
  const bool local = std::string_view(message.dst).substr(0, slash) == settings_.node &&
                     settings_.local_actors.contains(message.dst.substr(slash + 1));
  if (!faults_.empty() && inject_fault(message, local)) return true;
  if (local) {
    deliver_local(std::move(message.frames));
    return true;
  }
  std::lock_guard lock(mutex_);
  if (queue_.size() >= settings_.queue_limit) {
    ++counters_.dropped_queue_full;
    return false;
  }
  // Only the message that makes the queue non-empty wakes the thread, which then drains the
  // whole queue: no syscall per message under load. The write stays inside the lock, so no
  // later sender can see the queue non-empty before its wake-up is on its way.
  const bool wake = queue_.empty();
  queue_.push_back(std::move(message));
  if (wake) {
    const uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof one);
  }
  return true;
}

bool transport::inject_fault(outgoing& message, bool local) {
  const auto env = msg::decode_envelope(message.frames);
  if (!env) return false;
  std::lock_guard lock(mutex_);
  for (const auto& f : faults_) {
    if (f.type != env->type) continue;
    if (f.probability < 1.0 && std::uniform_real_distribution<double>(0.0, 1.0)(fault_rng_) >= f.probability) continue;
    const bool drop = f.what == transport_fault::kind::drop;
    ++(drop ? counters_.fault_dropped : counters_.fault_delayed);
    // One stderr line per fault (the first 200): tests and people read what was injected.
    if (++fault_logged_ <= 200) {
      std::fprintf(stderr, "duet node %s: transport fault: %s %s to %s%s\n", settings_.node.c_str(),
                   drop ? "dropped" : "delayed", std::string(msg::to_string(static_cast<msg::type_id>(env->type))).c_str(),
                   message.dst.c_str(), fault_logged_ == 200 ? " (further faults are counted, not logged)" : "");
    }
    if (drop) return true;
    delayed_.push_back({std::chrono::steady_clock::now() + std::chrono::milliseconds(f.delay_ms), local,
                        std::move(message)});
    const uint64_t one = 1;  // the thread recomputes its wait
    [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof one);
    return true;
  }
  return false;
}

int64_t transport::release_delayed(zmq::socket_t& router) {
  std::vector<delayed_message> due;
  int64_t next_ms = -1;
  {
    std::lock_guard lock(mutex_);
    if (delayed_.empty()) return -1;
    const auto now = std::chrono::steady_clock::now();
    std::vector<delayed_message> later;
    for (auto& d : delayed_) {
      if (d.due <= now) {
        due.push_back(std::move(d));
        continue;
      }
      const int64_t wait =
          std::chrono::ceil<std::chrono::milliseconds>(d.due - now).count();
      next_ms = next_ms < 0 ? wait : std::min(next_ms, wait);
      later.push_back(std::move(d));
    }
    delayed_.swap(later);
  }
  // In the order they were held back, so equal delays keep their order.
  for (auto& d : due) {
    if (d.local) deliver_local(std::move(d.message.frames));
    else route(router, d.message);
  }
  return next_ms;
}

void transport::deliver_local(msg::frames&& frames) {
  auto env = msg::decode_envelope(frames);
  if (!env) {
    ++counters_.malformed;
    return;
  }
  ++counters_.delivered_locally;
  deliver_(std::move(*env), std::move(frames));
}

void transport::run() {
  zmq::socket_t router(zmq_context(), zmq::socket_type::router);
  try {
    router.set(zmq::sockopt::router_mandatory, 1);
    router.set(zmq::sockopt::router_handover, 1);
    router.set(zmq::sockopt::linger, 0);
    router.set(zmq::sockopt::sndhwm, settings_.send_hwm);
    router.set(zmq::sockopt::rcvhwm, settings_.send_hwm);
    router.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(settings_.max_frame_bytes));
    router.bind(settings_.endpoint);
    {
      std::lock_guard lock(mutex_);
      bound_ = router.get(zmq::sockopt::last_endpoint);
    }
    bind_result_->set_value({});
  } catch (const zmq::error_t& e) {
    bind_result_->set_value(e.what());
    return;
  }
  int64_t next_delayed_ms = -1;
  while (running_) {
    zmq::pollitem_t items[] = {{router.handle(), 0, ZMQ_POLLIN, 0}, {nullptr, wake_fd_, ZMQ_POLLIN, 0}};
    const int64_t wait_ms = next_delayed_ms < 0 ? 100 : std::min<int64_t>(100, next_delayed_ms);
    try {
      zmq::poll(items, 2, std::chrono::milliseconds(wait_ms));
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;
      throw;
    }
    if (items[1].revents & ZMQ_POLLIN) {
      uint64_t value;
      [[maybe_unused]] auto n = ::read(wake_fd_, &value, sizeof value);
    }
    if (items[0].revents & ZMQ_POLLIN) receive(router);
    drain_outbound(router);
    send_hellos_if_due();
    if (!faults_.empty()) next_delayed_ms = release_delayed(router);
  }
  peer_sockets_.clear();
}

void transport::receive(zmq::socket_t& router) {
  // Bounded batch so a flood on the socket cannot starve outbound traffic.
  std::vector<zmq::message_t> parts;  // reused: one allocation per batch, not per message
  for (int i = 0; i < 256; ++i) {
    parts.clear();
    auto got = zmq::recv_multipart(router, std::back_inserter(parts), zmq::recv_flags::dontwait);
    if (!got) return;
    ++counters_.received;
    if (parts.size() < 3 || parts.size() > 9) {
      ++counters_.malformed;
      continue;
    }
    const std::string identity = parts[0].to_string();
    msg::frames frames;
    frames.reserve(parts.size() - 1);
    for (std::size_t p = 1; p < parts.size(); ++p) frames.push_back(parts[p].to_string());
    msg::codec_limits limits;
    limits.max_frame_bytes = settings_.max_frame_bytes;
    auto env = msg::decode_envelope(frames, limits);
    if (!env) {
      ++counters_.malformed;
      continue;
    }
    const auto src = msg::parse_address(env->src);
    const auto dst = msg::parse_address(env->dst);
    if (src.empty() || dst.empty()) {
      ++counters_.malformed;
      continue;
    }
    const bool from_peer = settings_.peers.contains(src.node) && identity == src.node;
    if (from_peer && env->type == static_cast<uint16_t>(msg::type_id::hello)) {
      auto hello = msg::decode_body<msg::hello>(frames, limits);
      if (!hello) {
        ++counters_.malformed;
        continue;
      }
      on_hello(src.node, *hello);
      continue;
    }
    if (from_peer) {
      if (auto it = peer_compatible_.find(src.node); it != peer_compatible_.end() && !it->second) {
        ++counters_.refused_incompatible;
        continue;
      }
    } else {
      // A client: stamp the return address, so replies from any node find their way back.
      env->src = settings_.node + "/" + client_name(identity);
      msgpack::sbuffer buffer;
      msgpack::pack(buffer, *env);
      frames[0].assign(buffer.data(), buffer.size());
    }
    if (dst.node != settings_.node) {
      if (!from_peer && settings_.peers.contains(dst.node)) {
        outgoing relay{env->dst, std::move(frames)};
        route(router, relay);
      } else {
        ++counters_.unroutable;
      }
      continue;
    }
    if (!settings_.local_actors.contains(dst.actor)) {
      if (from_peer) {  // another node answering one of our clients
        outgoing to_client{env->dst, std::move(frames)};
        route(router, to_client);
      } else {
        ++counters_.unroutable;
      }
      continue;
    }
    deliver_(std::move(*env), std::move(frames));
  }
}

zmq::socket_t& transport::peer_socket(const std::string& node, const std::string& endpoint) {
  auto it = peer_sockets_.find(node);
  if (it != peer_sockets_.end()) return it->second;
  zmq::socket_t socket(zmq_context(), zmq::socket_type::dealer);
  socket.set(zmq::sockopt::routing_id, settings_.node);
  socket.set(zmq::sockopt::linger, 0);
  socket.set(zmq::sockopt::sndhwm, settings_.send_hwm);
  socket.set(zmq::sockopt::reconnect_ivl, 100);
  socket.set(zmq::sockopt::reconnect_ivl_max, 1000);
  socket.connect(endpoint);
  auto& placed = peer_sockets_.emplace(node, std::move(socket)).first->second;
  // hello goes first on every new connection, so the peer can refuse a mismatch.
  send_hello(placed, node);
  return placed;
}

void transport::send_hello(zmq::socket_t& socket, const std::string& node) {
  msg::envelope env;
  env.src = settings_.node + "/transport";
  env.dst = node + "/transport";
  auto hello = msg::encode(env, msg::hello{settings_.node, msg::protocol_version, settings_.compat_hash,
                                           static_cast<int64_t>(::getpid())});
  std::vector<zmq::const_buffer> parts;
  for (const auto& f : hello) parts.emplace_back(f.data(), f.size());
  [[maybe_unused]] auto sent = zmq::send_multipart(socket, parts, zmq::send_flags::dontwait);
}

void transport::on_hello(const std::string& node, const msg::hello& hello) {
  const bool compatible = hello.protocol == msg::protocol_version && hello.compat_hash == settings_.compat_hash;
  peer_compatible_[node] = compatible;
  // Hellos are counted apart: they repeat every heartbeat, refused_incompatible counts messages.
  if (!compatible) ++counters_.incompatible_hellos;
  // A new process behind a known name: our DEALER reconnected to it without a word, so it has
  // not checked us yet.
  auto [it, first] = peer_pid_.try_emplace(node, hello.pid);
  if (!first && it->second != hello.pid) {
    it->second = hello.pid;
    if (auto socket = peer_sockets_.find(node); socket != peer_sockets_.end()) send_hello(socket->second, node);
  }
}

void transport::send_hellos_if_due() {
  if (settings_.hello_interval_ms == 0) return;
  const auto now = std::chrono::steady_clock::now();
  if (now < next_hellos_) return;
  next_hellos_ = now + std::chrono::milliseconds(settings_.hello_interval_ms);
  for (auto& [node, socket] : peer_sockets_) send_hello(socket, node);
}

void transport::drain_outbound(zmq::socket_t& router) {
  std::deque<outgoing> batch;
  {
    std::lock_guard lock(mutex_);
    batch.swap(queue_);
  }
  for (auto& message : batch) route(router, message);
}

namespace {

/// Frames from this size up leave without a copy (KV chunks: megabytes each).
constexpr std::size_t zero_copy_frame_bytes = 64 * 1024;

/// A zmq message of `frame`: a small one copies it; a large one takes it over, sent from its
/// own bytes by zmq's I/O thread and freed there once sent (or when the send fails).
zmq::message_t frame_message(std::string& frame) {
  if (frame.size() < zero_copy_frame_bytes) return zmq::message_t(frame.data(), frame.size());
  auto* owned = new std::string(std::move(frame));
  return zmq::message_t(
      owned->data(), owned->size(), [](void*, void* hint) { delete static_cast<std::string*>(hint); },
      owned);
}

}  // namespace

void transport::route(zmq::socket_t& router, outgoing& message) {
  const std::string node = message.dst.substr(0, message.dst.find('/'));
  std::vector<zmq::message_t> parts;
  parts.reserve(message.frames.size() + 1);
  try {
    if (auto peer = settings_.peers.find(node); peer != settings_.peers.end()) {
      for (auto& f : message.frames) parts.push_back(frame_message(f));
      if (zmq::send_multipart(peer_socket(node, peer->second), parts, zmq::send_flags::dontwait)) {
        ++counters_.sent;
      } else {
        ++counters_.dropped_peer_busy;
      }
      return;
    }
    if (node != settings_.node) {
      ++counters_.unroutable;
      return;
    }
    const std::string identity = client_identity(message.dst.substr(message.dst.find('/') + 1));
    parts.emplace_back(identity.data(), identity.size());
    for (auto& f : message.frames) parts.push_back(frame_message(f));
    if (zmq::send_multipart(router, parts, zmq::send_flags::dontwait)) {
      ++counters_.sent;
    } else {
      ++counters_.dropped_peer_busy;
    }
  } catch (const zmq::error_t&) {
    // EHOSTUNREACH: the client disconnected. Its requests end by their deadlines.
    ++counters_.unroutable;
  }
}

}  // namespace duet
