#include "runtime/config.hpp"

#include <toml++/toml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <unordered_map>
#include <utility>
#include <variant>

namespace duet {

// ---------------------------------------------------------------------------------------
// Diagnostics
// ---------------------------------------------------------------------------------------

std::string to_string(const config_diagnostic& d) {
  std::string out = d.source.empty() ? std::string("<config>") : d.source;
  if (d.line > 0) {
    out += ':' + std::to_string(d.line);
    if (d.column > 0) out += ':' + std::to_string(d.column);
  }
  out += ": ";
  if (!d.key.empty()) out += "key '" + d.key + "': ";
  out += d.message;
  return out;
}

namespace {

constexpr size_t max_reported = 20;  // what() lists at most this many, then a count

std::string join_diagnostics(const std::vector<config_diagnostic>& list) {
  std::string out;
  for (size_t i = 0; i < list.size() && i < max_reported; ++i) {
    if (i > 0) out += '\n';
    out += to_string(list[i]);
  }
  if (list.size() > max_reported) {
    out += "\n(" + std::to_string(list.size() - max_reported) + " more errors not shown)";
  }
  return out;
}

}  // namespace

config_error::config_error(std::vector<config_diagnostic> diagnostics)
    : std::runtime_error(join_diagnostics(diagnostics)),
      diagnostics_(std::make_shared<const std::vector<config_diagnostic>>(std::move(diagnostics))) {
}

const std::vector<config_diagnostic>& config_error::diagnostics() const noexcept {
  static const std::vector<config_diagnostic> none;
  return diagnostics_ ? *diagnostics_ : none;
}

// ---------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------

std::string_view to_string(actor_role role) {
  switch (role) {
    case actor_role::router:
      return "router";
    case actor_role::prefill:
      return "prefill";
    case actor_role::decode:
      return "decode";
    case actor_role::broker:
      return "broker";
  }
  return "unknown";
}

std::optional<actor_role> actor_role_from_string(std::string_view text) {
  for (auto role :
       {actor_role::router, actor_role::prefill, actor_role::decode, actor_role::broker}) {
    if (to_string(role) == text) return role;
  }
  return std::nullopt;
}

const node_config* deployment_config::find_node(std::string_view name) const {
  for (const auto& node : nodes) {
    if (node.name == name) return &node;
  }
  return nullptr;
}

namespace {

struct source_pos {
  uint32_t line = 0;
  uint32_t column = 0;
};

source_pos pos_of(const toml::source_region& region) {
  return {region.begin.line, region.begin.column};
}

/// Collects diagnostics of one phase; throws them together, in file order.
class diagnostic_sink {
 public:
  explicit diagnostic_sink(std::string source) : source_(std::move(source)) {}

  void add(source_pos pos, std::string key, std::string message) {
    list_.push_back({source_, pos.line, pos.column, std::move(key), std::move(message)});
  }

  void throw_if_any() {
    if (list_.empty()) return;
    std::stable_sort(list_.begin(), list_.end(), [](const auto& a, const auto& b) {
      return std::pair(a.line, a.column) < std::pair(b.line, b.column);
    });
    throw config_error(std::move(list_));
  }

  [[nodiscard]] std::string where(source_pos pos) const {
    std::string out = source_.empty() ? std::string("<config>") : source_;
    if (pos.line > 0) out += ':' + std::to_string(pos.line) + ':' + std::to_string(pos.column);
    return out;
  }

 private:
  std::string source_;
  std::vector<config_diagnostic> list_;
};

/// Where each key path ("nodes[0].actors[1].role") was written. A key that was not written
/// resolves to its closest written ancestor, so a missing key points at its table.
class position_map {
 public:
  void set(const std::string& path, source_pos pos) { map_[path] = pos; }

  [[nodiscard]] source_pos find(std::string_view path) const {
    while (true) {
      if (auto it = map_.find(std::string(path)); it != map_.end()) return it->second;
      if (path.empty()) return {};
      auto cut = path.find_last_of(".[");
      path = cut == std::string_view::npos ? std::string_view{} : path.substr(0, cut);
    }
  }

 private:
  std::unordered_map<std::string, source_pos> map_;
};

std::string join_path(const std::string& parent, std::string_view key) {
  return parent.empty() ? std::string(key) : parent + '.' + std::string(key);
}

std::string index_path(const std::string& parent, size_t index) {
  return parent + '[' + std::to_string(index) + ']';
}

std::string format_number(double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", value);
  return buf;
}

std::string_view type_name(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a float";
    case toml::node_type::boolean:
      return "a boolean";
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::date:
      return "a date";
    case toml::node_type::time:
      return "a time";
    case toml::node_type::date_time:
      return "a date-time";
    case toml::node_type::none:
      break;
  }
  return "nothing";
}

/// Optimal-string-alignment distance (Levenshtein plus adjacent transpositions),
/// case-insensitive, so "polcy", "Policy" and "plociy" all land on "policy".
size_t edit_distance(std::string_view a, std::string_view b) {
  auto lower = [](char c) { return static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c); };
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cost = lower(a[i - 1]) == lower(b[j - 1]) ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && lower(a[i - 1]) == lower(b[j - 2]) &&
          lower(a[i - 2]) == lower(b[j - 1])) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

