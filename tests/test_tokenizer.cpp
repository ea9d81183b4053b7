// The byte-level BPE tokenizer against HF `tokenizers`: the shared golden files, golden cases
// generated at test time by tests/tools/tokenizer_golden.py, and behaviour of its own.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "runtime/gguf.hpp"
#include "runtime/tokenizer.hpp"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const duet::tokenizer& llama() {
  static const duet::tokenizer tok{
      duet::load_tokenizer_json(DUET_TEST_DATA "/tokenizers/llama3_1")};
  return tok;
}

const duet::tokenizer& qwen() {
  static const duet::tokenizer tok{duet::load_tokenizer_json(DUET_TEST_DATA "/tokenizers/qwen3")};
  return tok;
}

std::vector<json> read_jsonl(const fs::path& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in.good(), "cannot open " << path);
  std::vector<json> rows;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) rows.push_back(json::parse(line));
  }
  return rows;
}

std::string show(const std::vector<int32_t>& ids) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < ids.size(); ++i) out << (i ? ", " : "") << ids[i];
  out << ']';
  return out.str();
}

// Independent of the tokenizer's own UTF-8 code: a strict validator.
bool valid_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t n;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (std::size_t k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (b & 0x3F);
    }
    const uint32_t min = n == 2 ? 0x80 : n == 3 ? 0x800 : 0x10000;
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

