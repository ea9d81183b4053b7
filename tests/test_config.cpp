// The deployment config: shipped examples, defaults, and one test per validation rule.
// Error tests assert the exact "FILE:LINE:" of the report, so a wrong position fails.
#include <doctest/doctest.h>
#include <toml++/toml.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "runtime/config.hpp"

namespace fs = std::filesystem;
using duet::actor_role;
using duet::config_error;
using duet::deployment_config;
using duet::parse_config;

namespace {

const fs::path source_dir{DUET_SOURCE_DIR};

/// The message of the config_error that parsing `text` (named "t.toml") throws,
/// or "(accepted)" when it parses.
std::string error_of(const std::string& text) {
  try {
    (void)parse_config(text, "t.toml");
  } catch (const config_error& e) {
    return e.what();
  }
  return "(accepted)";
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

/// Checks that parsing `text` fails with a report containing every one of `parts`.
#define CHECK_REJECTS(text, ...)                                                       \
  do {                                                                                 \
    const std::string message_ = error_of(text);                                       \
    INFO("error: " << message_);                                                       \
    for (const std::string& part_ : std::initializer_list<std::string>{__VA_ARGS__}) { \
      CHECK_MESSAGE(contains(message_, part_), "missing: " << part_);                  \
    }                                                                                  \
  } while (false)

/// A valid node block (15 lines) with one actor of each role; tests put sections above it.
const std::string one_node = R"([[nodes]]
name = "n1"
endpoint = "inproc://n1"
[[nodes.actors]]
name = "router"
role = "router"
[[nodes.actors]]
name = "broker"
role = "broker"
[[nodes.actors]]
name = "prefill0"
role = "prefill"
[[nodes.actors]]
name = "decode0"
role = "decode"
)";

std::string read_text(const fs::path& file) {
  std::ifstream in(file);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

std::vector<std::string> actor_names(const duet::node_config& node) {
  std::vector<std::string> names;
  for (const auto& a : node.actors) names.push_back(a.name);
  return names;
}

/// Every key set in a TOML table, as schema paths ("nodes.actors.role").
void collect_keys(const toml::table& table, const std::string& prefix, std::set<std::string>& out) {
  for (const auto& [k, v] : table) {
    std::string path = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const auto* t = v.as_table()) {
      collect_keys(*t, path, out);
    } else if (const auto* a = v.as_array(); a && a->is_array_of_tables()) {
      for (const auto& e : *a) collect_keys(*e.as_table(), path, out);
    } else {
      out.insert(path);
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Shipped files and defaults
// ---------------------------------------------------------------------------------------

TEST_CASE("the single-process example runs every role on one inproc node") {
  auto config = duet::load_config(source_dir / "config/local-sim.toml");
  CHECK(config.source == source_dir / "config/local-sim.toml");
  REQUIRE(config.nodes.size() == 1);
  CHECK(config.nodes[0].name == "local");
  CHECK(config.nodes[0].endpoint == "inproc://local");
  CHECK(actor_names(config.nodes[0]) ==
        std::vector<std::string>{"router", "broker", "prefill0", "decode0"});
  CHECK(config.nodes[0].actors[0].role == actor_role::router);
  CHECK(config.nodes[0].actors[1].role == actor_role::broker);
  CHECK(config.nodes[0].actors[2].role == actor_role::prefill);
  CHECK(config.nodes[0].actors[3].role == actor_role::decode);
  CHECK(config.engine.kind == "sim");
  CHECK(config.engine.gpu == "h200");
}

TEST_CASE("the two-node example puts prefill on n1 and two decode actors on n2 over ipc") {
  auto config = duet::load_config(source_dir / "config/two-nodes-sim.toml");
  REQUIRE(config.nodes.size() == 2);
  const auto* n1 = config.find_node("n1");
  const auto* n2 = config.find_node("n2");
  REQUIRE(n1);
  REQUIRE(n2);
  CHECK(n1->endpoint == "ipc:///tmp/duet-n1.sock");
  CHECK(n2->endpoint == "ipc:///tmp/duet-n2.sock");
  CHECK(actor_names(*n1) == std::vector<std::string>{"router", "broker", "prefill0"});
  CHECK(actor_names(*n2) == std::vector<std::string>{"decode0", "decode1"});
  CHECK(n2->actors[0].role == actor_role::decode);
  CHECK(n2->actors[1].role == actor_role::decode);
  CHECK(n2->actors[1].sm_share == doctest::Approx(0.5));
}

TEST_CASE("the single-GPU example puts CUDA prefill and decode actors on device 0 with pools sized from memory") {
  auto config = duet::load_config(source_dir / "config/single-gpu.toml");
  CHECK(config.engine.kind == "cuda");
  REQUIRE(config.nodes.size() == 1);
  CHECK(actor_names(config.nodes[0]) == std::vector<std::string>{"router", "broker", "prefill0", "decode0"});
  const auto& prefill = config.nodes[0].actors[2];
  const auto& decode = config.nodes[0].actors[3];
  CHECK(prefill.device == 0);
  CHECK(decode.device == 0);
  CHECK(prefill.chunk_tokens == 2048);
  CHECK(prefill.kv_memory_fraction == doctest::Approx(0.15));
  CHECK(decode.kv_memory_fraction == doctest::Approx(0.8));
  CHECK(config.nodes[0].http == "127.0.0.1:8080");
}

TEST_CASE("the tcp example binds two nodes on 127.0.0.1 ports 5601 and 5602") {
  auto config = duet::load_config(source_dir / "config/tcp-sim.toml");
  REQUIRE(config.nodes.size() == 2);
  CHECK(config.nodes[0].endpoint == "tcp://127.0.0.1:5601");
  CHECK(config.nodes[1].endpoint == "tcp://127.0.0.1:5602");
  CHECK(config.router.policy == "round_robin");
  CHECK(config.engine.time_scale == doctest::Approx(0.5));
  size_t prefill = 0, decode = 0;
  for (const auto& node : config.nodes) {
    for (const auto& a : node.actors) {
      prefill += a.role == actor_role::prefill;
      decode += a.role == actor_role::decode;
    }
  }
  CHECK(prefill == 1);
  CHECK(decode == 1);
}

TEST_CASE("every config key is set in a shipped example and described in docs/config.md") {
  std::set<std::string> shipped;
  for (const auto& entry : fs::directory_iterator(source_dir / "config")) {
    if (entry.path().extension() != ".toml") continue;
    if (entry.path().filename() == "gpus.toml") continue;  // the simulator's GPU table, not a deployment
    INFO(entry.path());
    CHECK_NOTHROW((void)duet::load_config(entry.path()));
    collect_keys(toml::parse_file(entry.path().string()), "", shipped);
  }
  const std::string docs = read_text(source_dir / "docs/config.md");
  for (const auto& key : duet::config_keys()) {
    INFO(key);
    CHECK(shipped.count(key) == 1);
    CHECK(contains(docs, "| `" + key.substr(key.rfind('.') + 1) + "` |"));  // a table row
  }
  for (const auto& key : shipped) {
    INFO(key);
    auto keys = duet::config_keys();
    CHECK(std::find(keys.begin(), keys.end(), key) != keys.end());
  }
}

TEST_CASE("keys left out of a file take the defaults written in config.hpp") {
  auto config = parse_config(one_node, "t.toml");
  const deployment_config defaults;
  CHECK(config.model.name == defaults.model.name);
  CHECK(config.model.preset == "r1-distill-llama-8b");
  CHECK(config.model.dtype == "bf16");
  CHECK(config.model.max_context == 32768);
  CHECK(config.model.block_tokens == 16);
  CHECK(config.engine.kind == "sim");
  CHECK(config.engine.gpu == "h200");
  CHECK(config.engine.time_scale == 1.0);
  CHECK(config.engine.threads == 0);
  CHECK(config.router.policy == "least_loaded");
  CHECK(config.router.queue_limit == 4096);
  CHECK(config.broker.lease_ms == 10000);
  CHECK(config.broker.reclaim_interval_ms == 250);
  CHECK(config.transport.heartbeat_ms == 1000);
  CHECK(config.transport.max_frame_bytes == 64u << 20);
  REQUIRE(config.nodes.size() == 1);
  CHECK(config.nodes[0].http.empty());
  const auto& prefill = config.nodes[0].actors[2];
  const duet::actor_config actor_defaults;
  CHECK(prefill.device == 0);
  CHECK(prefill.sm_share == 1.0);
  CHECK(prefill.stream == "own");
  CHECK(prefill.kv_blocks == actor_defaults.kv_blocks);
  CHECK(prefill.kv_memory_fraction == 0.0);
  CHECK(prefill.max_batch == 64);
  CHECK(prefill.chunk_tokens == 2048);
  CHECK(config.source == "t.toml");
}

TEST_CASE("set values replace the defaults and integers are accepted for fractional keys") {
  auto config = parse_config(R"([engine]
time_scale = 0
threads = 8
[model]
block_tokens = 32
)" + one_node + R"(sm_share = 1
kv_memory_fraction = 0.9
)",
                             "t.toml");
  CHECK(config.engine.time_scale == 0.0);
  CHECK(config.engine.threads == 8);
  CHECK(config.model.block_tokens == 32);
  CHECK(config.nodes[0].actors[3].sm_share == 1.0);
  CHECK(config.nodes[0].actors[3].kv_memory_fraction == doctest::Approx(0.9));
}

TEST_CASE("the built-in default deployment is one local node with every role and is valid") {
  auto config = duet::default_config();
  CHECK(config.source.empty());
  REQUIRE(config.nodes.size() == 1);
  CHECK(config.nodes[0].name == "local");
  CHECK(config.nodes[0].endpoint == "inproc://duet-local");
  CHECK(actor_names(config.nodes[0]) ==
        std::vector<std::string>{"router", "broker", "prefill0", "decode0"});
  CHECK(config.engine.kind == "sim");
  CHECK(config.model.preset == "r1-distill-llama-8b");
  CHECK_NOTHROW(duet::validate_config(config));
}

TEST_CASE("find_node returns the named node, or null for a name not in the deployment") {
  auto config = duet::load_config(source_dir / "config/two-nodes-sim.toml");
  REQUIRE(config.find_node("n2") != nullptr);
  CHECK(config.find_node("n2")->name == "n2");
  CHECK(config.find_node("n3") == nullptr);
  CHECK(config.find_node("") == nullptr);
}

TEST_CASE("actor roles convert to their names and back") {
  for (auto role :
       {actor_role::router, actor_role::prefill, actor_role::decode, actor_role::broker}) {
    CHECK(duet::actor_role_from_string(duet::to_string(role)) == role);
  }
  CHECK(duet::to_string(actor_role::prefill) == "prefill");
  CHECK_FALSE(duet::actor_role_from_string("Prefill").has_value());
  CHECK_FALSE(duet::actor_role_from_string("").has_value());
}

// ---------------------------------------------------------------------------------------
// Error format and reporting
// ---------------------------------------------------------------------------------------

TEST_CASE("an error reads FILE:LINE:COLUMN: key 'a.b': what is wrong, with diagnostics") {
  const std::string text = "[router]\npolicy = \"fastest\"\n" + one_node;
  try {
    (void)parse_config(text, "deploy.toml");
    FAIL("accepted an unknown router policy");
  } catch (const config_error& e) {
    CHECK(std::string(e.what()) ==
          "deploy.toml:2:10: key 'router.policy': must be one of: least_loaded, round_robin "
          "(got 'fastest')");
    REQUIRE(e.diagnostics().size() == 1);
    const auto& d = e.diagnostics()[0];
    CHECK(d.source == "deploy.toml");
    CHECK(d.line == 2);
    CHECK(d.column == 10);
    CHECK(d.key == "router.policy");
    CHECK(duet::to_string(d) == e.what());
  }
}

TEST_CASE("every error of a file is reported at once, in line order") {
  const std::string text = R"([transport]
heartbeat_ms = "1s"
[model]
dtype = 16
nmae = "x"
)" + one_node;
  const std::string message = error_of(text);
  auto l2 = message.find("t.toml:2:");
  auto l4 = message.find("t.toml:4:");
  auto l5 = message.find("t.toml:5:");
  REQUIRE(l2 != std::string::npos);
  REQUIRE(l4 != std::string::npos);
  REQUIRE(l5 != std::string::npos);
  CHECK(l2 < l4);
  CHECK(l4 < l5);
}

TEST_CASE("a TOML syntax error is reported at the parser's line and column") {
  CHECK_REJECTS("[model]\nname = \"x\"\nblock_tokens = = 16\n", "t.toml:3:16: ", "syntax error");
  CHECK_REJECTS("[model]\nname = \"unterminated\n", "t.toml:2:", "syntax error");
  CHECK_REJECTS("[model]\nname = \"a\"\nname = \"b\"\n", "t.toml:3:", "syntax error", "redefine");
}

TEST_CASE("a file that cannot be read is reported with its name") {
  const fs::path missing = source_dir / "config/no-such-file.toml";
  try {
    (void)duet::load_config(missing);
    FAIL("loaded a missing file");
  } catch (const config_error& e) {
    CHECK(contains(e.what(), missing.string() + ": cannot read config file"));
  }
  CHECK_THROWS_AS((void)duet::load_config(source_dir / "config"), config_error);
}

TEST_CASE("a load_config error names the path it was given") {
  const fs::path file = fs::temp_directory_path() / "duet-test-config-bad.toml";
  {
    std::ofstream out(file);
    out << "[model]\n\nblock_tokens = 12\n" << one_node;
  }
  try {
    (void)duet::load_config(file);
    FAIL("accepted block_tokens = 12");
  } catch (const config_error& e) {
    CHECK(contains(e.what(), file.string() + ":3:16: key 'model.block_tokens'"));
  }
  fs::remove(file);
}

// ---------------------------------------------------------------------------------------
// Keys and types
// ---------------------------------------------------------------------------------------

TEST_CASE("an unknown key is reported at its line with the closest known key suggested") {
  const std::string text = R"([model]
name = "m"
[engine]
kind = "sim"
[router]
queue_limit = 10
polcy = "round_robin"
)" + one_node;
  CHECK_REJECTS(text, "t.toml:7:1: key 'router.polcy': unknown key; did you mean 'policy'?");
  CHECK_REJECTS("[modle]\n" + one_node,
                "t.toml:1:2: key 'modle': unknown key; did you mean 'model'?");
  CHECK_REJECTS(R"([[nodes]]
name = "n1"
endpoint = "inproc://n1"
[[nodes.actors]]
name = "router"
role = "router"
smshare = 0.5
)",
                "t.toml:7:1: key 'nodes[0].actors[0].smshare': unknown key; did you mean "
                "'sm_share'?");
}