/// The closest candidate when it is close enough to be a likely typo.
std::optional<std::string_view> closest(std::string_view word,
                                        const std::vector<std::string_view>& candidates) {
  std::optional<std::string_view> best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (auto candidate : candidates) {
    size_t distance = edit_distance(word, candidate);
    if (distance < best_distance) {
      best_distance = distance;
      best = candidate;
    }
  }
  size_t limit = std::max<size_t>(1, std::min<size_t>(3, (word.size() + 2) / 4));
  if (best && best_distance <= limit && best_distance < word.size()) return best;
  return std::nullopt;
}

std::string join_words(const std::vector<std::string_view>& words) {
  std::string out;
  for (auto w : words) {
    if (!out.empty()) out += ", ";
    out += w;
  }
  return out;
}

/// "must be one of: a, b (got 'x'; did you mean 'a'?)"
std::string choice_message(std::string_view got, const std::vector<std::string_view>& choices) {
  std::string out = "must be one of: " + join_words(choices) + " (got '" + std::string(got) + "'";
  if (auto near = closest(got, choices)) out += "; did you mean '" + std::string(*near) + "'?";
  return out + ")";
}

// ---------------------------------------------------------------------------------------
// The schema: every key of every table, in documentation order. Reading, the unknown-key
// check and config_keys() all come from these lists, so they cannot drift apart.
// ---------------------------------------------------------------------------------------

template <class S>
struct field {
  std::string_view key;
  std::variant<std::string S::*, uint32_t S::*, int S::*, double S::*, actor_role S::*> member;
  bool required = false;
};

const std::vector<field<model_config>>& model_fields() {
  static const std::vector<field<model_config>> fields{
      {"name", &model_config::name},
      {"preset", &model_config::preset},
      {"path", &model_config::path},
      {"dtype", &model_config::dtype},
      {"max_context", &model_config::max_context},
      {"block_tokens", &model_config::block_tokens}};
  return fields;
}

const std::vector<field<engine_config>>& engine_fields() {
  static const std::vector<field<engine_config>> fields{{"kind", &engine_config::kind},
                                                        {"gpu", &engine_config::gpu},
                                                        {"time_scale", &engine_config::time_scale},
                                                        {"threads", &engine_config::threads}};
  return fields;
}

const std::vector<field<router_config>>& router_fields() {
  static const std::vector<field<router_config>> fields{
      {"policy", &router_config::policy},
      {"queue_limit", &router_config::queue_limit},
      {"request_timeout_ms", &router_config::request_timeout_ms},
      {"max_new_tokens_limit", &router_config::max_new_tokens_limit},
      {"first_token", &router_config::first_token}};
  return fields;
}

const std::vector<field<broker_config>>& broker_fields() {
  static const std::vector<field<broker_config>> fields{
      {"lease_ms", &broker_config::lease_ms},
      {"reclaim_interval_ms", &broker_config::reclaim_interval_ms},
      {"transfer_timeout_ms", &broker_config::transfer_timeout_ms},
      {"stream_chunk_bytes", &broker_config::stream_chunk_bytes},
      {"stream_window", &broker_config::stream_window},
      {"transfer", &broker_config::transfer},
      {"stream_prefill", &broker_config::stream_prefill}};
  return fields;
}

const std::vector<field<transport_config>>& transport_fields() {
  static const std::vector<field<transport_config>> fields{
      {"queue_limit", &transport_config::queue_limit},
      {"peer_timeout_ms", &transport_config::peer_timeout_ms},
      {"heartbeat_ms", &transport_config::heartbeat_ms},
      {"max_frame_bytes", &transport_config::max_frame_bytes}};
  return fields;
}

const std::vector<field<node_config>>& node_fields() {
  static const std::vector<field<node_config>> fields{{"name", &node_config::name, true},
                                                      {"endpoint", &node_config::endpoint, true},
                                                      {"http", &node_config::http}};
  return fields;
}

