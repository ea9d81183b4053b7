#include "runtime/vocab_check.hpp"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "runtime/hf_model.hpp"
#include "runtime/tokenizer.hpp"

namespace duet {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string id_list(const std::vector<int32_t>& ids) {
  std::string out = "[";
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(ids[i]);
  }
  return out + "]";
}

bool contains(const std::vector<int32_t>& ids, int32_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

/// The text of `id` in `spec`: an added token's content, else the vocab entry.
std::string token_text(const tokenizer_spec& spec, int32_t id) {
  for (const auto& a : spec.added) {
    if (a.id == id) return a.content;
  }
  if (id >= 0 && static_cast<std::size_t>(id) < spec.vocab.size()) return spec.vocab[id];
  return {};
}

std::string describe(const tokenizer_spec& spec, int32_t id) {
  const std::string text = token_text(spec, id);
  return text.empty() ? std::to_string(id) : std::to_string(id) + " '" + text + "'";
}

/// An int or a list of ints; `key` absent or null gives an empty list.
std::vector<int32_t> read_ids(const json& root, const char* key, const std::string& file) {
  std::vector<int32_t> ids;
  const auto it = root.find(key);
  if (it == root.end() || it->is_null()) return ids;
  auto one = [&](const json& v) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) {
      throw std::runtime_error("vocab check: " + file + ": key '" + key +
                               "': expected token ids, got " + it->dump());
    }
    ids.push_back(v.get<int32_t>());
  };
  if (it->is_array()) {
    for (const auto& v : *it) one(v);
  } else {
    one(*it);
  }
  return ids;
}

}  // namespace

uint32_t tokenizer_id_count(const tokenizer_spec& spec) {
  std::size_t n = spec.vocab.size();
  for (const auto& a : spec.added) n = std::max(n, static_cast<std::size_t>(a.id) + 1);
  return static_cast<uint32_t>(n);
}

model_vocab model_vocab_of(const transformer_config& config, std::string source) {
  model_vocab m;
  m.source = std::move(source);
  m.vocab_size = config.vocab_size;
  m.bos_id = config.bos_token_id;
  m.eos_ids = config.eos_token_ids;
  return m;
}

model_vocab load_model_vocab(const fs::path& dir) {
  model_vocab m = model_vocab_of(load_hf_config(dir), (dir / "config.json").string());
  const fs::path gen = dir / "generation_config.json";
  std::error_code ec;
  if (!fs::exists(gen, ec)) return m;
  std::ifstream in(gen);
  std::stringstream text;
  text << in.rdbuf();
  json root;
  try {
    root = json::parse(text.str());
  } catch (const json::exception& e) {
    throw std::runtime_error("vocab check: " + gen.string() + ": not JSON (" + e.what() + ")");
  }
  if (!root.is_object())
    throw std::runtime_error("vocab check: " + gen.string() + ": not a JSON object");
  if (const auto bos = read_ids(root, "bos_token_id", gen.string()); !bos.empty())
    m.bos_id = bos.front();
  m.generation_eos_ids = read_ids(root, "eos_token_id", gen.string());
  return m;
}

vocab_check_report check_vocab(const model_vocab& model, const tokenizer_spec& tok,
                               std::string_view tokenizer_source) {
  const std::string where =
      "vocab check: " + std::string(tokenizer_source) + " does not fit " + model.source + ": ";
  auto fail = [&](const std::string& what) { throw vocab_mismatch_error(where + what); };

  vocab_check_report report;
  report.tokenizer_ids = tokenizer_id_count(tok);
  if (report.tokenizer_ids > model.vocab_size) {
    // Name the first id past the embedding, and the largest (often a special token).
    int32_t first = static_cast<int32_t>(model.vocab_size);
    uint32_t added_past = 0;
    for (const auto& a : tok.added) added_past += static_cast<uint32_t>(a.id) >= model.vocab_size;
    fail("the tokenizer has ids up to " +
         describe(tok, static_cast<int32_t>(report.tokenizer_ids - 1)) + " (" +
         std::to_string(report.tokenizer_ids) + " ids, " + std::to_string(added_past) +
         " added/special tokens among those past the model), but the model has only " +
         std::to_string(model.vocab_size) + " embedding rows (vocab_size): ids from " +
         describe(tok, first) + " on have no row. Use the model's own tokenizer.");
  }
  report.padding_rows = model.vocab_size - report.tokenizer_ids;

  std::vector<int32_t> model_eos = model.eos_ids;
  for (int32_t id : model.generation_eos_ids) {
    if (!contains(model_eos, id)) model_eos.push_back(id);
  }
  for (int32_t id : model_eos) {
    if (static_cast<uint32_t>(id) >= report.tokenizer_ids) {
      fail("the model's eos id " + std::to_string(id) +
           " is not a token of the tokenizer (ids 0.." + std::to_string(report.tokenizer_ids - 1) +
           ")");
    }
  }
  if (tok.eos_id && !model_eos.empty() && !contains(model_eos, *tok.eos_id)) {
    std::string model_side = "config.json eos_token_id " + id_list(model.eos_ids);
    if (!model.generation_eos_ids.empty()) {
      model_side += ", generation_config.json eos_token_id " + id_list(model.generation_eos_ids);
    }
    fail("eos ids disagree: the tokenizer's eos_token is " + describe(tok, *tok.eos_id) +
         ", the model's " + model_side + " (" + describe(tok, model_eos.front()) +
         "): generation would not stop where the tokenizer ends a turn. Add " +
         std::to_string(*tok.eos_id) + " to eos_token_id, or use the model's own tokenizer.");
  }
  if (tok.bos_id && model.bos_id && *tok.bos_id != *model.bos_id) {
    fail("bos ids disagree: the tokenizer's bos_token is " + describe(tok, *tok.bos_id) +
         ", the model's bos_token_id is " + describe(tok, *model.bos_id) +
         ". Use the model's own tokenizer.");
  }

  if (model_eos.empty()) {
    report.warnings.push_back(
        model.source +
        " declares no eos_token_id: generation stops only at max_tokens or a stop string");
  } else if (tok.eos_id && !contains(model.eos_ids, *tok.eos_id)) {
    report.warnings.push_back(
        "the tokenizer's eos " + describe(tok, *tok.eos_id) +
        " is only in generation_config.json; the engines stop on config.json's eos_token_id " +
        id_list(model.eos_ids));
  }
  if (report.padding_rows > 0) {
    report.warnings.push_back(
        model.source + " has " + std::to_string(model.vocab_size) +
        " embedding rows, the tokenizer " + std::string(tokenizer_source) + " " +
        std::to_string(report.tokenizer_ids) + " ids: rows " +
        std::to_string(report.tokenizer_ids) + ".." + std::to_string(model.vocab_size - 1) +
        " are padding (normal for Qwen2 checkpoints); a sampled padding id decodes to nothing");
  }
  return report;
}

vocab_check_report check_vocab(const model_vocab& model, const tokenizer& tok,
                               std::string_view tokenizer_source) {
  return check_vocab(model, tok.spec(), tokenizer_source);
}

std::optional<vocab_check_report> check_model_dir_vocab(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec) || !fs::exists(dir / "config.json", ec) ||
      !fs::exists(dir / "tokenizer.json", ec)) {
    return std::nullopt;
  }
  const model_vocab model = load_model_vocab(dir);
  return check_vocab(model, load_tokenizer_json(dir), (dir / "tokenizer.json").string());
}

}  // namespace duet