TEST_CASE("stream_prefill needs the stream path and an engine with KV bytes") {
  const std::string cpu = "[model]\nname = \"m\"\npath = \"m.gguf\"\n[engine]\nkind = \"cpu\"\n";
  CHECK_REJECTS(cpu + "[broker]\nstream_prefill = \"chunks\"\n" + one_node,
                "key 'broker.stream_prefill': \"chunks\" streams KV over the stream path: it needs "
                "broker.transfer = \"stream\" (got \"auto\")");
  CHECK_REJECTS("[broker]\ntransfer = \"stream\"\nstream_prefill = \"chunks\"\n" + one_node,
                "key 'broker.stream_prefill': \"chunks\" needs an engine that holds KV bytes (cpu or cuda), not the "
                "sim engine");
  CHECK_REJECTS("[broker]\nstream_prefill = \"layers\"\n" + one_node, "broker.stream_prefill");
  const auto ok = duet::parse_config(cpu + "[broker]\ntransfer = \"stream\"\nstream_prefill = \"chunks\"\n" + one_node,
                                     "t.toml");
  CHECK(ok.broker.stream_prefill == "chunks");
}

TEST_CASE("router.first_token is prefill unless set to decode, and nothing else") {
  CHECK(duet::parse_config(one_node, "t.toml").router.first_token == "prefill");
  CHECK(duet::parse_config("[router]\nfirst_token = \"decode\"\n" + one_node, "t.toml").router.first_token ==
        "decode");
  CHECK_REJECTS("[router]\nfirst_token = \"router\"\n" + one_node,
                "t.toml:2:15: key 'router.first_token': must be one of: prefill, decode (got 'router')");
}