const std::vector<field<actor_config>>& actor_fields() {
  static const std::vector<field<actor_config>> fields{
      {"name", &actor_config::name, true},
      {"role", &actor_config::role, true},
      {"device", &actor_config::device},
      {"sm_share", &actor_config::sm_share},
      {"stream", &actor_config::stream},
      {"kv_blocks", &actor_config::kv_blocks},
      {"kv_memory_fraction", &actor_config::kv_memory_fraction},
      {"max_batch", &actor_config::max_batch},
      {"chunk_tokens", &actor_config::chunk_tokens},
      {"kv_allocation", &actor_config::kv_allocation}};
  return fields;
}

constexpr std::string_view nested_actors_key = "actors";
const std::vector<std::string_view> root_keys{"model",  "engine",    "router",
                                              "broker", "transport", "nodes"};
const std::vector<std::string_view> role_names{"router", "prefill", "decode", "broker"};
const std::vector<std::string_view> engine_kinds{"sim", "cpu", "cuda"};
const std::vector<std::string_view> router_policies{"least_loaded", "round_robin"};
const std::vector<std::string_view> transfer_modes{"auto", "copy", "stream"};
const std::vector<std::string_view> stream_modes{"own", "shared"};
const std::vector<std::string_view> kv_allocation_modes{"on_demand", "reserve"};
const std::vector<std::string_view> dtypes{"bf16", "f16", "f32"};

template <class S>
std::vector<std::string_view> keys_of(const std::vector<field<S>>& fields) {
  std::vector<std::string_view> keys;
  for (const auto& f : fields) keys.push_back(f.key);
  return keys;
}

/// Each table a key may belong to, by its schema path and TOML header.
struct table_keys {
  std::string_view header;  // "[model]", "[[nodes.actors]]"
  std::string_view schema;  // "model", "nodes.actors"
  std::vector<std::string_view> keys;
};

const std::vector<table_keys>& all_tables() {
  static const std::vector<table_keys> tables = [] {
    std::vector<table_keys> t{{"[model]", "model", keys_of(model_fields())},
                              {"[engine]", "engine", keys_of(engine_fields())},
                              {"[router]", "router", keys_of(router_fields())},
                              {"[broker]", "broker", keys_of(broker_fields())},
                              {"[transport]", "transport", keys_of(transport_fields())},
                              {"[[nodes]]", "nodes", keys_of(node_fields())},
                              {"[[nodes.actors]]", "nodes.actors", keys_of(actor_fields())}};
    t[5].keys.push_back(nested_actors_key);
    return t;
  }();
  return tables;
}

// ---------------------------------------------------------------------------------------
// Reading TOML into the structs (phase 1: shape and types)
// ---------------------------------------------------------------------------------------

class reader {
 public:
  reader(diagnostic_sink& sink, position_map& positions) : sink_(sink), positions_(positions) {}

  void read_root(const toml::table& root, deployment_config& out) {
    positions_.set("", pos_of(root.source()));
    for (const auto& [k, v] : root) {
      std::string_view key = k.str();
      if (std::find(root_keys.begin(), root_keys.end(), key) == root_keys.end()) {
        unknown_key(k, key, "", root_keys, "");
      }
    }
    read_section(root, "model", model_fields(), out.model);
    read_section(root, "engine", engine_fields(), out.engine);
    read_section(root, "router", router_fields(), out.router);
    read_section(root, "broker", broker_fields(), out.broker);
    read_section(root, "transport", transport_fields(), out.transport);
    read_nodes(root, out.nodes);
  }

 private:
  template <class S>
  void read_section(const toml::table& root, std::string_view name,
                    const std::vector<field<S>>& fields, S& out) {
    const toml::node* node = root.get(name);
    if (!node) return;  // the whole section takes its defaults
    std::string path(name);
    positions_.set(path, pos_of(node->source()));
    const toml::table* table = node->as_table();
    if (!table) {
      sink_.add(pos_of(node->source()), path,
                "expected a table ([" + path + "]), got " + std::string(type_name(*node)));
      return;
    }
    read_fields(*table, path, name, fields, {}, out);
  }

  void read_nodes(const toml::table& root, std::vector<node_config>& out) {
    const toml::node* node = root.get("nodes");
    if (!node) return;  // reported by validation: a deployment needs nodes
    positions_.set("nodes", pos_of(node->source()));
    const toml::array* array = node->as_array();
    if (!array) {
      sink_.add(pos_of(node->source()), "nodes",
                "expected an array of tables ([[nodes]]), got " + std::string(type_name(*node)));
      return;
    }
    for (size_t i = 0; i < array->size(); ++i) {
      const toml::node& element = (*array)[i];
      std::string path = index_path("nodes", i);
      positions_.set(path, pos_of(element.source()));
      const toml::table* table = element.as_table();
      if (!table) {
        sink_.add(pos_of(element.source()), path,
                  "expected a table ([[nodes]]), got " + std::string(type_name(element)));
        continue;
      }
      node_config node_out;
      read_fields(*table, path, "nodes", node_fields(), {nested_actors_key}, node_out);
      read_actors(*table, path, node_out.actors);
      out.push_back(std::move(node_out));
    }
  }

