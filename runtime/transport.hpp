#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <zmq.hpp>

#include "messages/codec.hpp"
#include "runtime/outbox.hpp"

namespace duet {

/// The process-wide ZeroMQ context: the only thing sockets share (inproc:// needs one).
[[nodiscard]] zmq::context_t& zmq_context();

/// One fault a transport injects into the messages it sends: a testing aid (docs/protocol.md
/// "Faults and what happens"), off unless asked for.
struct transport_fault {
  enum class kind : uint8_t { drop, delay };
  kind what = kind::drop;
  uint16_t type = 0;         // msg::type_id of the messages it applies to
  double probability = 1.0;  // of applying to one such message, (0, 1]
  uint32_t delay_ms = 0;     // kind::delay: how long the message is held back
};

/// Parses a fault list: comma-separated items `drop:TYPE[:P]`, `delay:TYPE:Nms[:P]` and
/// `seed:N`, where TYPE is a message name of docs/protocol.md §4 and P a probability
/// (default 1), e.g. "drop:kv_chunk:0.05,delay:kv_confirm:200ms". Empty text: no faults.
/// Throws std::invalid_argument naming the item that does not parse.
[[nodiscard]] std::vector<transport_fault> parse_transport_faults(std::string_view text, uint64_t* seed = nullptr);

/// The environment variable a node's transport reads its faults from when its settings name none.
inline constexpr const char* transport_fault_env = "DUET_TRANSPORT_FAULT";

struct transport_settings {
  std::string node;                          // this node's name
  std::string endpoint;                      // bound by this node
  std::map<std::string, std::string> peers;  // other nodes of the deployment: name -> endpoint
  std::set<std::string> local_actors;        // actor names hosted here; other names are clients
  uint32_t queue_limit = 65536;              // outbound messages waiting for the thread
  uint32_t max_frame_bytes = 64u << 20;
  uint64_t compat_hash = 0;                  // sent in hello; mismatching peers are refused
  /// hello goes first on every connection, again every this many ms, and at once to a peer whose
  /// own hello shows a new process: a peer that restarts behind a ZeroMQ reconnect (which sends
  /// nothing itself) still checks us. 0: only first.
  uint32_t hello_interval_ms = 1000;
  int send_hwm = 100000;
  /// Testing aid: parse_transport_faults text applied to every send; "" reads
  /// $DUET_TRANSPORT_FAULT once, at construction. Off (no faults) by default.
  std::string faults;
};

/// Counters a node exports; every malformed or undeliverable message lands in one.
struct transport_counters {
  std::atomic<uint64_t> received{0};
  std::atomic<uint64_t> sent{0};
  std::atomic<uint64_t> delivered_locally{0};
  std::atomic<uint64_t> malformed{0};
  std::atomic<uint64_t> unroutable{0};
  std::atomic<uint64_t> refused_incompatible{0};
  std::atomic<uint64_t> incompatible_hellos{0};  // hellos whose protocol or compat_hash differ
  std::atomic<uint64_t> dropped_queue_full{0};
  std::atomic<uint64_t> dropped_peer_busy{0};
  std::atomic<uint64_t> fault_dropped{0};  // injected faults (transport_settings::faults)
  std::atomic<uint64_t> fault_delayed{0};
};

/// One node's ZeroMQ endpoint. A ROUTER socket is bound at the node's endpoint; messages
/// to another node go out through one DEALER per peer (routing id = this node's name).
/// A client (any connection that is not a node of the deployment) is addressed as
/// "<this node>/<its routing id>": the node stamps that return address on everything the
/// client sends, relays the client's messages for other nodes, and hands every message
/// for that address back through the ROUTER, wherever in the cluster it came from. All sockets live on one thread; other threads hand
/// messages over through a bounded queue and an eventfd that wakes the thread.
class transport {
 public:
  /// Called with every well-formed message addressed to this node (on the transport
  /// thread for remote messages, on the sender's thread for local ones).
  using deliver_fn = std::function<void(msg::envelope&&, msg::frames&&)>;

  transport(transport_settings settings, deliver_fn deliver);
  ~transport();
  transport(const transport&) = delete;
  transport& operator=(const transport&) = delete;

  /// Binds and starts the thread. Throws std::runtime_error when the endpoint cannot be bound.
  void start();
  void stop();
  /// Thread-safe. False when the outbound queue is full (backpressure) or the
  /// destination is malformed; the message is then dropped and counted. A message an
  /// injected fault drops or delays counts as sent (true), as a lossy network would.
  bool send(outgoing message);

  [[nodiscard]] const transport_counters& counters() const { return counters_; }
  [[nodiscard]] const std::string& node() const { return settings_.node; }
  /// The endpoint actually bound (resolves tcp://host:0 to the chosen port).
  [[nodiscard]] std::string bound_endpoint() const;

 private:
  void run();
  void drain_outbound(zmq::socket_t& router);
  void receive(zmq::socket_t& router);
  void route(zmq::socket_t& router, outgoing& message);
  zmq::socket_t& peer_socket(const std::string& node, const std::string& endpoint);
  void send_hello(zmq::socket_t& socket, const std::string& node);
  /// A hello from `node`: marks it (in)compatible; a new process there gets our hello back.
  void on_hello(const std::string& node, const msg::hello& hello);
  void send_hellos_if_due();
  void deliver_local(msg::frames&& frames);
  /// Applies the injected faults to one message: true when it was dropped or held back.
  bool inject_fault(outgoing& message, bool local);
  /// Sends the held-back messages whose time has come; returns ms until the next one (or -1).
  int64_t release_delayed(zmq::socket_t& router);
  /// The actor name a client is addressed by on this node, and back.
  [[nodiscard]] std::string client_name(const std::string& identity) const;
  [[nodiscard]] static std::string client_identity(const std::string& name);

  transport_settings settings_;
  deliver_fn deliver_;
  transport_counters counters_;
  std::thread thread_;
  std::atomic<bool> running_{false};
  int wake_fd_ = -1;
  mutable std::mutex mutex_;
  std::deque<outgoing> queue_;
  std::string bound_;
  std::promise<std::string>* bind_result_ = nullptr;
  // Injected faults (testing aid); the delayed messages and the generator are under mutex_.
  struct delayed_message {
    std::chrono::steady_clock::time_point due;
    bool local = false;
    outgoing message;
  };
  std::vector<transport_fault> faults_;
  std::mt19937_64 fault_rng_;
  std::vector<delayed_message> delayed_;
  uint64_t fault_logged_ = 0;
  // Owned by the transport thread:
  std::map<std::string, zmq::socket_t> peer_sockets_;
  std::map<std::string, bool> peer_compatible_;
  std::map<std::string, int64_t> peer_pid_;  // the process id of each peer's last hello
  std::chrono::steady_clock::time_point next_hellos_{};
};

}  // namespace duet