TEST_CASE("an unknown key unlike any known one lists the keys its table accepts") {
  CHECK_REJECTS("[broker]\ncolour = \"red\"\n" + one_node,
                "t.toml:2:1: key 'broker.colour': unknown key (known keys here: lease_ms, "
                "reclaim_interval_ms, transfer_timeout_ms, stream_chunk_bytes, stream_window, transfer, "
                "stream_prefill)");
  CHECK_REJECTS("title = \"x\"\n" + one_node, "t.toml:1:1: key 'title': unknown key");
}

TEST_CASE("a key written in the wrong table names the table it belongs in") {
  CHECK_REJECTS("[engine]\nblock_tokens = 16\n" + one_node,
                "t.toml:2:1: key 'engine.block_tokens': unknown key; 'block_tokens' belongs in "
                "[model]");
  CHECK_REJECTS(R"([[nodes]]
name = "n1"
endpoint = "inproc://n1"
role = "router"
)",
                "t.toml:4:1: key 'nodes[0].role': unknown key; 'role' belongs in "
                "[[nodes.actors]]");
  CHECK_REJECTS("[router]\nname = \"r\"\n" + one_node,
                "t.toml:2:1: key 'router.name': unknown key; 'name' belongs in [model], "
                "[[nodes]] or [[nodes.actors]]");
}