  void read_actors(const toml::table& node_table, const std::string& node_path,
                   std::vector<actor_config>& out) {
    const toml::node* node = node_table.get(nested_actors_key);
    if (!node) return;  // reported by validation: a node needs actors
    std::string path = join_path(node_path, nested_actors_key);
    positions_.set(path, pos_of(node->source()));
    const toml::array* array = node->as_array();
    if (!array) {
      sink_.add(
          pos_of(node->source()), path,
          "expected an array of tables ([[nodes.actors]]), got " + std::string(type_name(*node)));
      return;
    }
    for (size_t i = 0; i < array->size(); ++i) {
      const toml::node& element = (*array)[i];
      std::string actor_path = index_path(path, i);
      positions_.set(actor_path, pos_of(element.source()));
      const toml::table* table = element.as_table();
      if (!table) {
        sink_.add(pos_of(element.source()), actor_path,
                  "expected a table ([[nodes.actors]]), got " + std::string(type_name(element)));
        continue;
      }
      actor_config actor;
      read_fields(*table, actor_path, "nodes.actors", actor_fields(), {}, actor);
      out.push_back(std::move(actor));
    }
  }

  /// Reads the known keys of one table into `out`, reports unknown and missing ones.
  /// `nested` names keys the caller reads itself.
  template <class S>
  void read_fields(const toml::table& table, const std::string& path, std::string_view schema,
                   const std::vector<field<S>>& fields, const std::vector<std::string_view>& nested,
                   S& out) {
    std::vector<std::string_view> known = keys_of(fields);
    known.insert(known.end(), nested.begin(), nested.end());
    for (const auto& [k, v] : table) {
      std::string_view key = k.str();
      auto it =
          std::find_if(fields.begin(), fields.end(), [&](const auto& f) { return f.key == key; });
      if (it == fields.end()) {
        if (std::find(nested.begin(), nested.end(), key) == nested.end()) {
          unknown_key(k, key, path, known, schema);
        }
        continue;
      }
      std::string key_path = join_path(path, key);
      positions_.set(key_path, pos_of(v.source()));
      std::visit([&](auto member) { read_value(v, key_path, out.*member); }, it->member);
    }
    for (const auto& f : fields) {
      if (f.required && !table.contains(f.key)) {
        sink_.add(pos_of(table.source()), join_path(path, f.key), "required key is missing");
      }
    }
  }

  void unknown_key(const toml::key& k, std::string_view key, const std::string& path,
                   const std::vector<std::string_view>& known, std::string_view schema) {
    std::string message = "unknown key";
    if (auto near = closest(key, known)) {
      message += "; did you mean '" + std::string(*near) + "'?";
    } else if (auto home = table_holding(key, schema)) {
      message += "; '" + std::string(key) + "' belongs in " + *home;
    } else {
      message += " (known keys here: " + join_words(known) + ")";
    }
    sink_.add(pos_of(k.source()), join_path(path, key), std::move(message));
  }

  /// The headers of the other tables that have this key ("[model] or [[nodes]]"), for a
  /// key written in the wrong table.
  static std::optional<std::string> table_holding(std::string_view key, std::string_view schema) {
    std::vector<std::string_view> headers;
    for (const auto& t : all_tables()) {
      if (t.schema == schema) continue;
      if (std::find(t.keys.begin(), t.keys.end(), key) != t.keys.end()) {
        headers.push_back(t.header);
      }
    }
    if (headers.empty()) return std::nullopt;
    std::string out(headers[0]);
    for (size_t i = 1; i < headers.size(); ++i) {
      out += (i + 1 == headers.size() ? " or " : ", ") + std::string(headers[i]);
    }
    return out;
  }

  void read_value(const toml::node& v, const std::string& path, std::string& out) {
    if (const auto* s = v.as_string()) {
      out = s->get();
    } else {
      type_error(v, path, "a string");
    }
  }

  /// Reads an integer in [0, max]; false (with a diagnostic) otherwise.
  bool read_integer(const toml::node& v, const std::string& path, int64_t max, int64_t& out) {
    const auto* i = v.as_integer();
    if (!i) {
      type_error(v, path, "an integer");
      return false;
    }
    int64_t value = i->get();
    if (value < 0) {
      sink_.add(pos_of(v.source()), path,
                "must not be negative (got " + std::to_string(value) + ")");
      return false;
    }
    if (value > max) {
      sink_.add(
          pos_of(v.source()), path,
          "out of range (got " + std::to_string(value) + "; at most " + std::to_string(max) + ")");
      return false;
    }
    out = value;
    return true;
  }

