// The `duet model random` and `duet tokenize` commands, run as a user runs them (fork/exec of
// the built binary), and the model/tokenizer agreement check (runtime/vocab_check.hpp).
#include <doctest/doctest.h>
#include <fcntl.h>

#include <array>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "runtime/engine.hpp"
#include "runtime/engine_bench.hpp"
#include "runtime/gpu_catalog.hpp"
#include "runtime/model_shape.hpp"
#include "runtime/hf_model.hpp"
#include "runtime/http_api.hpp"
#include "runtime/http_frontend.hpp"
#include "runtime/random_checkpoint.hpp"
#include "runtime/tokenizer.hpp"
#include "runtime/vocab_check.hpp"
#include "tests/process_util.hpp"

using namespace duet;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const fs::path tokenizers = fs::path(DUET_TEST_DATA) / "tokenizers";

struct temp_dir {
  fs::path path;
  temp_dir() {
    static int n = 0;
    path = fs::temp_directory_path() /
           ("duet-test-cli-" + std::to_string(getpid()) + "-" + std::to_string(n++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

/// What a run of `duet` did: its exit code (-1: killed by a signal or the timeout), stdout, stderr.
struct run_result {
  int code = -1;
  std::string out;
  std::string err;
};

/// Runs `duet args...` with `input` on stdin and stdout/stderr captured in files (so neither is
/// a terminal), killing it after `timeout`.
run_result run_duet(std::vector<std::string> args, const std::string& input = {},
                    std::chrono::seconds timeout = std::chrono::seconds(120)) {
  temp_dir io;
  const fs::path in = io.path / "in", out = io.path / "out", err = io.path / "err";
  std::ofstream(in, std::ios::binary) << input;
  args.insert(args.begin(), testing::duet_binary());
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd_in = open(in.c_str(), O_RDONLY);
    const int fd_out = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const int fd_err = open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd_in, 0);
    dup2(fd_out, 1);
    dup2(fd_err, 2);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  run_result r;
  int status = 0;
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > until) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      status = -1;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (status != -1 && WIFEXITED(status)) r.code = WEXITSTATUS(status);
  r.out = read_file(out);
  r.err = read_file(err);
  return r;
}

/// The first `n` golden cases of tests/data/tokenizer-golden/<model>.jsonl whose text can be a
/// command-line argument (no NUL).
std::vector<std::pair<std::string, std::vector<int32_t>>> golden(const std::string& model,
                                                                 std::size_t n) {
  std::ifstream in(fs::path(DUET_TEST_DATA) / "tokenizer-golden" / (model + ".jsonl"));
  std::vector<std::pair<std::string, std::vector<int32_t>>> cases;
  for (std::string line; cases.size() < n && std::getline(in, line);) {
    const json j = json::parse(line);
    const std::string text = j["text"];
    if (text.find('\0') != std::string::npos || text.empty()) continue;
    cases.emplace_back(text, j["ids"].get<std::vector<int32_t>>());
  }
  return cases;
}

std::string joined(const std::vector<int32_t>& ids) {
  std::string s;
  for (std::size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
  return s;
}

const tokenizer_spec& spec_of(const std::string& model) {
  static std::map<std::string, tokenizer_spec> specs;
  auto it = specs.find(model);
  if (it == specs.end()) it = specs.emplace(model, load_tokenizer_json(tokenizers / model)).first;
  return it->second;
}

model_vocab vocab(uint32_t size, std::optional<int32_t> bos, std::vector<int32_t> eos) {
  model_vocab m;
  m.source = "config.json";
  m.vocab_size = size;
  m.bos_id = bos;
  m.eos_ids = std::move(eos);
  return m;
}

std::string mismatch_message(const model_vocab& m, const tokenizer_spec& spec) {
  try {
    (void)check_vocab(m, spec, "tokenizer.json");
  } catch (const vocab_mismatch_error& e) {
    return e.what();
  }
  return "(accepted)";
}

/// A directory with a tiny Qwen2 config.json of `vocab_size` rows and eos ids `eos` (bos and eos
/// outside the vocabulary dropped), and the repository's Qwen tokenizer.
void write_config_with_tokenizer(const fs::path& dir, uint32_t vocab_size,
                                 std::vector<int32_t> eos) {
  const std::string model = "qwen3";
  random_checkpoint_params p;
  p.arch = "qwen2";
  p.size = "tiny";
  p.overrides.vocab = vocab_size;
  p.eos_token_ids = std::move(eos);
  std::ofstream(dir / "config.json") << hf_config_json(random_checkpoint_config(p));
  fs::copy_file(tokenizers / model / "tokenizer.json", dir / "tokenizer.json");
  fs::copy_file(tokenizers / model / "tokenizer_config.json", dir / "tokenizer_config.json");
}

}  // namespace

// ------------------------------------------------------------------ duet model random

TEST_CASE(
    "duet model random writes a checkpoint of the asked shape that the cpu engine loads, quietly") {
  temp_dir dir;
  const fs::path out = dir.path / "llama";
  const auto r =
      run_duet({"model",  "random",  "--preset", "tiny-llama", "--layers", "3",         "--hidden",
                "32",     "--heads", "2",        "--kv-heads", "1",        "--ffn",     "48",
                "--seed", "7",       "--dtype",  "f32",        "--out",    out.string()});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  CHECK(r.out.empty());  // no terminal: nothing printed
  CHECK(r.err.empty());
  for (const char* f :
       {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}) {
    CHECK_MESSAGE(fs::exists(out / f), f);
  }
  const transformer_config c = load_hf_config(out);
  CHECK(c.architecture == "LlamaForCausalLM");
  CHECK(c.num_hidden_layers == 3);
  CHECK(c.hidden_size == 32);
  CHECK(c.num_attention_heads == 2);
  CHECK(c.num_key_value_heads == 1);
  CHECK(c.head_dim == 16);
  CHECK(c.intermediate_size == 48);
  CHECK(c.vocab_size == 128256);
  CHECK(c.torch_dtype == "float32");
  // config.json follows the tokenizer beside it: Llama-3.1's bos, its eos <|eot_id|> added.
  CHECK(c.bos_token_id == 128000);
  CHECK(c.eos_token_ids == std::vector<int32_t>{128001, 128009});
  const auto report = check_model_dir_vocab(out);
  REQUIRE(report);
  CHECK(report->padding_rows == 0);
  CHECK(report->warnings.empty());

  const model_weights w = load_hf_model(out);
  CHECK(w.layers.size() == 3);
  CHECK(w.embedding[5] ==
        random_tensor_value(random_tensor_key(7, "model.embed_tokens.weight"), 5, 0.0, 0.02));

  deployment_config config;
  config.engine.kind = "cpu";
  config.engine.threads = 1;
  config.model.name = "tiny";
  config.model.path = out.string();
  config.model.max_context = 256;
  actor_config actor;
  actor.kv_blocks = 4;
  const auto e = make_engine(config, actor);
  CHECK(e->info().vocab_size == 128256);
  CHECK(e->info().eos_ids == std::vector<int32_t>{128001, 128009});
}

TEST_CASE(
    "duet model random --arch qwen2 takes the Qwen tokenizer; its padding rows pass with a "
    "warning") {
  temp_dir dir;
  const fs::path out = dir.path / "qwen";
  const auto r = run_duet({"model", "random", "--arch", "qwen2", "--size", "tiny", "--layers", "1",
                           "--tie-word-embeddings", "true", "--out", out.string()});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  CHECK(r.err.empty());
  const transformer_config c = load_hf_config(out);
  CHECK(c.architecture == "Qwen2ForCausalLM");
  CHECK(c.qkv_bias);
  CHECK(c.tie_word_embeddings);
  CHECK(c.num_hidden_layers == 1);
  CHECK(c.vocab_size == 151936);
  CHECK(c.eos_token_ids == std::vector<int32_t>{151643, 151645});  // <|im_end|> from the tokenizer
  const auto report = check_model_dir_vocab(out);
  REQUIRE(report);
  CHECK(report->tokenizer_ids == 151669);
  CHECK(report->padding_rows == 151936 - 151669);
  REQUIRE(report->warnings.size() == 1);
  CHECK(report->warnings[0].find("padding") != std::string::npos);
  CHECK(load_hf_model(out).layers.size() == 1);
}

TEST_CASE("duet model random refuses bad arguments with exit code 2 and says why") {
  temp_dir dir;
  const std::string out = (dir.path / "m").string();
  auto refused = [&](std::vector<std::string> args, const std::string& says) {
    const auto r = run_duet(std::move(args));
    CHECK_MESSAGE(r.code == 2, r.err);
    CHECK_MESSAGE(r.err.find(says) != std::string::npos, r.err);
    CHECK(!fs::exists(fs::path(out) / "model.safetensors"));
  };
  refused({"model", "random", "--arch", "llama"}, "--out");  // required
  refused({"model", "random", "--arch", "gpt2", "--out", out}, "unknown --arch 'gpt2'");
  refused({"model", "random", "--size", "huge", "--out", out}, "unknown --size 'huge'");
  refused({"model", "random", "--preset", "llama-70b", "--out", out}, "unknown preset 'llama-70b'");
  refused({"model", "random", "--preset", "tiny-qwen2", "--arch", "llama", "--out", out},
          "contradicts");
  refused({"model", "random", "--dtype", "f8", "--out", out}, "unknown --dtype 'f8'");
  refused({"model", "random", "--size", "tiny", "--heads", "3", "--out", out},
          "num_attention_heads");
  refused({"model", "random", "--size", "tiny", "--layers", "0", "--out", out}, "--layers");
  refused({"model", "random", "--size", "tiny", "--layers", "many", "--out", out}, "--layers");
  refused({"model", "random", "--size", "tiny", "--tokenizer", "/nonexistent/tok", "--out", out},
          "/nonexistent/tok");
  // A vocabulary the tokenizer does not fit: the repository's default, and one given.
  refused({"model", "random", "--preset", "smollm2-135m", "--layers", "1", "--out", out},
          "--no-tokenizer");
  refused({"model", "random", "--arch", "qwen2", "--size", "tiny", "--vocab", "32000",
           "--tokenizer", (tokenizers / "qwen3").string(), "--out", out},
          "32000 embedding rows");
  refused({"model"}, "A subcommand is required");
  refused({"no-such-command"}, "A subcommand is required");
  // Never into a directory of other files.
  std::ofstream(dir.path / "notes.txt") << "mine";
  refused({"model", "random", "--size", "tiny", "--layers", "1", "--out", dir.path.string()},
          "notes.txt");
  CHECK(fs::exists(dir.path / "notes.txt"));
}

TEST_CASE("duet model random --no-tokenizer writes weights and config only") {
  temp_dir dir;
  const auto r = run_duet({"model", "random", "--preset", "smollm2-135m", "--layers", "1",
                           "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--ffn", "32",
                           "--no-tokenizer", "--out", dir.path.string()});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  CHECK(!fs::exists(dir.path / "tokenizer.json"));
  const transformer_config c = load_hf_config(dir.path);
  CHECK(c.vocab_size == 49152);
  CHECK(c.tie_word_embeddings);
  CHECK(!check_model_dir_vocab(dir.path));  // nothing to check without a tokenizer
}

// ------------------------------------------------------------------ duet tokenize

TEST_CASE(
    "duet tokenize prints the golden ids of HF tokenizers, one argument or one JSON line at a "
    "time") {
  for (const std::string model : {"llama3_1", "qwen3"}) {
    CAPTURE(model);
    const auto cases = golden(model, 40);
    REQUIRE(cases.size() == 40);
    const std::string tok = (tokenizers / model / "tokenizer.json").string();
    for (std::size_t i = 0; i < 3; ++i) {
      const auto r = run_duet({"tokenize", "--tokenizer", tok, "--", cases[i].first});
      REQUIRE_MESSAGE(r.code == 0, r.err);
      CHECK(r.out == joined(cases[i].second) + "\n");
    }
    const auto j = run_duet({"tokenize", "--tokenizer", tok, "--json", "--", cases[0].first});
    CHECK(j.out == json(cases[0].second).dump() + "\n");
    const auto s =
        run_duet({"tokenize", "--tokenizer", (tokenizers / model).string(), "-"}, cases[1].first);
    CHECK(s.out == joined(cases[1].second) + "\n");

    std::string lines;
    for (const auto& [text, ids] : cases) lines += json(text).dump() + "\n";
    const auto l = run_duet({"tokenize", "--tokenizer", tok, "--jsonl"}, lines);
    REQUIRE_MESSAGE(l.code == 0, l.err);
    std::istringstream out(l.out);
    std::size_t n = 0;
    for (std::string line; std::getline(out, line); ++n) {
      REQUIRE(n < cases.size());
      CHECK_MESSAGE(json::parse(line).get<std::vector<int32_t>>() == cases[n].second,
                    cases[n].first);
    }
    CHECK(n == cases.size());
  }
}

TEST_CASE("duet tokenize --decode gives the text of ids; --add-special prepends bos") {
  const std::string tok = (tokenizers / "llama3_1").string();
  const tokenizer t{load_tokenizer_json(tok)};
  const auto cases = golden("llama3_1", 5);
  for (const auto& [text, ids] : cases) {
    const auto r = run_duet({"tokenize", "--tokenizer", tok, "--decode", "--json", joined(ids)});
    REQUIRE_MESSAGE(r.code == 0, r.err);
    CHECK(json::parse(r.out).get<std::string>() == t.decode(ids));
  }
  const auto comma = run_duet({"tokenize", "--tokenizer", tok, "--ids", "9906,1917"});
  CHECK(comma.out == "Hello world\n");
  const auto array = run_duet({"tokenize", "--tokenizer", tok, "--decode", "[128000, 9906]"});
  CHECK(array.out == "<|begin_of_text|>Hello\n");
  const auto skip =
      run_duet({"tokenize", "--tokenizer", tok, "--decode", "--skip-special", "128000 9906"});
  CHECK(skip.out == "Hello\n");
  const auto lines =
      run_duet({"tokenize", "--tokenizer", tok, "--decode", "--jsonl"}, "[9906]\n[1917, 0]\n");
  CHECK(lines.out == "\"Hello\"\n\" world!\"\n");
  CHECK(run_duet({"tokenize", "--tokenizer", tok, "Hello world"}).out == "9906 1917\n");
  CHECK(run_duet({"tokenize", "--tokenizer", tok, "--add-special", "Hello world"}).out ==
        "128000 9906 1917\n");
}

TEST_CASE(
    "duet tokenize --chat renders the model's chat template, then tokenizes without adding bos") {
  const fs::path dir = tokenizers / "qwen3";
  const tokenizer t{load_tokenizer_json(dir)};
  const jinja_chat_renderer chat(t.chat_template(), "", std::string(t.id_to_token(*t.eos_id())));
  const std::vector<chat_message> messages = {{"system", "Be brief."}, {"user", "What is 2+2?"}};
  const std::string prompt = chat.render(messages, true);
  CHECK(prompt.find("<|im_start|>user\nWhat is 2+2?<|im_end|>\n") != std::string::npos);
  CHECK(prompt.ends_with("<|im_start|>assistant\n"));

  const auto text = run_duet({"tokenize", "--tokenizer", dir.string(), "--chat", "--system",
                              "Be brief.", "--print-prompt", "What is 2+2?"});
  REQUIRE_MESSAGE(text.code == 0, text.err);
  CHECK(text.out == prompt + "\n");
  const auto ids = run_duet({"tokenize", "--tokenizer", dir.string(), "--chat", "--system",
                             "Be brief.", "--json", "What is 2+2?"});
  CHECK(json::parse(ids.out).get<std::vector<int32_t>>() == t.encode(prompt, false));
  // Messages as JSON lines.
  const json list = {{{"role", "system"}, {"content", "Be brief."}},
                     {{"role", "user"}, {"content", "What is 2+2?"}}};
  const auto lines =
      run_duet({"tokenize", "--tokenizer", dir.string(), "--chat", "--jsonl"}, list.dump() + "\n");
  CHECK(json::parse(lines.out).get<std::vector<int32_t>>() == t.encode(prompt, false));
}

TEST_CASE("duet tokenize refuses bad arguments and inputs with exit code 2") {
  const std::string tok = (tokenizers / "llama3_1").string();
  auto refused = [&](std::vector<std::string> args, const std::string& says,
                     const std::string& input = {}) {
    const auto r = run_duet(std::move(args), input);
    CHECK_MESSAGE(r.code == 2, r.err);
    CHECK_MESSAGE(r.err.find(says) != std::string::npos, r.err);
    CHECK(r.out.empty());
  };
  refused({"tokenize", "hello"}, "--tokenizer");
  refused({"tokenize", "--tokenizer", tok}, "give TEXT");
  refused({"tokenize", "--tokenizer", "/nonexistent/tokenizer.json", "hi"},
          "/nonexistent/tokenizer.json");
  refused({"tokenize", "--tokenizer", tok, "--decode", "1 two 3"}, "not a token id: 'two'");
  refused({"tokenize", "--tokenizer", tok, "--decode", "128256"},
          "outside the tokenizer's vocabulary");
  refused({"tokenize", "--tokenizer", tok, "--jsonl"}, "line 1 is not JSON", "hello\n");
  refused({"tokenize", "--tokenizer", tok, "--model", tok, "hi"}, "excludes");
  refused({"tokenize", "--tokenizer", tok, "--no-such-flag", "hi"}, "--no-such-flag");
}

// ------------------------------------------------------------------ model and tokenizer agree

TEST_CASE(
    "the vocab check refuses a tokenizer with ids past the model's embedding rows, naming both") {
  const std::string m = mismatch_message(vocab(32000, std::nullopt, {2}), spec_of("qwen3"));
  CHECK(m.find("vocab check: tokenizer.json does not fit config.json") != std::string::npos);
  CHECK(m.find("ids up to 151668") != std::string::npos);
  CHECK(m.find("only 32000 embedding rows") != std::string::npos);
  CHECK(m.find("26 added/special tokens") != std::string::npos);
  // One row short is enough: the last special token has no row.
  const std::string short_one =
      mismatch_message(vocab(128255, 128000, {128009}), spec_of("llama3_1"));
  CHECK(short_one.find("ids up to 128255 '<|reserved_special_token_250|>'") != std::string::npos);
}

TEST_CASE("the vocab check accepts the real pairs; Qwen2's padding rows only warn") {
  // Llama-3.1-8B-Instruct's config.json with its tokenizer.
  const auto llama =
      check_vocab(vocab(128256, 128000, {128001, 128008, 128009}), spec_of("llama3_1"), "t");
  CHECK(llama.tokenizer_ids == 128256);
  CHECK(llama.padding_rows == 0);
  CHECK(llama.warnings.empty());
  // Qwen3-8B's config.json (151936 rows) and R1-Distill-Qwen-7B's (152064) with the Qwen tokenizer.
  for (uint32_t rows : {151936u, 152064u}) {
    const auto qwen = check_vocab(vocab(rows, 151643, {151645}), spec_of("qwen3"), "t");
    CHECK(qwen.padding_rows == rows - 151669);
    REQUIRE(qwen.warnings.size() == 1);
    CHECK(qwen.warnings[0].find("padding") != std::string::npos);
  }
}

TEST_CASE(
    "the vocab check refuses eos and bos ids that disagree, and reads generation_config.json") {
  // R1-Distill-Llama-8B's config.json stops on 128001 only; this tokenizer ends turns with 128009.
  const std::string eos = mismatch_message(vocab(128256, 128000, {128001}), spec_of("llama3_1"));
  CHECK(eos.find("eos ids disagree") != std::string::npos);
  CHECK(eos.find("128009 '<|eot_id|>'") != std::string::npos);
  CHECK(
      mismatch_message(vocab(128256, 1, {128009}), spec_of("llama3_1")).find("bos ids disagree") !=
      std::string::npos);
  CHECK(mismatch_message(vocab(151936, std::nullopt, {151645, 151700}), spec_of("qwen3"))
            .find("eos id 151700 is not a token") != std::string::npos);

  // generation_config.json's eos counts (with a warning: the engines stop on config.json's),
  // and its bos replaces config.json's, as for R1-Distill-Qwen.
  temp_dir dir;
  random_checkpoint_params p;
  p.size = "tiny";
  p.eos_token_ids = {128001};
  std::ofstream(dir.path / "config.json") << hf_config_json(random_checkpoint_config(p));
  fs::copy_file(tokenizers / "llama3_1" / "tokenizer.json", dir.path / "tokenizer.json");
  fs::copy_file(tokenizers / "llama3_1" / "tokenizer_config.json",
                dir.path / "tokenizer_config.json");
  CHECK_THROWS_AS((void)check_model_dir_vocab(dir.path), vocab_mismatch_error);
  std::ofstream(dir.path / "generation_config.json")
      << R"({"bos_token_id": 128000, "eos_token_id": [128001, 128009]})";
  const model_vocab m = load_model_vocab(dir.path);
  CHECK(m.generation_eos_ids == std::vector<int32_t>{128001, 128009});
  const auto report = check_model_dir_vocab(dir.path);
  REQUIRE(report);
  REQUIRE(report->warnings.size() == 1);
  CHECK(report->warnings[0].find("only in generation_config.json") != std::string::npos);
  std::ofstream(dir.path / "generation_config.json")
      << R"({"bos_token_id": 7, "eos_token_id": 128009})";
  CHECK_THROWS_WITH_AS((void)check_model_dir_vocab(dir.path), doctest::Contains("bos ids disagree"),
                       vocab_mismatch_error);
  std::ofstream(dir.path / "generation_config.json") << "{not json";
  CHECK_THROWS_WITH_AS((void)check_model_dir_vocab(dir.path),
                       doctest::Contains("generation_config.json: not JSON"), std::runtime_error);
}

TEST_CASE(
    "duet refuses a mismatched model and tokenizer before loading weights: tokenize --model, "
    "node") {
  temp_dir dir;
  write_config_with_tokenizer(dir.path, 32000, {});
  const auto t = run_duet({"tokenize", "--model", dir.path.string(), "hi"});
  CHECK(t.code == 2);
  CHECK_MESSAGE(t.err.find("only 32000 embedding rows") != std::string::npos, t.err);

  // A cpu deployment on that directory (which has no weights: the check comes first).
  const fs::path config = dir.path / "cpu.toml";
  std::ofstream(config)
      << "[model]\nname = \"m\"\npath = \"" << dir.path.string()
      << "\"\n[engine]\nkind = \"cpu\"\nthreads = 1\n"
         "[[nodes]]\nname = \"n1\"\nendpoint = \"inproc://n1\"\n"
         "[[nodes.actors]]\nname = \"router\"\nrole = \"router\"\n"
         "[[nodes.actors]]\nname = \"broker\"\nrole = \"broker\"\n"
         "[[nodes.actors]]\nname = \"prefill0\"\nrole = \"prefill\"\nkv_blocks = 16\n"
         "[[nodes.actors]]\nname = \"decode0\"\nrole = \"decode\"\nkv_blocks = 16\n";
  const auto n =
      run_duet({"node", "--config", config.string(), "--name", "n1"}, {}, std::chrono::seconds(30));
  CHECK(n.code == 2);
  CHECK_MESSAGE(n.err.find("vocab check") != std::string::npos, n.err);
  // The HTTP front end checks the tokenizer it loads, too.
  CHECK_THROWS_AS((void)start_node_frontend(load_config(config.string()), "n1", "127.0.0.1:0", ""),
                  vocab_mismatch_error);

  // The same directory with a Qwen-sized vocabulary: tokenize --model warns about padding only.
  temp_dir ok;
  write_config_with_tokenizer(ok.path, 151936, {151643, 151645});
  const auto w = run_duet({"tokenize", "--model", ok.path.string(), "hi"});
  CHECK_MESSAGE(w.code == 0, w.err);
  const tokenizer qwen{spec_of("qwen3")};
  CHECK(w.out == joined(qwen.encode("hi", false)) + "\n");
  CHECK(w.err.find("padding") != std::string::npos);
}

// ------------------------------------------------------------------ duet bench engine

TEST_CASE("a command that does not serve ends at SIGTERM: bench serve waiting for a deployment that never answers") {
  testing::child_process bench({testing::duet_binary(), "bench", "serve", "--url", "http://127.0.0.1:1", "--wait",
                                "60", "--trace", "synthetic:poisson", "--out",
                                (std::filesystem::temp_directory_path() / "duet-sigterm-bench").string()});
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  REQUIRE(bench.running());  // still waiting (60 s allowed)
  const auto t0 = std::chrono::steady_clock::now();
  const int status = bench.stop();  // SIGTERM; SIGKILL only after 5 s
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGTERM);
  CHECK(took < 4.0);
}

namespace {

duet::msg::token_logprobs top_two(int32_t first, float lp_first, int32_t second, float lp_second) {
  duet::msg::token_logprobs lp;
  lp.logprob = lp_first;
  lp.top_ids = {first, second};
  lp.top_logprobs = {lp_first, lp_second};
  return lp;
}

}  // namespace

TEST_CASE("bench engine's agreement rule: identical sequences may part only on a near-tie swap") {
  using duet::decode_check;
  using duet::engine_bench_row;
  SUBCASE("the same tokens agree; the spread is the largest logprob difference") {
    decode_check c;
    c.tokens = {{5, 5, 5}, {7, 7, 7}};
    c.logprobs = {{top_two(5, -1.0f, 9, -2.0f), top_two(5, -1.25f, 9, -2.0f), top_two(5, -1.0f, 9, -2.0f)},
                  {top_two(7, -0.5f, 8, -3.0f), top_two(7, -0.5f, 8, -3.0f), top_two(7, -0.5f, 8, -3.0f)}};
    engine_bench_row row;
    duet::judge_decode_agreement(c, 0.05, row);
    CHECK(row.sequences_agree);
    CHECK(row.near_tie_divergences == 0);
    CHECK(row.first_divergence_step == -1);
    CHECK(row.logprob_spread == doctest::Approx(0.25));
  }
  SUBCASE("a swap of a near tie parts a sequence, which is not compared afterwards") {
    decode_check c;
    c.tokens = {{5, 5, 9}, {7, 7, 3}};
    c.logprobs = {{top_two(5, -1.0f, 9, -1.01f), top_two(5, -1.0f, 9, -1.01f), top_two(9, -1.0f, 5, -1.02f)},
                  {top_two(7, -0.5f, 8, -3.0f), top_two(7, -0.5f, 8, -3.0f), top_two(3, -0.1f, 8, -3.0f)}};
    engine_bench_row row;
    duet::judge_decode_agreement(c, 0.05, row);
    CHECK(row.sequences_agree);
    CHECK(row.near_tie_divergences == 1);
    CHECK(row.first_divergence_step == 0);
    CHECK(row.swap_margin == doctest::Approx(0.02));
    // Under a tighter margin the same swap is a fault.
    engine_bench_row strict;
    duet::judge_decode_agreement(c, 0.015, strict);
    CHECK_FALSE(strict.sequences_agree);
    CHECK(strict.disagreement.find("step 0: sequence 2") != std::string::npos);
  }
  SUBCASE("a different token beyond the margin, outside the top two, or without logprobs disagrees") {
    engine_bench_row wide, outside, blind;
    decode_check c;
    c.tokens = {{5, 5}, {7, 4}};
    c.logprobs = {{top_two(5, -1.0f, 9, -2.0f), top_two(5, -1.0f, 9, -2.0f)},
                  {top_two(7, -0.5f, 4, -0.9f), top_two(4, -0.5f, 7, -0.9f)}};
    duet::judge_decode_agreement(c, 0.05, wide);
    CHECK_FALSE(wide.sequences_agree);
    CHECK(wide.disagreement.find("step 1: sequence 1 chose token 4, sequence 0 token 7") != std::string::npos);
    c.logprobs[1] = {top_two(7, -0.5f, 4, -0.51f), top_two(4, -0.5f, 6, -0.51f)};
    duet::judge_decode_agreement(c, 0.05, outside);
    CHECK_FALSE(outside.sequences_agree);
    c.logprobs.clear();
    duet::judge_decode_agreement(c, 0.05, blind);
    CHECK_FALSE(blind.sequences_agree);
    CHECK(blind.disagreement.find("no log-probabilities") != std::string::npos);
    CHECK(blind.logprob_spread == -1);
  }
}

TEST_CASE("a prefill mix reads NxT[@P] parts joined by '+' and refuses what it cannot read") {
  const auto mix = duet::parse_prefill_mix("1x1024@3072+2x256");
  REQUIRE(mix.parts.size() == 2);
  CHECK(mix.label == "1x1024@3072+2x256");
  CHECK(mix.parts[0].sequences == 1);
  CHECK(mix.parts[0].tokens == 1024);
  CHECK(mix.parts[0].prior == 3072);
  CHECK(mix.parts[1].sequences == 2);
  CHECK(mix.parts[1].tokens == 256);
  CHECK(mix.parts[1].prior == 0);
  CHECK(mix.sequences() == 3);
  CHECK(mix.tokens() == 1536);
  // Causal pairs: 1024 rows over 3072 prior keys and a triangle of 1024, two triangles of 256.
  CHECK(mix.attention_pairs() == doctest::Approx(1024.0 * 3072 + 1024.0 * 1025 / 2 + 2 * (256.0 * 257 / 2)));
  for (const char* bad : {"", "x4", "2x", "2x3@", "0x4", "2x0", "2x3@4@5", "2x3+", "+2x3", "2y3", "2x-3", "2x3@x"}) {
    INFO(bad);
    CHECK_THROWS_AS((void)duet::parse_prefill_mix(bad), std::invalid_argument);
  }
}

TEST_CASE("duet bench engine times prefill mixes after their priors and checks each chunk's token") {
  temp_dir dir;
  const fs::path model = dir.path / "tiny";
  REQUIRE(run_duet({"model", "random", "--preset", "tiny-llama", "--out", model.string()}).code == 0);
  const fs::path json_file = dir.path / "mix.json";
  const auto r = run_duet({"bench", "engine", "--model", model.string(), "--prefill-mix", "2x16,1x24@40+2x8",
                           "--repeats", "2", "--json", json_file.string()});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  std::ifstream in(json_file);
  const auto j = nlohmann::json::parse(in);
  CHECK(j["sm_share"] == 1.0);
  const auto& rows = j["rows"];
  REQUIRE(rows.size() == 2);  // only the mixes: the default prompt and decode rows step aside
  CHECK(rows[0]["kind"] == "prefill_mix");
  CHECK(rows[0]["mix"] == "2x16");
  CHECK(rows[0]["batch"] == 2);
  CHECK(rows[0]["tokens"] == 32);
  CHECK(rows[0]["attention_pairs"] == doctest::Approx(2 * 16.0 * 17 / 2));
  CHECK(rows[1]["mix"] == "1x24@40+2x8");
  CHECK(rows[1]["batch"] == 3);
  CHECK(rows[1]["tokens"] == 40);
  CHECK(rows[1]["attention_pairs"] == doctest::Approx(24.0 * 40 + 24.0 * 25 / 2 + 2 * (8.0 * 9 / 2)));
  for (const auto& row : rows) {
    INFO(row["mix"].get<std::string>());
    CHECK(row["tokens_per_s"].get<double>() ==
          doctest::Approx(row["tokens"].get<double>() / row["ms_median"].get<double>() * 1e3).epsilon(1e-9));
    // Each chunk, after its prior in KV, samples what a prefill of its whole prompt samples: the
    // fp32 cpu engine computes a row alike in either call, to rounding.
    CHECK(row["sequences_agree"] == true);
    CHECK(row["near_tie_divergences"] == 0);
    CHECK(row["logprob_spread"].get<double>() >= 0.0);
    CHECK(row["logprob_spread"].get<double>() < 1e-4);
  }
  const auto bad = run_duet({"bench", "engine", "--model", model.string(), "--prefill-mix", "2x16@"});
  CHECK(bad.code == 2);
  CHECK(bad.err.find("cannot read '2x16@'") != std::string::npos);
  // A chunk past the model's positions is refused before anything runs.
  const fs::path short_model = dir.path / "short";
  REQUIRE(run_duet({"model", "random", "--preset", "tiny-llama", "--max-position", "64", "--out", short_model.string()})
              .code == 0);
  const auto long_mix = run_duet({"bench", "engine", "--model", short_model.string(), "--prefill-mix", "1x8@60"});
  CHECK(long_mix.code == 2);
  CHECK(long_mix.err.find("exceeds max_context 64") != std::string::npos);
  const auto share = run_duet({"bench", "engine", "--model", model.string(), "--prefill-mix", "2x16", "--sm-share", "0.5"});
  CHECK(share.code == 2);
  CHECK(share.err.find("--sm-share needs --engine cuda") != std::string::npos);
}

TEST_CASE("duet bench engine --engine sim prices each row with the simulator's cost model") {
  temp_dir dir;
  const fs::path cal_file = dir.path / "h200-test.toml";
  {
    std::ofstream f(cal_file);
    f << "gpu = \"h200\"\n"
         "gemm = [[256, 0.5], [1024, 0.6]]\n"
         "attention = [[1024, 0.3], [8192, 0.45]]\n"
         "split_compute = [[0.5, 0.8], [1, 1.0]]\n";
  }
  auto spec = *find_gpu_spec("h200");
  spec.calibration = load_gpu_calibration(cal_file);
  const auto shape = *find_model_shape("r1-distill-llama-8b");
  for (const double share : {1.0, 0.5}) {
    INFO("share " << share);
    const fs::path json_file = dir.path / ("priced-" + std::to_string(share) + ".json");
    const auto r = run_duet({"bench", "engine", "--engine", "sim", "--model", "r1-distill-llama-8b", "--calibration",
                             cal_file.string(), "--sm-share", std::to_string(share), "--prefill-mix",
                             "1x1024,1x1024@3072,4x256,1x512@512+2x256", "--batch", "1", "--context", "1000",
                             "--steps", "1", "--warmup", "0", "--json", json_file.string()});
    REQUIRE_MESSAGE(r.code == 0, r.err);
    std::ifstream in(json_file);
    const auto j = json::parse(in);
    CHECK(j["engine"] == "sim");
    CHECK(j["gpu"] == "h200");
    CHECK(j["sm_share"] == doctest::Approx(share));
    const auto& rows = j["rows"];
    REQUIRE(rows.size() == 5);
    // Each mix is one call: its tokens summed, each part's attention after its prior.
    const cost_model costs(shape, spec, share);
    const std::vector<std::vector<std::array<uint32_t, 3>>> mixes = {
        {{1, 1024, 0}}, {{1, 1024, 3072}}, {{4, 256, 0}}, {{1, 512, 512}, {2, 256, 0}}};
    for (std::size_t i = 0; i < mixes.size(); ++i) {
      uint64_t tokens = 0;
      double attention = 0;
      for (const auto& [n, t, p] : mixes[i]) {
        tokens += uint64_t{n} * t;
        attention += n * costs.chunk_attention_flops(t, p);
      }
      INFO(rows[i]["mix"].get<std::string>());
      CHECK(rows[i]["ms_median"].get<double>() == doctest::Approx(costs.prefill_seconds(tokens, attention) * 1e3));
      CHECK(rows[i]["sequences_agree"] == true);
    }
    // One decode step of one sequence: the prompt plus the token its prefill sampled.
    CHECK(rows[4]["kind"] == "decode");
    CHECK(rows[4]["ms_median"].get<double>() == doctest::Approx(costs.decode_seconds(1, 1001, 1) * 1e3));
  }
  // What it cannot price is refused with the reason.
  const auto unknown = run_duet({"bench", "engine", "--engine", "sim", "--model", "llama-9b", "--gpu", "h200",
                                 "--prefill-mix", "1x64"});
  CHECK(unknown.code == 2);
  CHECK(unknown.err.find("prices a model preset") != std::string::npos);
  const auto no_gpu = run_duet({"bench", "engine", "--engine", "sim", "--model", "tiny", "--prefill-mix", "1x64"});
  CHECK(no_gpu.code == 2);
  CHECK(no_gpu.err.find("needs --gpu") != std::string::npos);
  const auto other_gpu = run_duet({"bench", "engine", "--engine", "sim", "--model", "tiny", "--gpu", "h100",
                                   "--calibration", cal_file.string(), "--prefill-mix", "1x64"});
  CHECK(other_gpu.code == 2);
  CHECK(other_gpu.err.find("calibrates h200") != std::string::npos);
  const fs::path model = dir.path / "tiny";
  REQUIRE(run_duet({"model", "random", "--preset", "tiny-llama", "--out", model.string()}).code == 0);
  const auto timed = run_duet({"bench", "engine", "--model", model.string(), "--calibration", cal_file.string(),
                               "--prefill-mix", "1x16"});
  CHECK(timed.code == 2);
  CHECK(timed.err.find("price rows with --engine sim") != std::string::npos);
}

TEST_CASE("duet bench engine times prefill and decode rows on the cpu engine and refuses bad rows") {
  temp_dir dir;
  const fs::path model = dir.path / "tiny";
  REQUIRE(run_duet({"model", "random", "--preset", "tiny-llama", "--out", model.string()}).code == 0);
  const fs::path json_file = dir.path / "bench.json";
  const auto r = run_duet({"bench", "engine", "--model", model.string(), "--prefill", "48,96", "--batch", "1,3",
                           "--context", "40", "--steps", "4", "--warmup", "1", "--repeats", "2", "--json",
                           json_file.string()});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  CHECK(r.err.empty());  // no terminal: no progress lines
  CHECK(r.out.find("prefill") != std::string::npos);
  std::ifstream in(json_file);
  const auto j = nlohmann::json::parse(in);
  CHECK(j["engine"] == "cpu");
  const auto& rows = j["rows"];
  REQUIRE(rows.size() == 4);  // the two prompt lengths, then each batch at the context
  const std::vector<std::pair<std::string, uint32_t>> want = {{"prefill", 48}, {"prefill", 96}, {"decode", 40},
                                                              {"decode", 40}};
  const std::vector<uint32_t> batches = {1, 1, 1, 3};
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& row = rows[i];
    INFO("row " << i);
    CHECK(row["kind"] == want[i].first);
    CHECK(row["tokens"] == want[i].second);
    CHECK(row["batch"] == batches[i]);
    const double ms = row["ms_median"];
    CHECK(ms > 0);
    CHECK(row["ms_p10"].get<double>() <= ms);
    CHECK(ms <= row["ms_p90"].get<double>());
    // Throughput is the row's own work over its median call.
    const double work = want[i].first == "prefill" ? want[i].second : batches[i];
    CHECK(row["tokens_per_s"].get<double>() == doctest::Approx(work / ms * 1e3).epsilon(1e-9));
    // The batch's sequences share one context (copied blocks): greedy decoding agrees.
    if (want[i].first == "decode") {
      CHECK(row["sequences_agree"] == true);
      CHECK(row["near_tie_divergences"] == 0);
      // The cpu engine computes each row of a batch alike: identical sequences, identical numbers.
      if (batches[i] > 1) CHECK(row["logprob_spread"] == 0.0);
    }
  }
  // Bad rows and engines are refused with a reason, exit 2.
  const auto zero = run_duet({"bench", "engine", "--model", model.string(), "--prefill", "8", "--batch", "0"});
  CHECK(zero.code == 2);
  CHECK(zero.err.find("batch") != std::string::npos);
  const auto sim = run_duet({"bench", "engine", "--model", model.string(), "--engine", "sim"});
  CHECK(sim.code == 2);
  CHECK(sim.err.find("prices a model preset") != std::string::npos);  // a checkpoint is timed, not priced
  const auto missing = run_duet({"bench", "engine", "--model", (dir.path / "none").string()});
  CHECK(missing.code == 2);
  CHECK(missing.err.find("no model") != std::string::npos);
}