TEST_CASE("a value of the wrong type is reported at the value") {
  CHECK_REJECTS("[model]\nmax_context = \"32k\"\n" + one_node,
                "t.toml:2:15: key 'model.max_context': expected an integer, got a string");
  CHECK_REJECTS("[model]\nname = 7\n" + one_node,
                "t.toml:2:8: key 'model.name': expected a string, got an integer");
  CHECK_REJECTS("[engine]\ntime_scale = true\n" + one_node,
                "t.toml:2:14: key 'engine.time_scale': expected a number, got a boolean");
  CHECK_REJECTS("[broker]\nlease_ms = 1.5\n" + one_node,
                "t.toml:2:12: key 'broker.lease_ms': expected an integer, got a float");
  CHECK_REJECTS("model = \"llama\"\n" + one_node,
                "t.toml:1:9: key 'model': expected a table ([model]), got a string");
  CHECK_REJECTS("[nodes]\nname = \"n1\"\n",
                "t.toml:1:1: key 'nodes': expected an array of tables ([[nodes]]), got a table");
  CHECK_REJECTS("[engine]\ntime_scale = nan\n" + one_node,
                "t.toml:2:14: key 'engine.time_scale': must be a finite number");
}

TEST_CASE("negative numbers and integers beyond uint32 are rejected") {
  CHECK_REJECTS("[router]\nqueue_limit = -1\n" + one_node,
                "t.toml:2:15: key 'router.queue_limit': must not be negative (got -1)");
  CHECK_REJECTS("[transport]\nmax_frame_bytes = 4294967296\n" + one_node,
                "t.toml:2:19: key 'transport.max_frame_bytes': out of range (got 4294967296; "
                "at most 4294967295)");
  CHECK_REJECTS(one_node + "device = -2\n",
                "t.toml:16:10: key 'nodes[0].actors[3].device': must not be negative");
  CHECK_NOTHROW((void)parse_config("[transport]\nmax_frame_bytes = 4294967295\n" + one_node, "t"));
}