  void read_value(const toml::node& v, const std::string& path, uint32_t& out) {
    int64_t value = 0;
    if (read_integer(v, path, std::numeric_limits<uint32_t>::max(), value)) {
      out = static_cast<uint32_t>(value);
    }
  }

  void read_value(const toml::node& v, const std::string& path, int& out) {
    int64_t value = 0;
    if (read_integer(v, path, std::numeric_limits<int>::max(), value)) {
      out = static_cast<int>(value);
    }
  }

  void read_value(const toml::node& v, const std::string& path, double& out) {
    double value = 0;
    if (const auto* f = v.as_floating_point()) {
      value = f->get();
    } else if (const auto* i = v.as_integer()) {
      value = static_cast<double>(i->get());
    } else {
      type_error(v, path, "a number");
      return;
    }
    if (!std::isfinite(value)) {
      sink_.add(pos_of(v.source()), path,
                "must be a finite number (got " + format_number(value) + ")");
      return;
    }
    out = value;
  }

  void read_value(const toml::node& v, const std::string& path, actor_role& out) {
    const auto* s = v.as_string();
    if (!s) {
      type_error(v, path, "a string");
      return;
    }
    if (auto role = actor_role_from_string(s->get())) {
      out = *role;
    } else {
      sink_.add(pos_of(v.source()), path, choice_message(s->get(), role_names));
    }
  }

  void type_error(const toml::node& v, const std::string& path, std::string_view expected) {
    sink_.add(pos_of(v.source()), path,
              "expected " + std::string(expected) + ", got " + std::string(type_name(v)));
  }

  diagnostic_sink& sink_;
  position_map& positions_;
};

// ---------------------------------------------------------------------------------------
// Validation (phase 2: values and the deployment as a whole)
// ---------------------------------------------------------------------------------------

bool is_power_of_two(uint32_t v) {
  return v != 0 && (v & (v - 1)) == 0;
}

bool valid_name(std::string_view name) {
  return !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-' || c == '.';
  });
}

/// Checks "host:port" (host may be a bracketed IPv6 address); empty when fine.
std::string check_host_port(std::string_view text) {
  auto colon = text.rfind(':');
  if (colon == std::string_view::npos) return "needs host:port";
  std::string_view host = text.substr(0, colon);
  std::string_view port = text.substr(colon + 1);
  if (host.empty()) return "needs a host before ':'";
  if (host.front() == '[' && host.back() != ']') return "an IPv6 host needs a closing ']'";
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return "needs a numeric port after ':'";
  }
  int number = std::stoi(std::string(port));
  if (number < 1 || number > 65535) return "port must be between 1 and 65535";
  return {};
}

/// Checks a node endpoint; empty when fine.
std::string check_endpoint(std::string_view endpoint) {
  constexpr std::string_view inproc = "inproc://", ipc = "ipc://", tcp = "tcp://";
  constexpr size_t max_ipc_path = 107;  // sun_path holds 108 bytes with the terminator
  if (endpoint.starts_with(inproc)) {
    if (endpoint.size() == inproc.size()) return "inproc:// needs a name after the scheme";
    return {};
  }
  if (endpoint.starts_with(ipc)) {
    std::string_view path = endpoint.substr(ipc.size());
    if (path.empty()) return "ipc:// needs a socket path after the scheme";
    if (path.size() > max_ipc_path) {
      return "ipc:// socket path is " + std::to_string(path.size()) +
             " bytes; Unix sockets allow at most " + std::to_string(max_ipc_path);
    }
    return {};
  }
  if (endpoint.starts_with(tcp)) {
    std::string_view rest = endpoint.substr(tcp.size());
    if (rest.starts_with("*:")) {
      return "tcp:// needs a host that peers can connect to, not '*'";
    }
    auto problem = check_host_port(rest);
    if (!problem.empty()) return "tcp:// " + problem + " (e.g. tcp://127.0.0.1:5601)";
    return {};
  }
  return "must start with inproc://, ipc:// or tcp:// (got '" + std::string(endpoint) + "')";
}

class validator {
 public:
  validator(const deployment_config& config, const position_map& positions, diagnostic_sink& sink)
      : config_(config), positions_(positions), sink_(sink) {}

  void run() {
    check_model();
    check_engine();
    check_router();
    check_broker();
    check_transport();
    check_nodes();
    check_roles();
  }

 private:
  void error(const std::string& key, std::string message) {
    sink_.add(positions_.find(key), key, std::move(message));
  }

