#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace duet {

/// Roles an actor can play in a deployment.
enum class actor_role : uint8_t { router, prefill, decode, broker };

/// One actor on a node. Keys of [[nodes.actors]].
struct actor_config {
  std::string name;                // unique within its node, e.g. "prefill0"
  actor_role role = actor_role::prefill;
  int device = 0;                  // GPU ordinal (cuda engine); ignored by cpu/sim
  double sm_share = 1.0;           // fraction of the GPU's SMs (green contexts), (0, 1]
  std::string stream = "own";      // cuda: "own" | "shared" (one stream per device: colocated)
  uint32_t kv_blocks = 4096;       // KV pool size in blocks (prefill/decode)
  double kv_memory_fraction = 0.0; // cuda: size the pool from free memory instead (0 = use kv_blocks)
  uint32_t max_batch = 64;         // decode: sequences per step; prefill: sequences per step
  uint32_t chunk_tokens = 2048;    // prefill: tokens per chunk; decode: per recompute step
  std::string kv_allocation = "on_demand";  // decode: "on_demand" (grow, preempt) | "reserve"
};

/// One process of a deployment. Keys of [[nodes]].
struct node_config {
  std::string name;      // unique, e.g. "n1"; actor address is "<node>/<actor>"
  std::string endpoint;  // inproc://..., ipc://..., tcp://host:port (bound by this node)
  std::string http;      // optional "host:port" for the HTTP front end on this node
  std::vector<actor_config> actors;
};

/// [model]
struct model_config {
  std::string name = "duet-sim-llama-8b";  // served model name
  std::string preset = "r1-distill-llama-8b";  // shape preset for the sim engine
  std::string path;                        // checkpoint dir or .gguf file (cpu/cuda engines)
  std::string dtype = "bf16";
  uint32_t max_context = 32768;            // prompt + generated tokens
  uint32_t block_tokens = 16;              // KV block size in tokens
};

/// [engine]
struct engine_config {
  std::string kind = "sim";   // sim | cpu | cuda
  std::string gpu = "h200";   // sim: GPU spec name for the cost model
  double time_scale = 1.0;    // sim: multiply modelled times (0 = no waiting at all)
  uint32_t threads = 0;       // cpu: worker threads (0 = all cores)
};

/// [router]
struct router_config {
  std::string policy = "least_loaded";  // least_loaded | round_robin
  uint32_t queue_limit = 4096;          // admitted but not yet finished requests
  uint32_t request_timeout_ms = 120000; // default deadline when the client gives none
  uint32_t max_new_tokens_limit = 32768;
  // Who streams a request's first token to its client. prefill: the router, as soon as the
  // prompt is computed (the earliest first token) | decode: the decode worker, when the step
  // that computes the second token starts (every gap the client sees is one decode step).
  std::string first_token = "prefill";
};

/// [broker]
struct broker_config {
  uint32_t lease_ms = 10000;            // a handle not confirmed within this is reclaimed
  uint32_t reclaim_interval_ms = 250;   // timer period of the reclamation sweep
  uint32_t transfer_timeout_ms = 5000;  // decode side gives up waiting for KV after this
  uint32_t stream_chunk_bytes = 4u << 20;  // stream path: KV bytes per message (whole blocks)
  uint32_t stream_window = 4;              // stream path: chunks in flight per transfer
  // auto: one pool for a node's workers on one device (ownership moves), else the other pool
  // mapped (host_shm, cuda_ipc), else the stream | copy: never one pool | stream: always the stream
  std::string transfer = "auto";
  // chunks: a long prompt's finished blocks stream to its decode worker while the next chunk
  // computes (the stream path; needs transfer = "stream") | off: after the whole prompt
  std::string stream_prefill = "off";
};

/// [transport]
struct transport_config {
  uint32_t queue_limit = 65536;   // outbound frames queued per node before send() refuses
  uint32_t peer_timeout_ms = 3000;  // a peer silent this long is reported down
  uint32_t heartbeat_ms = 1000;
  uint32_t max_frame_bytes = 64u << 20;  // larger inbound frames are dropped and counted
};

/// The whole deployment, as read from one TOML file. Every default lives here.
struct deployment_config {
  std::filesystem::path source;  // the file it came from ("" when built in code)
  model_config model;
  engine_config engine;
  router_config router;
  broker_config broker;
  transport_config transport;
  std::vector<node_config> nodes;

  [[nodiscard]] const node_config* find_node(std::string_view name) const;
};

/// One problem found in a config: where it is, which key, what is wrong.
struct config_diagnostic {
  std::string source;   // file name or parse_config's source_name ("" when built in code)
  uint32_t line = 0;    // 1-based; 0 when unknown (a config built in code)
  uint32_t column = 0;  // 1-based; 0 when unknown
  std::string key;      // dotted path, e.g. "nodes[0].actors[1].role"; "" for syntax errors
  std::string message;  // what is wrong, e.g. "must be one of: router, prefill, decode, broker"
};

/// "FILE:LINE:COLUMN: key 'a.b.c': what is wrong" (parts without a value are left out).
[[nodiscard]] std::string to_string(const config_diagnostic& diagnostic);

/// A config error that names file:line:key; `duet` exits with code 2 on it.
/// what() holds one formatted line per diagnostic, in file order.
class config_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
  /// Requires at least one diagnostic.
  explicit config_error(std::vector<config_diagnostic> diagnostics);

  /// Every problem found (empty when built from a plain message).
  [[nodiscard]] const std::vector<config_diagnostic>& diagnostics() const noexcept;

 private:
  std::shared_ptr<const std::vector<config_diagnostic>> diagnostics_;  // shared: nothrow copy
};

/// Parses and validates a TOML deployment file. Throws config_error.
[[nodiscard]] deployment_config load_config(const std::filesystem::path& file);
/// Same, from TOML text (`source_name` is used in messages).
[[nodiscard]] deployment_config parse_config(std::string_view toml_text,
                                             const std::string& source_name);
/// The built-in single-process deployment used when no config is given.
[[nodiscard]] deployment_config default_config();

/// Checks every rule that load_config checks after parsing (ranges, enums, endpoints,
/// names, roles present); for configs built or changed in code. Throws config_error.
void validate_config(const deployment_config& config);

[[nodiscard]] std::string_view to_string(actor_role role);
/// "router" | "prefill" | "decode" | "broker"; nullopt for anything else.
[[nodiscard]] std::optional<actor_role> actor_role_from_string(std::string_view text);

/// Every key a deployment file may hold, as schema paths ("model.block_tokens",
/// "nodes.endpoint", "nodes.actors.sm_share"), in documentation order.
[[nodiscard]] std::vector<std::string> config_keys();

}  // namespace duet