TEST_CASE("a missing required key is reported at its enclosing table") {
  CHECK_REJECTS(R"([[nodes]]
endpoint = "inproc://n1"
)",
                "t.toml:1:1: key 'nodes[0].name': required key is missing");
  CHECK_REJECTS(R"([[nodes]]
name = "n1"
endpoint = "inproc://n1"
[[nodes.actors]]
name = "router"
[[nodes.actors]]
role = "broker"
)",
                "t.toml:4:1: key 'nodes[0].actors[0].role': required key is missing",
                "t.toml:6:1: key 'nodes[0].actors[1].name': required key is missing");
  CHECK_REJECTS("[[nodes]]\nname = \"n1\"\n", "t.toml:1:1: key 'nodes[0].endpoint'");
}

// ---------------------------------------------------------------------------------------
// Enumerations
// ---------------------------------------------------------------------------------------

TEST_CASE("enumerated values outside their set are rejected with the allowed values") {
  CHECK_REJECTS(one_node + "[[nodes.actors]]\nname = \"x\"\nrole = \"prefil\"\n",
                "t.toml:18:8: key 'nodes[0].actors[4].role': must be one of: router, prefill, "
                "decode, broker (got 'prefil'; did you mean 'prefill'?)");
  CHECK_REJECTS("[engine]\nkind = \"gpu\"\n" + one_node,
                "t.toml:2:8: key 'engine.kind': must be one of: sim, cpu, cuda (got 'gpu'");
  CHECK_REJECTS("[router]\npolicy = \"round-robin\"\n" + one_node,
                "t.toml:2:10: key 'router.policy': must be one of: least_loaded, round_robin "
                "(got 'round-robin'; did you mean 'round_robin'?)");
  CHECK_REJECTS("[model]\ndtype = \"fp16\"\n" + one_node,
                "t.toml:2:9: key 'model.dtype': must be one of: bf16, f16, f32");
  for (const char* ok : {"sim", "cpu", "cuda"}) {
    CHECK_NOTHROW(
        (void)parse_config("[engine]\nkind = \"" + std::string(ok) + "\"\n" + one_node, "t"));
  }
}

// ---------------------------------------------------------------------------------------
// Nodes and endpoints
// ---------------------------------------------------------------------------------------

TEST_CASE("a deployment without nodes is rejected") {
  CHECK_REJECTS("[model]\nname = \"m\"\n", "t.toml:1:1: key 'nodes': the deployment has no nodes");
  CHECK_REJECTS("", "t.toml:", "key 'nodes': the deployment has no nodes");
}

TEST_CASE("a node without actors is rejected at the node") {
  CHECK_REJECTS(one_node + "[[nodes]]\nname = \"n2\"\nendpoint = \"inproc://n2\"\n",
                "t.toml:16:1: key 'nodes[1].actors': node has no actors");
}

TEST_CASE("a duplicate node name is reported at the second one, naming the first") {
  CHECK_REJECTS(one_node +
                    "[[nodes]]\nname = \"n1\"\nendpoint = \"inproc://n2\"\n"
                    "[[nodes.actors]]\nname = \"decode1\"\nrole = \"decode\"\n",
                "t.toml:17:8: key 'nodes[1].name': duplicate node name 'n1' (first used at "
                "t.toml:2:8)");
}

TEST_CASE("node and actor names are limited to letters, digits, '_', '-' and '.'") {
  CHECK_REJECTS(R"([[nodes]]
name = "n/1"
endpoint = "inproc://n1"
)",
                "t.toml:2:8: key 'nodes[0].name': must contain only letters");
  CHECK_REJECTS(one_node + "[[nodes.actors]]\nname = \"\"\nrole = \"decode\"\n",
                "t.toml:17:8: key 'nodes[0].actors[4].name': must not be empty");
}

TEST_CASE("a duplicate endpoint is reported at the second node, naming the first") {
  CHECK_REJECTS(one_node +
                    "[[nodes]]\nname = \"n2\"\nendpoint = \"inproc://n1\"\n"
                    "[[nodes.actors]]\nname = \"decode1\"\nrole = \"decode\"\n",
                "t.toml:18:12: key 'nodes[1].endpoint': duplicate endpoint 'inproc://n1' (also "
                "used at t.toml:3:12)");
}