  void at_least_one(const std::string& key, uint32_t value) {
    if (value < 1) error(key, "must be at least 1 (got 0)");
  }

  void choice(const std::string& key, const std::string& value,
              const std::vector<std::string_view>& choices) {
    if (std::find(choices.begin(), choices.end(), value) == choices.end()) {
      error(key, choice_message(value, choices));
    }
  }

  /// Rules measured in blocks are checked only against a valid block size, so one bad
  /// block_tokens is one error, not one per actor.
  [[nodiscard]] bool block_tokens_valid() const {
    return is_power_of_two(config_.model.block_tokens) && config_.model.block_tokens <= 1024;
  }

  void check_model() {
    const auto& m = config_.model;
    if (m.name.empty()) error("model.name", "must not be empty");
    choice("model.dtype", m.dtype, dtypes);
    if (!block_tokens_valid()) {
      error("model.block_tokens", "must be a power of two between 1 and 1024 (got " +
                                      std::to_string(m.block_tokens) + ")");
    } else if (m.max_context < m.block_tokens) {
      error("model.max_context", "must be at least model.block_tokens (" +
                                     std::to_string(m.block_tokens) + "; got " +
                                     std::to_string(m.max_context) + ")");
    }
  }

  void check_engine() {
    const auto& e = config_.engine;
    choice("engine.kind", e.kind, engine_kinds);
    if (e.kind == "sim") {
      if (e.gpu.empty()) error("engine.gpu", "must name a GPU spec for the sim engine");
      if (config_.model.preset.empty()) {
        error("model.preset", "must name a shape preset for the sim engine");
      }
    }
    if (!std::isfinite(e.time_scale) || e.time_scale < 0) {
      error("engine.time_scale",
            "must be a finite number >= 0 (got " + format_number(e.time_scale) + ")");
    }
  }

  void check_router() {
    const auto& r = config_.router;
    choice("router.policy", r.policy, router_policies);
    at_least_one("router.queue_limit", r.queue_limit);
    at_least_one("router.request_timeout_ms", r.request_timeout_ms);
    at_least_one("router.max_new_tokens_limit", r.max_new_tokens_limit);
    choice("router.first_token", r.first_token, {"prefill", "decode"});
  }

  void check_broker() {
    const auto& b = config_.broker;
    at_least_one("broker.lease_ms", b.lease_ms);
    at_least_one("broker.reclaim_interval_ms", b.reclaim_interval_ms);
    at_least_one("broker.transfer_timeout_ms", b.transfer_timeout_ms);
    at_least_one("broker.stream_chunk_bytes", b.stream_chunk_bytes);
    at_least_one("broker.stream_window", b.stream_window);
    choice("broker.transfer", b.transfer, transfer_modes);
    choice("broker.stream_prefill", b.stream_prefill, {"off", "chunks"});
    if (b.stream_prefill == "chunks" && b.transfer != "stream") {
      error("broker.stream_prefill", "\"chunks\" streams KV over the stream path: it needs broker.transfer = \"stream\" (got \"" +
                                         b.transfer + "\")");
    }
    if (b.stream_prefill == "chunks" && config_.engine.kind == "sim") {
      error("broker.stream_prefill", "\"chunks\" needs an engine that holds KV bytes (cpu or cuda), not the sim engine");
    }
    if (b.stream_chunk_bytes > config_.transport.max_frame_bytes / 2) {
      error("broker.stream_chunk_bytes",
            "must be at most half of transport.max_frame_bytes (" +
                std::to_string(config_.transport.max_frame_bytes) + "; got " +
                std::to_string(b.stream_chunk_bytes) + "), or KV chunks would be dropped as oversized");
    }
    if (b.reclaim_interval_ms > b.lease_ms) {
      error("broker.reclaim_interval_ms",
            "must not exceed broker.lease_ms (" + std::to_string(b.lease_ms) + "; got " +
                std::to_string(b.reclaim_interval_ms) + "), or expired handles outlive leases");
    }
  }

  void check_transport() {
    const auto& t = config_.transport;
    constexpr uint32_t min_frame_bytes = 1024;
    at_least_one("transport.queue_limit", t.queue_limit);
    at_least_one("transport.peer_timeout_ms", t.peer_timeout_ms);
    at_least_one("transport.heartbeat_ms", t.heartbeat_ms);
    if (t.heartbeat_ms >= t.peer_timeout_ms) {
      error("transport.heartbeat_ms",
            "must be less than transport.peer_timeout_ms (" + std::to_string(t.peer_timeout_ms) +
                "; got " + std::to_string(t.heartbeat_ms) + "), or live peers are reported down");
    }
    if (t.max_frame_bytes < min_frame_bytes) {
      error("transport.max_frame_bytes", "must be at least " + std::to_string(min_frame_bytes) +
                                             " (got " + std::to_string(t.max_frame_bytes) + ")");
    }
  }