// GPT-2's bytes_to_unicode, written out again so tests can name single-byte tokens.
std::string byte_char(unsigned b) {
  unsigned n = 0;
  unsigned cp = 0;
  for (unsigned x = 0; x < 256; ++x) {
    const bool printable = (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE;
    const unsigned mapped = printable ? x : 256 + n++;
    if (x == b) cp = mapped;
  }
  std::string out;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return out;
}

int32_t byte_token(const duet::tokenizer& tok, unsigned b) {
  const auto id = tok.token_to_id(byte_char(b));
  REQUIRE(id.has_value());
  return *id;
}

// Compares every golden record with the tokenizer; reports the first few differences.
void check_records(const duet::tokenizer& tok, const std::vector<json>& rows,
                   const std::string& label, bool encode_only = false) {
  std::size_t mismatches = 0;
  std::size_t checked = 0;
  for (const json& row : rows) {
    const auto expected = row.at("ids").get<std::vector<int32_t>>();
    const std::string kind = row.value("kind", std::string("encode"));
    if (kind == "encode") {
      const auto text = row.at("text").get<std::string>();
      const bool add_special = row.value("add_special", false);
      const auto got = tok.encode(text, add_special);
      ++checked;
      if (got != expected) {
        if (++mismatches <= 5) {
          MESSAGE(label << ": encode(" << json(text).dump() << ", " << add_special
                        << ")\n  expected " << show(expected) << "\n  got      " << show(got));
        }
        continue;
      }
      if (!encode_only && row.contains("decoded")) {
        const std::string decoded = tok.decode(expected);
        if (decoded != row.at("decoded").get<std::string>() && ++mismatches <= 5) {
          MESSAGE(label << ": decode" << show(expected) << " = " << json(decoded).dump()
                        << ", HF says " << row.at("decoded").dump());
        }
      }
    } else if (!encode_only) {
      const bool skip = row.at("skip_special").get<bool>();
      const std::string decoded = tok.decode(expected, skip);
      ++checked;
      if (decoded != row.at("decoded").get<std::string>() && ++mismatches <= 5) {
        MESSAGE(label << ": decode(" << show(expected) << ", skip_special=" << skip << ") = "
                      << json(decoded).dump() << ", HF says " << row.at("decoded").dump());
      }
    }
  }
  INFO(label << ": " << checked << " records");
  CHECK(checked > 0);
  CHECK(mismatches == 0);
}

// The embedded default model (scripts/fetch-model.sh puts it there), when present.
fs::path smollm2_gguf() {
  const char* env = std::getenv("DUET_MODELS_DIR");
  const fs::path dir =
      env != nullptr && *env != '\0' ? fs::path(env) : fs::path(DUET_SOURCE_DIR "/models");
  const fs::path file = dir / "smollm2-135m-instruct-q4_1.gguf";
  return fs::is_regular_file(file) ? file : fs::path{};
}

// Runs tests/tools/tokenizer_golden.py once (with $DUET_PYTHON, else the project's .venv) and
// returns the directory it wrote, or an empty path when it could not run.
const fs::path& hf_golden_dir() {
  static const fs::path dir = [] {
    const char* env = std::getenv("DUET_PYTHON");
    const std::string python =
        env != nullptr && *env != '\0' ? env : DUET_SOURCE_DIR "/.venv/bin/python";
    const fs::path out = fs::path(DUET_BINARY_DIR) / "tokenizer-golden";
    fs::remove_all(out);
    fs::create_directories(out);
    std::string command = "\"" + python +
                          "\" \"" DUET_SOURCE_DIR
                          "/tests/tools/tokenizer_golden.py\" --data \"" DUET_TEST_DATA
                          "\" --out \"" +
                          out.string() + "\"";
    if (const fs::path gguf = smollm2_gguf(); !gguf.empty()) {
      command += " --gguf \"" + gguf.string() + "\"";
    }
    return std::system(command.c_str()) == 0 ? out : fs::path{};
  }();
  return dir;
}

void require_hf_golden() {
  REQUIRE_MESSAGE(!hf_golden_dir().empty(),
                  "tests/tools/tokenizer_golden.py did not run. It needs HF tokenizers: "
                  "python3 -m venv .venv && .venv/bin/pip install -r tests/requirements.txt, "
                  "or set DUET_PYTHON to an interpreter that has it");
}

std::vector<std::string> golden_texts() {
  std::vector<std::string> texts;
  for (const char* name : {"llama3_1", "qwen3"}) {
    for (const json& row : read_jsonl(fs::path(DUET_TEST_DATA) / "tokenizer-golden" /
                                      (std::string(name) + ".jsonl"))) {
      texts.push_back(row.at("text").get<std::string>());
    }
  }
  return texts;
}

// A directory of its own for each malformed-file case.
fs::path scratch_dir(const std::string& name) {
  const fs::path dir = fs::path(DUET_BINARY_DIR) / "tokenizer-malformed" / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// A small valid byte-level tokenizer.json: the 256 byte tokens, then `extra` tokens, `merges`.
json tiny_tokenizer(const std::vector<std::string>& extra,
                    const std::vector<std::pair<std::string, std::string>>& merges) {
  json vocab = json::object();
  for (unsigned b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  int id = 256;
  for (const auto& t : extra) vocab[t] = id++;
  json merge_list = json::array();
  for (const auto& [a, b] : merges) merge_list.push_back(a + " " + b);
  return {
      {"version", "1.0"},
      {"added_tokens", json::array({{{"id", id},
                                     {"content", "<|end|>"},
                                     {"single_word", false},
                                     {"lstrip", false},
                                     {"rstrip", false},
                                     {"normalized", false},
                                     {"special", true}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "ByteLevel"},
        {"add_prefix_space", false},
        {"trim_offsets", true},
        {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", merge_list}}},
  };
}

// Loading `dir` fails with a message that names `file` and contains `fragment`.
void check_load_error(const fs::path& dir, const fs::path& file, const std::string& fragment) {
  try {
    (void)duet::load_tokenizer_json(dir);
    FAIL("loading " << dir << " did not throw (expected: " << fragment << ")");
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    INFO("message: " << what);
    CHECK(what.find(file.string()) != std::string::npos);
    CHECK(what.find(fragment) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("every shared golden case of Llama 3.1 encodes to HF's ids") {
  check_records(llama(), read_jsonl(DUET_TEST_DATA "/tokenizer-golden/llama3_1.jsonl"),
                "llama3_1 shared golden");
}

TEST_CASE("every shared golden case of Qwen3 encodes to HF's ids") {
  check_records(qwen(), read_jsonl(DUET_TEST_DATA "/tokenizer-golden/qwen3.jsonl"),
                "qwen3 shared golden");
}

TEST_CASE("encoding and decoding agree with the HF tokenizers library on a generated corpus") {
  require_hf_golden();
  for (const char* variant :
       {"llama3_1", "qwen3", "qwen3_smollm", "qwen3_gpt2", "qwen3_added", "llama3_1_added"}) {
    SUBCASE(variant) {
      const fs::path dir = hf_golden_dir() / variant;
      const duet::tokenizer tok{duet::load_tokenizer_json(dir / "tokenizer.json")};
      check_records(tok, read_jsonl(dir / "golden.jsonl"), variant);
    }
  }
}

TEST_CASE("a GGUF-style spec that names only the pre-tokenizer family encodes like HF") {
  require_hf_golden();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"llama3_1", "llama3"},        {"llama3_1", "llama-bpe"},  {"qwen3", "qwen2"},
      {"qwen3", "deepseek-r1-qwen"}, {"qwen3_smollm", "smollm"}, {"qwen3_gpt2", "gpt2"}};
  for (const auto& [variant, family] : cases) {
    SUBCASE((variant + " as " + family).c_str()) {
      const fs::path dir = hf_golden_dir() / variant;
      duet::tokenizer_spec spec = duet::load_tokenizer_json(dir / "tokenizer.json");
      spec.pre_tokenizer_regexes.clear();
      spec.ignore_merges = false;         // a GGUF file does not say; the llama3 family implies it
      spec.normalizer.clear();            // nor this; the qwen2 family implies NFC
      for (const auto& a : spec.added) {  // a GGUF vocab lists the added tokens' contents too
        if (static_cast<std::size_t>(a.id) >= spec.vocab.size()) spec.vocab.resize(a.id + 1);
        if (spec.vocab[a.id].empty()) spec.vocab[a.id] = a.content;
      }
      spec.pre_tokenizer = family;
      const duet::tokenizer tok{std::move(spec)};
      CHECK(tok.spec().ignore_merges == duet::pre_tokenizer_family_ignores_merges(family));
      check_records(tok, read_jsonl(dir / "golden.jsonl"), variant + " as " + family, true);
    }
  }
}

TEST_CASE("the SmolLM2 GGUF's tokenizer encodes like HF on the same vocabulary") {
  const fs::path gguf = smollm2_gguf();
  if (gguf.empty()) {
    MESSAGE("models/smollm2-135m-instruct-q4_1.gguf is absent (scripts/fetch-model.sh): skipped");
    return;
  }
  require_hf_golden();
  const duet::gguf_file file(gguf);
  const duet::tokenizer_spec spec = duet::gguf_read_tokenizer(file);
  CHECK(spec.pre_tokenizer == "smollm");
  CHECK(spec.pre_tokenizer_regexes.empty());
  const duet::tokenizer tok{spec};
  CHECK(tok.vocab_size() == 49152);
  CHECK(tok.encode("<|im_start|>user\nHi<|im_end|>", false).front() == 1);
  CHECK(tok.eos_id() == 2);
  check_records(tok, read_jsonl(hf_golden_dir() / "gguf" / "golden.jsonl"), "smollm2 gguf");
}

TEST_CASE("the loader recognizes the pre-tokenizer family of known regexes") {
  CHECK(llama().spec().pre_tokenizer == "llama3");
  CHECK(llama().spec().ignore_merges);
  CHECK(qwen().spec().pre_tokenizer == "qwen2");
  CHECK(qwen().spec().normalizer == "nfc");
  CHECK(duet::pre_tokenizer_family_regexes("smollm").size() == 2);
  CHECK(duet::pre_tokenizer_family_ignores_merges("llama-bpe"));
  CHECK(duet::pre_tokenizer_family_normalizer("deepseek-r1-qwen") == "nfc");
  CHECK(duet::pre_tokenizer_family_normalizer("llama3").empty());
  CHECK(duet::pre_tokenizer_family_regexes("default") ==
        duet::pre_tokenizer_family_regexes("gpt2"));
  CHECK_FALSE(duet::pre_tokenizer_family_ignores_merges("qwen2"));
  CHECK_THROWS_AS((void)duet::pre_tokenizer_family_regexes("no-such-family"),
                  std::invalid_argument);
}

TEST_CASE("decode inverts encode on every golden text") {
  for (const std::string& text : golden_texts()) {
    CHECK(llama().decode(llama().encode(text, false)) == text);
    CHECK(qwen().decode(qwen().encode(text, false)) == qwen().normalize(text));
  }
  const std::string composed = "caf\xC3\xA9";     // é
  const std::string decomposed = "cafe\xCC\x81";  // e + U+0301
  CHECK(qwen().normalize(decomposed) == composed);
  CHECK(qwen().encode(decomposed, false) == qwen().encode(composed, false));
  CHECK(llama().decode(llama().encode(decomposed, false)) == decomposed);  // no normalizer
}

TEST_CASE("bytes that are not UTF-8 are encoded as byte tokens and decode to U+FFFD") {
  const std::string text = "ok \xFF\xFE bad \xE4\xB8 cut";
  const auto ids = llama().encode(text, false);
  CHECK(std::find(ids.begin(), ids.end(), byte_token(llama(), 0xFF)) != ids.end());
  CHECK(llama().decode(ids) == "ok \xEF\xBF\xBD\xEF\xBF\xBD bad \xEF\xBF\xBD cut");
  std::string bytes;
  for (const int32_t id : ids) bytes += llama().token_bytes(id);
  CHECK(bytes == text);
  CHECK(qwen().decode(qwen().encode(text, false)) == llama().decode(ids));
}

TEST_CASE("special tokens in the text become their ids and decode can skip them") {
  const auto& tok = llama();
  const auto ids = tok.encode("<|begin_of_text|>Hello<|eot_id|>", false);
  REQUIRE(ids.size() >= 3);
  CHECK(ids.front() == 128000);
  CHECK(ids.back() == 128009);
  CHECK(tok.is_special(128000));
  CHECK_FALSE(tok.is_special(ids[1]));
  CHECK(tok.decode(ids) == "<|begin_of_text|>Hello<|eot_id|>");
  CHECK(tok.decode(ids, true) == "Hello");
  CHECK(tok.token_to_id("<|eot_id|>") == 128009);
  CHECK(tok.id_to_token(128000) == "<|begin_of_text|>");
  CHECK(qwen().encode("<|im_start|>user", false).front() == 151644);
  CHECK(qwen().encode("<think>", false) == std::vector<int32_t>{151667});
}

TEST_CASE("add_special prepends bos only where the tokenizer asks for it") {
  CHECK(llama().add_bos());
  CHECK(llama().bos_id() == 128000);
  CHECK(llama().eos_id() == 128009);  // <|eot_id|>, from tokenizer_config.json
  const auto plain = llama().encode("Hi there", false);
  auto with_bos = plain;
  with_bos.insert(with_bos.begin(), 128000);
  CHECK(llama().encode("Hi there", true) == with_bos);

  CHECK_FALSE(qwen().add_bos());
  CHECK_FALSE(qwen().bos_id().has_value());
  CHECK(qwen().eos_id() == 151645);  // <|im_end|>
  CHECK(qwen().encode("Hi there", true) == qwen().encode("Hi there", false));
}

TEST_CASE("vocab sizes, token forms and chat templates come from the files") {
  CHECK(llama().vocab_size() == 128256);
  CHECK(qwen().vocab_size() == 151669);
  const auto hello = llama().token_to_id("\xC4\xA0hello");  // "Ġhello"
  REQUIRE(hello.has_value());
  CHECK(llama().token_bytes(*hello) == " hello");
  CHECK(llama().id_to_token(*hello) == "\xC4\xA0hello");
  CHECK(llama().token_bytes(-1).empty());
  CHECK(llama().token_bytes(1 << 30).empty());
  CHECK_FALSE(llama().chat_template().empty());
  CHECK(qwen().chat_template().find("<|im_start|>") != std::string::npos);
}

TEST_CASE("long inputs without a word break encode in bounded time and round-trip") {
  // One 256 KiB word goes through the heap-based merge; whitespace runs through the regex.
  for (const std::string& text : {std::string(256 * 1024, 'a'), std::string(256 * 1024, ' '),
                                  std::string(256 * 1024, '!') + "\n"}) {
    const auto ids = llama().encode(text, false);
    CHECK(ids.size() < text.size() / 4);
    CHECK(llama().decode(ids) == text);
  }
}

TEST_CASE("decode skips ids outside the vocabulary") {
  const std::vector<int32_t> ids = {-5, 9906, 1 << 30, 128256};
  CHECK(llama().decode(ids) == llama().decode(std::vector<int32_t>{9906}));
}

TEST_CASE("the stream decoder holds back a character split across byte tokens") {
  const auto& tok = llama();
  duet::stream_decoder stream(tok);
  // U+1F600 (😀) is F0 9F 98 80: four single-byte tokens.
  CHECK(stream.push(byte_token(tok, 0xF0)).empty());
  CHECK(stream.pending_bytes() == 1);
  CHECK(stream.push(byte_token(tok, 0x9F)).empty());
  CHECK(stream.push(byte_token(tok, 0x98)).empty());
  CHECK(stream.pending_bytes() == 3);
  CHECK(stream.push(byte_token(tok, 0x80)) == "\xF0\x9F\x98\x80");
  CHECK(stream.pending_bytes() == 0);
  // € (E2 82 AC) then "a": nothing until the third byte.
  CHECK(stream.push(byte_token(tok, 0xE2)).empty());
  CHECK(stream.push(byte_token(tok, 0x82)).empty());
  CHECK(stream.push(std::vector<int32_t>{byte_token(tok, 0xAC), byte_token(tok, 'a')}) ==
        "\xE2\x82\xAC"
        "a");
}

TEST_CASE("the stream decoder replaces bytes that can never form a character") {
  const auto& tok = llama();
  duet::stream_decoder stream(tok);
  CHECK(stream.push(byte_token(tok, 0xFF)) == "\xEF\xBF\xBD");  // never valid
  CHECK(stream.push(byte_token(tok, 0xE2)).empty());            // may still complete
  CHECK(stream.push(byte_token(tok, 'a')) ==
        "\xEF\xBF\xBD"
        "a");  // it did not
  CHECK(stream.push(byte_token(tok, 0xE2)).empty());
  CHECK(stream.push(byte_token(tok, 0x82)).empty());
  CHECK(stream.flush() == "\xEF\xBF\xBD");  // one U+FFFD for the incomplete E2 82
  CHECK(stream.pending_bytes() == 0);
  CHECK(stream.push(byte_token(tok, 0xE2)).empty());
  stream.reset();
  CHECK(stream.flush().empty());
}

TEST_CASE("streaming any id sequence emits valid UTF-8 that adds up to decode") {
  std::mt19937 rng(1234);
  for (const duet::tokenizer* tok : {&llama(), &qwen()}) {
    const auto n = static_cast<int32_t>(tok->vocab_size());
    std::uniform_int_distribution<int32_t> any_id(0, n - 1);
    std::uniform_int_distribution<unsigned> any_byte(0x80, 0xFF);
    for (int round = 0; round < 200; ++round) {
      std::vector<int32_t> ids;
      for (int k = 0; k < 24; ++k) {
        ids.push_back(k % 3 == 0 ? any_id(rng) : byte_token(*tok, any_byte(rng)));
      }
      for (const bool skip : {false, true}) {
        duet::stream_decoder stream(*tok, skip);
        std::string all;
        for (const int32_t id : ids) {
          const std::string chunk = stream.push(id);
          CHECK(valid_utf8(chunk));
          all += chunk;
        }
        const std::string tail = stream.flush();
        CHECK(valid_utf8(tail));
        all += tail;
        CHECK(all == tok->decode(ids, skip));
      }
    }
  }
}

TEST_CASE("streaming the golden texts token by token gives back the text") {
  for (const std::string& text : golden_texts()) {
    const auto ids = llama().encode(text, false);
    duet::stream_decoder stream(llama());
    std::string all;
    for (const int32_t id : ids) {
      const std::string chunk = stream.push(id);
      REQUIRE(valid_utf8(chunk));
      all += chunk;
    }
    CHECK(stream.pending_bytes() == 0);
    all += stream.flush();
    CHECK(all == text);
  }
}

TEST_CASE("several threads can encode with one tokenizer at once") {
  const auto texts = golden_texts();
  std::vector<std::vector<int32_t>> expected;
  for (const auto& t : texts) expected.push_back(qwen().encode(t, false));
  std::vector<int> failures(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round) {
        for (std::size_t i = t; i < texts.size(); i += 1) {
          if (qwen().encode(texts[i], false) != expected[i]) ++failures[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const int f : failures) CHECK(f == 0);
}

TEST_CASE("merges apply by rank, not by position") {
  // "abc": (b, c) has rank 0, so it merges before (a, b); then (a, bc) makes "abc".
  const fs::path dir = scratch_dir("rank-order");
  write_file(
      dir / "tokenizer.json",
      tiny_tokenizer({"bc", "ab", "abc", "xyz"}, {{"b", "c"}, {"a", "b"}, {"a", "bc"}}).dump());
  duet::tokenizer_spec spec = duet::load_tokenizer_json(dir);
  CHECK(spec.pre_tokenizer == "gpt2");
  const duet::tokenizer tok{spec};
  CHECK(tok.encode("abc", false) == std::vector<int32_t>{258});
  CHECK(tok.encode("ab", false) == std::vector<int32_t>{257});
  CHECK(tok.encode("abab abc", false) == std::vector<int32_t>{257, 257, ' ', 258});
  // "xyz" is in the vocab but no merge reaches it, unless ignore_merges is set.
  CHECK(tok.encode("xyz", false) == std::vector<int32_t>{'x', 'y', 'z'});
  spec.ignore_merges = true;
  const duet::tokenizer whole{spec};
  CHECK(whole.encode("xyz", false) == std::vector<int32_t>{259});
  CHECK(whole.encode("abc<|end|>", false) == std::vector<int32_t>{258, 260});
}

TEST_CASE("malformed tokenizer files fail with the file name and the problem") {
  SUBCASE("missing file") {
    const fs::path dir = scratch_dir("missing");
    check_load_error(dir, dir / "tokenizer.json", "no such file");
  }
  SUBCASE("not JSON") {
    const fs::path dir = scratch_dir("not-json");
    write_file(dir / "tokenizer.json", "{ \"model\": [1, 2");
    check_load_error(dir, dir / "tokenizer.json", "not valid JSON");
  }
  SUBCASE("no model") {
    const fs::path dir = scratch_dir("no-model");
    write_file(dir / "tokenizer.json", "{\"version\": \"1.0\"}");
    check_load_error(dir, dir / "tokenizer.json", "no \"model\"");
  }
  SUBCASE("not BPE") {
    const fs::path dir = scratch_dir("wordpiece");
    json j = tiny_tokenizer({}, {});
    j["model"]["type"] = "WordPiece";
    write_file(dir / "tokenizer.json", j.dump());
    check_load_error(dir, dir / "tokenizer.json", "'WordPiece' is not BPE");
  }
  SUBCASE("a merge string without a space") {
    const fs::path dir = scratch_dir("merge-string");
    json j = tiny_tokenizer({}, {});
    j["model"]["merges"] = json::array({"ab"});
    write_file(dir / "tokenizer.json", j.dump());
    check_load_error(dir, dir / "tokenizer.json", "merge #0 'ab' is not two tokens");
  }
  SUBCASE("a merge that is neither a string nor a pair") {
    const fs::path dir = scratch_dir("merge-pair");
    json j = tiny_tokenizer({}, {});
    j["model"]["merges"] = json::array({json::array({1, 2})});
    write_file(dir / "tokenizer.json", j.dump());
    check_load_error(dir, dir / "tokenizer.json", "merge #0 is neither");
  }
  SUBCASE("a negative vocab id") {
    const fs::path dir = scratch_dir("negative-id");
    json j = tiny_tokenizer({}, {});
    j["model"]["vocab"]["oops"] = -3;
    write_file(dir / "tokenizer.json", j.dump());
    check_load_error(dir, dir / "tokenizer.json", "'oops' has id -3 out of range");
  }
  SUBCASE("an unsupported pre-tokenizer") {
    const fs::path dir = scratch_dir("whitespace");
    json j = tiny_tokenizer({}, {});
    j["pre_tokenizer"] = {{"type", "Whitespace"}};
    write_file(dir / "tokenizer.json", j.dump());
    check_load_error(dir, dir / "tokenizer.json", "unsupported pre_tokenizer type 'Whitespace'");
  }
  SUBCASE("no byte-level pre-tokenizer") {
    const fs::path dir = scratch_dir("no-byte-level");
    json j = tiny_tokenizer({}, {});
    j["pre_tokenizer"] = nullptr;
    write_file(dir / "tokenizer.json", j.dump());
    check_load_error(dir, dir / "tokenizer.json", "not a byte-level BPE tokenizer");
  }
  SUBCASE("an unsupported normalizer") {
    const fs::path dir = scratch_dir("lowercase");
    json j = tiny_tokenizer({}, {});
    j["normalizer"] = {{"type", "Lowercase"}};
    write_file(dir / "tokenizer.json", j.dump());
    check_load_error(dir, dir / "tokenizer.json", "unsupported normalizer");
  }
  SUBCASE("a vocab that is an array") {
    const fs::path dir = scratch_dir("vocab-array");
    json j = tiny_tokenizer({}, {});
    j["model"]["vocab"] = json::array({"a", "b"});
    write_file(dir / "tokenizer.json", j.dump());
    check_load_error(dir, dir / "tokenizer.json", "model.vocab is not an object");
  }
  SUBCASE("a bos_token missing from the vocab") {
    const fs::path dir = scratch_dir("bad-bos");
    write_file(dir / "tokenizer.json", tiny_tokenizer({}, {}).dump());
    write_file(dir / "tokenizer_config.json", R"({"bos_token": "<s>", "add_bos_token": true})");
    check_load_error(dir, dir / "tokenizer_config.json", "bos_token '<s>' is not in the vocab");
  }
  SUBCASE("a tokenizer_config.json that is not JSON") {
    const fs::path dir = scratch_dir("bad-config");
    write_file(dir / "tokenizer.json", tiny_tokenizer({}, {}).dump());
    write_file(dir / "tokenizer_config.json", "bos_token: <s>");
    check_load_error(dir, dir / "tokenizer_config.json", "not valid JSON");
  }
}

TEST_CASE("a tokenizer_config.json supplies bos, eos, add_bos and the chat template") {
  const fs::path dir = scratch_dir("config");
  write_file(dir / "tokenizer.json", tiny_tokenizer({}, {}).dump());
  write_file(dir / "tokenizer_config.json",
             R"({"bos_token": {"content": "<|end|>", "special": true}, "eos_token": "<|end|>",
                 "add_bos_token": true,
                 "chat_template": [{"name": "tool_use", "template": "T"},
                                   {"name": "default", "template": "D"}]})");
  const duet::tokenizer tok{duet::load_tokenizer_json(dir / "tokenizer.json")};
  CHECK(tok.bos_id() == 256);
  CHECK(tok.eos_id() == 256);
  CHECK(tok.add_bos());
  CHECK(tok.chat_template() == "D");
  CHECK(tok.encode("a", true) == std::vector<int32_t>{256, 'a'});
}

TEST_CASE("an inconsistent spec is refused when the tokenizer is built") {
  const fs::path dir = scratch_dir("spec");
  write_file(dir / "tokenizer.json", tiny_tokenizer({"ab"}, {{"a", "b"}}).dump());
  duet::tokenizer_spec spec = duet::load_tokenizer_json(dir);
  CHECK_NOTHROW(duet::tokenizer{spec});
  SUBCASE("a merge of an unknown token") {
    spec.merges.emplace_back("a", "nope");
    CHECK_THROWS_WITH_AS(duet::tokenizer{spec}, doctest::Contains("'nope' is not in the vocab"),
                         std::invalid_argument);
  }
  SUBCASE("a regex PCRE2 cannot compile") {
    spec.pre_tokenizer_regexes = {"(unclosed"};
    CHECK_THROWS_WITH_AS(duet::tokenizer{spec}, doctest::Contains("bad split regex"),
                         std::invalid_argument);
  }
  SUBCASE("an unknown family") {
    spec.pre_tokenizer_regexes.clear();
    spec.pre_tokenizer = "klingon";
    CHECK_THROWS_WITH_AS(duet::tokenizer{spec}, doctest::Contains("unknown pre-tokenizer family"),
                         std::invalid_argument);
  }
  SUBCASE("add_bos without a bos token") {
    spec.add_bos = true;
    spec.bos_id.reset();
    CHECK_THROWS_WITH_AS(duet::tokenizer{spec}, doctest::Contains("no bos token"),
                         std::invalid_argument);
  }
}