TEST_CASE("an endpoint needs the inproc, ipc or tcp scheme and tcp needs host:port") {
  auto with_endpoint = [](const std::string& endpoint) {
    std::string text = one_node;
    text.replace(text.find("inproc://n1"), 11, endpoint);
    return text;
  };
  CHECK_REJECTS(with_endpoint("udp://127.0.0.1:5601"),
                "t.toml:3:12: key 'nodes[0].endpoint': must start with inproc://, ipc:// or "
                "tcp://");
  CHECK_REJECTS(with_endpoint("127.0.0.1:5601"), "t.toml:3:12: key 'nodes[0].endpoint'");
  CHECK_REJECTS(with_endpoint("tcp://127.0.0.1"), "t.toml:3:12:", "needs host:port");
  CHECK_REJECTS(with_endpoint("tcp://:5601"), "t.toml:3:12:", "needs a host");
  CHECK_REJECTS(with_endpoint("tcp://127.0.0.1:http"), "t.toml:3:12:", "numeric port");
  CHECK_REJECTS(with_endpoint("tcp://127.0.0.1:70000"), "t.toml:3:12:", "between 1 and 65535");
  CHECK_REJECTS(with_endpoint("tcp://*:5601"), "t.toml:3:12:", "not '*'");
  CHECK_REJECTS(with_endpoint("ipc://"), "t.toml:3:12:", "needs a socket path");
  CHECK_REJECTS(with_endpoint("ipc:///" + std::string(120, 'x')),
                "t.toml:3:12:", "Unix sockets allow at most 107");
  CHECK_REJECTS(with_endpoint("inproc://"), "t.toml:3:12:", "needs a name");
  CHECK_REJECTS(with_endpoint(""), "t.toml:3:12: key 'nodes[0].endpoint': must not be empty");
  for (const char* ok : {"tcp://127.0.0.1:5601", "tcp://localhost:1", "tcp://[::1]:5601",
                         "ipc:///tmp/duet.sock", "ipc://duet-relative.sock", "inproc://x"}) {
    INFO(ok);
    CHECK_NOTHROW((void)parse_config(with_endpoint(ok), "t"));
  }
}

TEST_CASE("an HTTP address must be host:port") {
  auto with_http = [](const std::string& http) {
    return one_node.substr(0, one_node.find("[[nodes.actors]]")) + "http = \"" + http + "\"\n" +
           one_node.substr(one_node.find("[[nodes.actors]]"));
  };
  CHECK_REJECTS(with_http("8080"), "t.toml:4:8: key 'nodes[0].http': needs host:port");
  CHECK_REJECTS(with_http("0.0.0.0:0"), "t.toml:4:8:", "between 1 and 65535");
  CHECK_NOTHROW((void)parse_config(with_http("0.0.0.0:8080"), "t"));
}

// ---------------------------------------------------------------------------------------
// Actors and roles
// ---------------------------------------------------------------------------------------

TEST_CASE("actor names are unique within a node but may repeat across nodes") {
  CHECK_REJECTS(one_node + "[[nodes.actors]]\nname = \"decode0\"\nrole = \"decode\"\n",
                "t.toml:17:8: key 'nodes[0].actors[4].name': duplicate actor name 'decode0' in "
                "node 'n1' (first used at t.toml:14:8)");
  CHECK_NOTHROW((void)parse_config(one_node + "[[nodes]]\nname = \"n2\"\nendpoint = "
                                              "\"inproc://n2\"\n[[nodes.actors]]\nname = "
                                              "\"decode0\"\nrole = \"decode\"\n",
                                   "t"));
}

TEST_CASE("a deployment has exactly one router and one broker") {
  CHECK_REJECTS(one_node + "[[nodes.actors]]\nname = \"router2\"\nrole = \"router\"\n",
                "t.toml:18:8: key 'nodes[0].actors[4].role': a second router actor ('n1/router2'; "
                "the first is 'n1/router' at t.toml:6:8); exactly one is allowed");
  CHECK_REJECTS(one_node +
                    "[[nodes]]\nname = \"n2\"\nendpoint = \"inproc://n2\"\n"
                    "[[nodes.actors]]\nname = \"broker\"\nrole = \"broker\"\n",
                "t.toml:21:8: key 'nodes[1].actors[0].role': a second broker actor ('n2/broker'");
  CHECK_REJECTS(R"([[nodes]]
name = "n1"
endpoint = "inproc://n1"
[[nodes.actors]]
name = "prefill0"
role = "prefill"
[[nodes.actors]]
name = "decode0"
role = "decode"
)",
                "t.toml:1:1: key 'nodes': the deployment has no router actor; exactly one is "
                "required",
                "t.toml:1:1: key 'nodes': the deployment has no broker actor");
}

TEST_CASE("a deployment has at least one prefill and one decode actor") {
  CHECK_REJECTS(R"([[nodes]]
name = "n1"
endpoint = "inproc://n1"
[[nodes.actors]]
name = "router"
role = "router"
[[nodes.actors]]
name = "broker"
role = "broker"
)",
                "t.toml:1:1: key 'nodes': the deployment has no prefill actor; at least one is "
                "required",
                "t.toml:1:1: key 'nodes': the deployment has no decode actor");
}

TEST_CASE("sm_share lies in (0, 1]") {
  CHECK_REJECTS(one_node + "sm_share = 0\n",
                "t.toml:16:12: key 'nodes[0].actors[3].sm_share': must be in (0, 1] (got 0)");
  CHECK_REJECTS(one_node + "sm_share = 1.5\n",
                "t.toml:16:12: key 'nodes[0].actors[3].sm_share': must be in (0, 1] (got 1.5)");
  CHECK_REJECTS(one_node + "sm_share = -0.25\n", "t.toml:16:12:", "must be in (0, 1]");
  CHECK_NOTHROW((void)parse_config(one_node + "sm_share = 1.0\n", "t"));
  CHECK_NOTHROW((void)parse_config(one_node + "sm_share = 0.01\ndevice = 1\n", "t"));
}