  void check_nodes() {
    if (config_.nodes.empty()) {
      error("nodes", "the deployment has no nodes; add at least one [[nodes]] table");
      return;
    }
    std::unordered_map<std::string, std::string> node_names;  // name -> path of first use
    std::unordered_map<std::string, std::string> endpoints;
    for (size_t i = 0; i < config_.nodes.size(); ++i) {
      const auto& node = config_.nodes[i];
      std::string path = index_path("nodes", i);
      if (!valid_name(node.name)) {
        error(path + ".name", node.name.empty()
                                  ? "must not be empty"
                                  : "must contain only letters, digits, '_', '-' and '.' (got '" +
                                        node.name + "')");
      } else if (auto [it, fresh] = node_names.emplace(node.name, path + ".name"); !fresh) {
        error(path + ".name", "duplicate node name '" + node.name + "' (first used at " +
                                  sink_.where(positions_.find(it->second)) + ")");
      }
      if (auto problem = check_endpoint(node.endpoint); !problem.empty()) {
        error(path + ".endpoint", node.endpoint.empty() ? "must not be empty" : problem);
      } else if (auto [it, fresh] = endpoints.emplace(node.endpoint, path + ".endpoint"); !fresh) {
        error(path + ".endpoint", "duplicate endpoint '" + node.endpoint + "' (also used at " +
                                      sink_.where(positions_.find(it->second)) + ")");
      }
      if (!node.http.empty()) {
        if (auto problem = check_host_port(node.http); !problem.empty()) {
          error(path + ".http", problem + " (e.g. \"127.0.0.1:8080\"; got '" + node.http + "')");
        }
      }
      check_actors(node, path);
    }
  }

  void check_actors(const node_config& node, const std::string& node_path) {
    std::string actors_path = node_path + ".actors";
    if (node.actors.empty()) {
      error(actors_path, "node has no actors; add at least one [[nodes.actors]] table");
      return;
    }
    const uint32_t block = config_.model.block_tokens;
    std::unordered_map<std::string, std::string> names;
    // device -> sum of the prefill/decode shares below 1: those are disjoint SM partitions. An
    // actor at 1 beside them runs on the whole GPU, their SMs included (docs/config.md).
    std::unordered_map<int, double> share_sum;
    for (size_t j = 0; j < node.actors.size(); ++j) {
      const auto& a = node.actors[j];
      std::string path = index_path(actors_path, j);
      if (!valid_name(a.name)) {
        error(path + ".name",
              a.name.empty()
                  ? "must not be empty"
                  : "must contain only letters, digits, '_', '-' and '.' (got '" + a.name + "')");
      } else if (auto [it, fresh] = names.emplace(a.name, path + ".name"); !fresh) {
        error(path + ".name", "duplicate actor name '" + a.name + "' in node '" + node.name +
                                  "' (first used at " + sink_.where(positions_.find(it->second)) +
                                  ")");
      }
      if (!actor_role_from_string(to_string(a.role))) {
        error(path + ".role", "must be one of: " + join_words(role_names));
      }
      if (a.device < 0) {
        error(path + ".device", "must not be negative (got " + std::to_string(a.device) + ")");
      }
      const bool share_valid = a.sm_share > 0.0 && a.sm_share <= 1.0;
      if (!share_valid) {
        error(path + ".sm_share", "must be in (0, 1] (got " + format_number(a.sm_share) + ")");
      }
      choice(path + ".stream", a.stream, stream_modes);
      choice(path + ".kv_allocation", a.kv_allocation, kv_allocation_modes);
      if (a.stream == "shared" && share_valid && a.sm_share < 1.0) {
        error(path + ".stream",
              "\"shared\" runs on the whole GPU and cannot be combined with sm_share " +
                  format_number(a.sm_share) + " (an SM share needs the actor's own stream)");
      }
      if (!(a.kv_memory_fraction >= 0.0 && a.kv_memory_fraction < 1.0)) {
        error(path + ".kv_memory_fraction",
              "must be in [0, 1) (got " + format_number(a.kv_memory_fraction) + ")");
      }
      at_least_one(path + ".kv_blocks", a.kv_blocks);
      at_least_one(path + ".max_batch", a.max_batch);
      if (block_tokens_valid() && (a.chunk_tokens < block || a.chunk_tokens % block != 0)) {
        error(path + ".chunk_tokens", "must be a multiple of model.block_tokens (" +
                                          std::to_string(block) + ") and at least it (got " +
                                          std::to_string(a.chunk_tokens) + ")");
      }
      if (share_valid && a.sm_share < 1.0 &&
          (a.role == actor_role::prefill || a.role == actor_role::decode)) {
        share_sum[a.device] += a.sm_share;
        if (share_sum[a.device] > 1.0 + 1e-9) {
          error(path + ".sm_share",
                "prefill and decode actors on device " + std::to_string(a.device) + " of node '" +
                    node.name + "' have sm_share below 1 summing to " +
                    format_number(share_sum[a.device]) + "; split SMs must sum to at most 1");
        }
      }
    }
  }