namespace {

/// A node with a router, a broker, prefill0 and decode0, each worker's extra keys appended to
/// its table (one "key = value" line each, or nothing).
std::string node_with_shares(const std::string& prefill_keys, const std::string& decode_keys) {
  return R"([[nodes]]
name = "n1"
endpoint = "inproc://n1"
[[nodes.actors]]
name = "router"
role = "router"
[[nodes.actors]]
name = "broker"
role = "broker"
[[nodes.actors]]
name = "prefill0"
role = "prefill"
)" + prefill_keys + R"([[nodes.actors]]
name = "decode0"
role = "decode"
)" + decode_keys;
}

}  // namespace

TEST_CASE("split SM shares of the actors on one GPU sum to at most 1") {
  const std::string split = node_with_shares("sm_share = 0.7\n", "sm_share = 0.4\n");
  CHECK_REJECTS(split,
                "t.toml:17:12: key 'nodes[0].actors[3].sm_share': prefill and decode "
                "actors on device 0 of node 'n1' have sm_share below 1 summing to 1.1");
  std::string other_device = split + "device = 1\n";
  CHECK_NOTHROW((void)parse_config(other_device, "t"));
  // Unsplit actors (sm_share = 1) share the whole GPU, as in colocated serving.
  CHECK_NOTHROW((void)parse_config(one_node, "t"));
}

TEST_CASE("an actor at sm_share 1 beside a split runs on the whole GPU, the split's SMs included") {
  const std::string reserve = node_with_shares("sm_share = 0.85\n", "");
  const auto config = parse_config(reserve, "t");
  CHECK(config.nodes[0].actors[2].sm_share == doctest::Approx(0.85));
  CHECK(config.nodes[0].actors[3].sm_share == 1.0);
  // The shares below 1 still may not overlap one another.
  CHECK_REJECTS(reserve + "[[nodes.actors]]\nname = \"prefill1\"\nrole = \"prefill\"\nsm_share = 0.25\n",
                "t.toml:20:12: key 'nodes[0].actors[4].sm_share': prefill and decode "
                "actors on device 0 of node 'n1' have sm_share below 1 summing to 1.1");
}

TEST_CASE("an actor runs on its own stream unless it says the device's stream is shared") {
  CHECK(parse_config(one_node, "t").nodes[0].actors[3].stream == "own");
  CHECK(parse_config(one_node + "stream = \"own\"\n", "t").nodes[0].actors[3].stream == "own");
  const auto shared = parse_config(one_node + "stream = \"shared\"\n", "t");
  CHECK(shared.nodes[0].actors[3].stream == "shared");
  CHECK(shared.nodes[0].actors[2].stream == "own");
}

TEST_CASE("a stream is own or shared, and a shared stream cannot have an SM share") {
  CHECK_REJECTS(one_node + "stream = \"private\"\n",
                "t.toml:16:10: key 'nodes[0].actors[3].stream': must be one of: own, shared "
                "(got 'private'");
  CHECK_REJECTS(one_node + "stream = \"shared\"\nsm_share = 0.5\n",
                "t.toml:16:10: key 'nodes[0].actors[3].stream': \"shared\" runs on the whole GPU "
                "and cannot be combined with sm_share 0.5");
  CHECK_NOTHROW(
      (void)parse_config(one_node + "stream = \"own\"\nsm_share = 0.5\ndevice = 1\n", "t"));
}

TEST_CASE("a decode actor allocates KV on demand unless it says reserve") {
  const auto defaults = parse_config(one_node, "t");
  CHECK(defaults.nodes[0].actors[3].kv_allocation == "on_demand");
  CHECK(duet::actor_config{}.kv_allocation == "on_demand");
  const auto reserve = parse_config(one_node + "kv_allocation = \"reserve\"\n", "t");
  CHECK(reserve.nodes[0].actors[3].kv_allocation == "reserve");
  CHECK(parse_config(one_node + "kv_allocation = \"on_demand\"\n", "t").nodes[0].actors[3].kv_allocation ==
        "on_demand");
}

TEST_CASE("a kv_allocation other than on_demand or reserve is refused with file, line and key") {
  CHECK_REJECTS(one_node + "kv_allocation = \"reserved\"\n",
                "t.toml:16:17: key 'nodes[0].actors[3].kv_allocation': must be one of: on_demand, reserve "
                "(got 'reserved'; did you mean 'reserve'?)");
  CHECK_REJECTS(one_node + "kv_allocation = 1\n", "t.toml:16:17: key 'nodes[0].actors[3].kv_allocation': ");
}

TEST_CASE("kv_memory_fraction lies in [0, 1) and counts are at least 1") {
  CHECK_REJECTS(one_node + "kv_memory_fraction = 1.0\n",
                "t.toml:16:22: key 'nodes[0].actors[3].kv_memory_fraction': must be in [0, 1)");
  CHECK_REJECTS(one_node + "max_batch = 0\n",
                "t.toml:16:13: key 'nodes[0].actors[3].max_batch': must be at least 1");
  CHECK_REJECTS(one_node + "kv_blocks = 0\n",
                "t.toml:16:13: key 'nodes[0].actors[3].kv_blocks': must be at least 1");
  CHECK_REJECTS("[broker]\ntransfer_timeout_ms = 0\n" + one_node,
                "t.toml:2:23: key 'broker.transfer_timeout_ms': must be at least 1");
}