  void check_roles() {
    struct seen {
      std::vector<std::string> paths;  // "nodes[i].actors[j]"
      std::vector<std::string> addresses;
    };
    std::unordered_map<int, seen> by_role;
    for (size_t i = 0; i < config_.nodes.size(); ++i) {
      const auto& node = config_.nodes[i];
      for (size_t j = 0; j < node.actors.size(); ++j) {
        auto& s = by_role[static_cast<int>(node.actors[j].role)];
        s.paths.push_back(index_path(index_path("nodes", i) + ".actors", j));
        s.addresses.push_back(node.name + '/' + node.actors[j].name);
      }
    }
    if (config_.nodes.empty()) return;  // already reported
    auto exactly_one = [&](actor_role role) {
      const auto& s = by_role[static_cast<int>(role)];
      std::string name(to_string(role));
      if (s.paths.empty()) {
        error("nodes", "the deployment has no " + name +
                           " actor; exactly one is required (role = \"" + name + "\")");
      }
      for (size_t k = 1; k < s.paths.size(); ++k) {
        error(s.paths[k] + ".role", "a second " + name + " actor ('" + s.addresses[k] +
                                        "'; the first is '" + s.addresses[0] + "' at " +
                                        sink_.where(positions_.find(s.paths[0] + ".role")) +
                                        "); exactly one is allowed");
      }
    };
    auto at_least_one_role = [&](actor_role role) {
      std::string name(to_string(role));
      if (by_role[static_cast<int>(role)].paths.empty()) {
        error("nodes", "the deployment has no " + name +
                           " actor; at least one is required (role = \"" + name + "\")");
      }
    };
    exactly_one(actor_role::router);
    exactly_one(actor_role::broker);
    at_least_one_role(actor_role::prefill);
    at_least_one_role(actor_role::decode);
  }

  const deployment_config& config_;
  const position_map& positions_;
  diagnostic_sink& sink_;
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Public entry points
// ---------------------------------------------------------------------------------------

deployment_config parse_config(std::string_view toml_text, const std::string& source_name) {
  diagnostic_sink sink(source_name);
  toml::table root;
  try {
    root = toml::parse(toml_text, std::string_view{source_name});
  } catch (const toml::parse_error& e) {
    sink.add(pos_of(e.source()), "", "syntax error: " + std::string(e.description()));
    sink.throw_if_any();
  }
  deployment_config config;
  config.source = source_name;
  position_map positions;
  reader(sink, positions).read_root(root, config);
  sink.throw_if_any();
  validator(config, positions, sink).run();
  sink.throw_if_any();
  return config;
}

deployment_config load_config(const std::filesystem::path& file) {
  const std::string name = file.string();
  auto fail = [&](std::string message) {
    throw config_error(std::vector<config_diagnostic>{{name, 0, 0, "", std::move(message)}});
  };
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec)) fail("cannot read config file: is a directory");
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    fail("cannot read config file: " + std::string(std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail("cannot read config file: read error");
  return parse_config(text.str(), name);
}

void validate_config(const deployment_config& config) {
  diagnostic_sink sink(config.source.string());
  position_map no_positions;
  validator(config, no_positions, sink).run();
  sink.throw_if_any();
}

deployment_config default_config() {
  deployment_config config;
  node_config node;
  node.name = "local";
  node.endpoint = "inproc://duet-local";
  auto add = [&](std::string name, actor_role role) {
    actor_config actor;
    actor.name = std::move(name);
    actor.role = role;
    node.actors.push_back(std::move(actor));
  };
  add("router", actor_role::router);
  add("broker", actor_role::broker);
  add("prefill0", actor_role::prefill);
  add("decode0", actor_role::decode);
  config.nodes.push_back(std::move(node));
  return config;
}

std::vector<std::string> config_keys() {
  std::vector<std::string> keys;
  for (const auto& table : all_tables()) {
    for (auto key : table.keys) {
      if (table.schema == "nodes" && key == nested_actors_key) continue;  // a table, not a key
      keys.push_back(std::string(table.schema) + '.' + std::string(key));
    }
  }
  return keys;
}

}  // namespace duet