// ---------------------------------------------------------------------------------------
// Model geometry and timing rules
// ---------------------------------------------------------------------------------------

TEST_CASE("block_tokens is a power of two between 1 and 1024") {
  for (int bad : {0, 3, 24, 2048}) {
    INFO(bad);
    CHECK_REJECTS("[model]\nblock_tokens = " + std::to_string(bad) + "\n" + one_node,
                  "t.toml:2:16: key 'model.block_tokens': must be a power of two between 1 and "
                  "1024");
  }
  SUBCASE("a bad block size is one error, not one more per actor measured in blocks") {
    try {
      (void)parse_config("[model]\nblock_tokens = 24\n" + one_node, "t.toml");
      FAIL("accepted block_tokens = 24");
    } catch (const config_error& e) {
      CHECK(e.diagnostics().size() == 1);
    }
  }
  for (int ok : {1, 16, 1024}) {
    INFO(ok);
    CHECK_NOTHROW(
        (void)parse_config("[model]\nblock_tokens = " + std::to_string(ok) + "\n" + one_node, "t"));
  }
}

TEST_CASE("chunk_tokens is a multiple of block_tokens and at least one block") {
  CHECK_REJECTS("[model]\nblock_tokens = 64\n" + one_node + "chunk_tokens = 32\n",
                "t.toml:18:16: key 'nodes[0].actors[3].chunk_tokens': must be a multiple of "
                "model.block_tokens (64) and at least it (got 32)");
  CHECK_REJECTS("[model]\nblock_tokens = 64\n" + one_node + "chunk_tokens = 100\n",
                "t.toml:18:16: key 'nodes[0].actors[3].chunk_tokens'");
  CHECK_NOTHROW(
      (void)parse_config("[model]\nblock_tokens = 64\n" + one_node + "chunk_tokens = 64\n", "t"));
}

TEST_CASE("max_context holds at least one block") {
  CHECK_REJECTS("[model]\nblock_tokens = 64\nmax_context = 32\n" + one_node,
                "t.toml:3:15: key 'model.max_context': must be at least model.block_tokens (64; "
                "got 32)");
}

TEST_CASE("heartbeats come faster than the peer timeout and sweeps faster than the lease") {
  CHECK_REJECTS("[transport]\npeer_timeout_ms = 1000\nheartbeat_ms = 1000\n" + one_node,
                "t.toml:3:16: key 'transport.heartbeat_ms': must be less than "
                "transport.peer_timeout_ms");
  CHECK_REJECTS("[broker]\nlease_ms = 100\nreclaim_interval_ms = 500\n" + one_node,
                "t.toml:3:23: key 'broker.reclaim_interval_ms': must not exceed broker.lease_ms");
  CHECK_REJECTS("[transport]\nmax_frame_bytes = 100\n" + one_node,
                "t.toml:2:19: key 'transport.max_frame_bytes': must be at least 1024");
}

TEST_CASE("the sim engine needs a GPU spec and a shape preset") {
  CHECK_REJECTS("[engine]\ngpu = \"\"\n" + one_node,
                "t.toml:2:7: key 'engine.gpu': must name a GPU spec");
  CHECK_REJECTS("[model]\npreset = \"\"\n" + one_node,
                "t.toml:2:10: key 'model.preset': must name a shape preset");
  CHECK_NOTHROW((void)parse_config("[engine]\nkind = \"cpu\"\ngpu = \"\"\n" + one_node, "t"));
}

// ---------------------------------------------------------------------------------------
// Configs built in code
// ---------------------------------------------------------------------------------------

TEST_CASE("validate_config checks a config built in code and reports keys without positions") {
  auto config = duet::default_config();
  config.nodes[0].actors[2].sm_share = 2.0;
  config.nodes[0].actors.push_back(config.nodes[0].actors[0]);  // a second "router"
  try {
    duet::validate_config(config);
    FAIL("accepted sm_share = 2 and two routers");
  } catch (const config_error& e) {
    const std::string message = e.what();
    INFO(message);
    CHECK(contains(message, "<config>: key 'nodes[0].actors[2].sm_share': must be in (0, 1]"));
    CHECK(contains(message, "key 'nodes[0].actors[4].name': duplicate actor name 'router'"));
    CHECK(contains(message, "key 'nodes[0].actors[4].role': a second router actor"));
    CHECK(e.diagnostics().size() == 3);
    for (const auto& d : e.diagnostics()) CHECK(d.line == 0);
  }
  duet::deployment_config empty;
  CHECK_THROWS_WITH_AS(duet::validate_config(empty),
                       "<config>: key 'nodes': the deployment has no nodes; add at least one "
                       "[[nodes]] table",
                       config_error);
}
