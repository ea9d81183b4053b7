// Byte-level BPE, following HF `tokenizers` step for step so that ids match exactly:
//   1. added tokens (normalized = false) are cut out of the raw text (leftmost-longest);
//   2. each remaining piece is normalized (NFC for Qwen), then normalized added tokens are cut;
//   3. the split regexes cut each piece into words (matches and gaps both kept, "Isolated");
//   4. each word's bytes are BPE-merged by merge rank (lowest rank, leftmost first).
// The vocab is keyed by raw bytes rather than by GPT-2's byte-to-unicode form, so no text is
// ever mapped to that form while encoding. See docs/tokenizer.md.
#include "runtime/tokenizer.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <utility>

namespace duet {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// UTF-8

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

void append_utf8(std::string& out, uint32_t cp) {
  utf8proc_uint8_t buf[4];
  const auto n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), buf);
  out.append(reinterpret_cast<const char*>(buf), static_cast<std::size_t>(n));
}

std::size_t utf8_length(uint32_t cp) {
  return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
}

// Result of reading one UTF-8 sequence at the front of a buffer.
struct utf8_step {
  enum kind_t { valid, invalid, truncated } kind;
  std::size_t length;  // valid: the sequence; invalid: the maximal subpart to replace
  uint32_t cp;         // valid only
};

// Reads one sequence following the Unicode "maximal subpart" rules (the table of well-formed
// byte sequences, Unicode 15 table 3-7), which Rust's from_utf8_lossy applies too.
utf8_step utf8_next(std::string_view s) {
  const auto b0 = static_cast<uint8_t>(s[0]);
  if (b0 < 0x80) return {utf8_step::valid, 1, b0};
  std::size_t need;
  uint8_t lo = 0x80, hi = 0xBF;  // range of the second byte
  uint32_t cp;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
    cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {utf8_step::invalid, 1, 0};
  }
  for (std::size_t i = 1; i < need; ++i) {
    if (i >= s.size()) return {utf8_step::truncated, i, 0};
    const auto b = static_cast<uint8_t>(s[i]);
    const uint8_t l = i == 1 ? lo : 0x80;
    const uint8_t h = i == 1 ? hi : 0xBF;
    if (b < l || b > h) return {utf8_step::invalid, i, 0};
    cp = (cp << 6) | (b & 0x3F);
  }
  return {utf8_step::valid, need, cp};
}

// Appends `in` to `out` with each maximal invalid subpart replaced by U+FFFD. Unless `final`,
// an incomplete sequence at the end is left unconsumed. Returns the bytes consumed.
std::size_t append_utf8_lossy(std::string_view in, std::string& out, bool final) {
  std::size_t i = 0;
  std::size_t run = 0;  // start of the current run of valid bytes, copied in one go
  while (i < in.size()) {
    if (static_cast<uint8_t>(in[i]) < 0x80) {
      ++i;
      continue;
    }
    const utf8_step st = utf8_next(in.substr(i));
    if (st.kind == utf8_step::valid) {
      i += st.length;
      continue;
    }
    out.append(in.substr(run, i - run));
    if (st.kind == utf8_step::truncated && !final) return i;
    out.append(kReplacement);
    i += st.length;
    run = i;
  }
  out.append(in.substr(run, i - run));
  return i;
}

bool is_valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const utf8_step st = utf8_next(s.substr(i));
    if (st.kind != utf8_step::valid) return false;
    i += st.length;
  }
  return true;
}

// Rust's char::is_whitespace (the Unicode White_Space property).
bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// Letters, numbers and '_' (what HF's single_word treats as part of a word).
bool is_word_char(uint32_t cp) {
  if (cp == '_') return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

// Last code point before `end` (nullopt at the start or after an invalid byte).
std::optional<uint32_t> last_cp(std::string_view s) {
  if (s.empty()) return std::nullopt;
  std::size_t i = s.size() - 1;
  while (i > 0 && s.size() - i < 4 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
  const utf8_step st = utf8_next(s.substr(i));
  if (st.kind != utf8_step::valid || i + st.length != s.size()) return std::nullopt;
  return st.cp;
}

std::optional<uint32_t> first_cp(std::string_view s) {
  if (s.empty()) return std::nullopt;
  const utf8_step st = utf8_next(s);
  if (st.kind != utf8_step::valid) return std::nullopt;
  return st.cp;
}

std::size_t next_char_len(std::string_view s) {
  const utf8_step st = utf8_next(s);
  return st.kind == utf8_step::valid ? st.length : 1;
}

// ---------------------------------------------------------------------------------------------
// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the other 68 bytes map to
// U+0100.. in byte order, so every byte has a visible character in the vocab files.

struct byte_level_table {
  std::array<uint32_t, 256> byte_to_cp{};
  std::array<int16_t, 0x144> cp_to_byte{};

  byte_level_table() {
    cp_to_byte.fill(-1);
    uint32_t n = 0;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      byte_to_cp[b] = printable ? b : 0x100 + n++;
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

const byte_level_table& byte_level() {
  static const byte_level_table table;
  return table;
}

// Raw bytes of a vocab-form token; false when a character is not in the byte-level alphabet
// (then `out` is unspecified).
bool byte_level_to_bytes(std::string_view token, std::string& out) {
  out.clear();
  const auto& t = byte_level();
  for (std::size_t i = 0; i < token.size();) {
    const utf8_step st = utf8_next(token.substr(i));
    if (st.kind != utf8_step::valid || st.cp >= t.cp_to_byte.size() || t.cp_to_byte[st.cp] < 0) {
      return false;
    }
    out.push_back(static_cast<char>(t.cp_to_byte[st.cp]));
    i += st.length;
  }
  return true;
}

std::string bytes_to_byte_level(std::string_view raw) {
  std::string out;
  out.reserve(raw.size() * 2);
  for (const char c : raw) append_utf8(out, byte_level().byte_to_cp[static_cast<uint8_t>(c)]);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Hash tables for the hot path: open addressing, power-of-two capacity, linear probing.

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ULL;
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ULL;
  x ^= x >> 32;
  return x;
}

inline uint64_t hash_bytes(std::string_view s) {
  uint64_t h = 0x9E3779B97F4A7C15ULL ^ (s.size() * 0xff51afd7ed558ccdULL);
  const char* p = s.data();
  std::size_t n = s.size();
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 29;
    p += 8;
    n -= 8;
  }
  if (n > 0) {
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    h = (h ^ w) * 0x94d049bb133111ebULL;
  }
  return mix64(h);
}

std::size_t table_capacity(std::size_t n) {
  std::size_t cap = 16;
  while (cap < n * 2) cap <<= 1;
  return cap;
}

// (left id, right id) -> (rank, merged id).
class merge_table {
 public:
  struct entry {
    uint64_t key = kEmpty;
    uint32_t rank = 0;
    int32_t merged = -1;
  };
  static constexpr uint64_t kEmpty = ~0ULL;

  void reserve(std::size_t n) {
    slots_.assign(table_capacity(n), entry{});
    mask_ = slots_.size() - 1;
  }
  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  // Later duplicates overwrite earlier ones, as HF's HashMap collect does.
  void insert(int32_t a, int32_t b, uint32_t rank, int32_t merged) {
    const uint64_t k = key(a, b);
    for (std::size_t i = mix64(k) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == kEmpty || slots_[i].key == k) {
        slots_[i] = {k, rank, merged};
        return;
      }
    }
  }
  [[nodiscard]] const entry* find(int32_t a, int32_t b) const {
    const uint64_t k = key(a, b);
    for (std::size_t i = mix64(k) & mask_;; i = (i + 1) & mask_) {
      const entry& e = slots_[i];
      if (e.key == k) return &e;
      if (e.key == kEmpty) return nullptr;
    }
  }

 private:
  std::vector<entry> slots_;
  std::size_t mask_ = 0;
};

// Raw bytes -> id, over strings owned elsewhere (the id -> bytes table).
class bytes_table {
 public:
  void build(const std::vector<std::string>& id_bytes, const std::vector<uint8_t>& include) {
    std::size_t n = 0;
    for (uint8_t inc : include) n += inc;
    slots_.assign(table_capacity(n), slot{});
    mask_ = slots_.size() - 1;
    strings_ = &id_bytes;
    for (std::size_t id = 0; id < id_bytes.size(); ++id) {
      if (!include[id]) continue;
      const std::string_view s = id_bytes[id];
      const uint64_t h = hash_bytes(s);
      for (std::size_t i = h & mask_;; i = (i + 1) & mask_) {
        if (slots_[i].id < 0) {
          slots_[i] = {static_cast<uint32_t>(h >> 32), static_cast<int32_t>(id)};
          break;
        }
        if (slots_[i].tag == static_cast<uint32_t>(h >> 32) && (*strings_)[slots_[i].id] == s) {
          break;  // the first id of duplicate strings wins
        }
      }
    }
  }
  [[nodiscard]] int32_t find(std::string_view s) const {
    const uint64_t h = hash_bytes(s);
    const auto tag = static_cast<uint32_t>(h >> 32);
    for (std::size_t i = h & mask_;; i = (i + 1) & mask_) {
      const slot& e = slots_[i];
      if (e.id < 0) return -1;
      if (e.tag == tag && (*strings_)[e.id] == s) return e.id;
    }
  }

 private:
  struct slot {
    uint32_t tag = 0;
    int32_t id = -1;
  };
  std::vector<slot> slots_;
  std::size_t mask_ = 0;
  const std::vector<std::string>* strings_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// PCRE2 split regexes.

// Per-thread match data and JIT stack (neither may be shared between threads).
struct pcre2_thread_state {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;

  pcre2_thread_state() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (data == nullptr || context == nullptr || stack == nullptr) throw std::bad_alloc();
    pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~pcre2_thread_state() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
  pcre2_thread_state(const pcre2_thread_state&) = delete;
  pcre2_thread_state& operator=(const pcre2_thread_state&) = delete;
};

pcre2_thread_state& pcre2_state() {
  thread_local pcre2_thread_state state;
  return state;
}

class split_regex {
 public:
  explicit split_regex(const std::string& pattern) : pattern_(pattern) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ =
        pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                      PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
    if (code_ == nullptr) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(error, message.data(), message.size());
      throw std::invalid_argument("tokenizer: bad split regex at offset " + std::to_string(offset) +
                                  " (" + reinterpret_cast<const char*>(message.data()) +
                                  "): " + pattern);
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~split_regex() { pcre2_code_free(code_); }
  split_regex(const split_regex&) = delete;
  split_regex& operator=(const split_regex&) = delete;

  // Calls fn(piece) for every non-empty match and every non-empty gap between matches, in
  // order. Empty matches still cut (like HF's Isolated split); an empty match right after the
  // previous match is skipped by stepping one character, as the onig crate's find_iter does.
  template <typename F>
  void split(std::string_view s, F&& fn) const {
    pcre2_thread_state& st = pcre2_state();
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    std::size_t search = 0;   // where the next search starts
    std::size_t emitted = 0;  // end of what has been handed to fn
    std::size_t last_end = std::numeric_limits<std::size_t>::max();
    while (search <= s.size()) {
      const int rc = jit_
                         ? pcre2_jit_match(code_, subject, s.size(), search, 0, st.data, st.context)
                         : pcre2_match(code_, subject, s.size(), search, 0, st.data, st.context);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        std::array<PCRE2_UCHAR, 256> message{};
        pcre2_get_error_message(rc, message.data(), message.size());
        throw std::runtime_error(std::string("tokenizer: regex match failed (") +
                                 reinterpret_cast<const char*>(message.data()) + "): " + pattern_);
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
      const std::size_t begin = ov[0];
      const std::size_t end = ov[1];
      if (begin == end && last_end == end) {
        if (search >= s.size()) break;
        search += next_char_len(s.substr(search));
        continue;
      }
      if (begin > emitted) fn(s.substr(emitted, begin - emitted));
      if (end > begin) fn(s.substr(begin, end - begin));
      emitted = end;
      search = end;
      last_end = end;
    }
    if (emitted < s.size()) fn(s.substr(emitted));
  }

 private:
  std::string pattern_;
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

// ---------------------------------------------------------------------------------------------
// Pre-tokenizer families (GGUF's tokenizer.ggml.pre). The patterns are those of the models'
// own tokenizer.json files and of HF's ByteLevel pre-tokenizer; docs/tokenizer.md cites them.

constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kDigitRegex = R"(\p{N})";
constexpr const char* kDigitsRegex = R"(\p{N}+)";

struct family {
  std::string_view name;
  std::vector<std::string> regexes;
  bool ignore_merges;           // HF BPE ignore_merges (Llama-3's tokenizer.json sets it)
  std::string_view normalizer;  // the normalizer of the family's tokenizer.json (Qwen: NFC)
};

const std::vector<family>& families() {
  static const std::vector<family> table = {
      {"llama3", {kLlama3Regex}, true, ""},
      {"llama-bpe", {kLlama3Regex}, true, ""},
      {"llama-v3", {kLlama3Regex}, true, ""},
      {"dbrx", {kLlama3Regex}, false, ""},
      {"smaug-bpe", {kLlama3Regex}, false, ""},
      {"qwen2", {kQwen2Regex}, false, "nfc"},
      {"qwen3", {kQwen2Regex}, false, "nfc"},
      {"deepseek-r1-qwen", {kQwen2Regex}, false, "nfc"},
      {"stablelm2", {kQwen2Regex}, false, ""},
      {"gpt2", {kGpt2Regex}, false, ""},
      {"gpt-2", {kGpt2Regex}, false, ""},
      {"default", {kGpt2Regex}, false, ""},  // a byte-level BPE that names no family: HF's default
      {"mpt", {kGpt2Regex}, false, ""},
      {"olmo", {kGpt2Regex}, false, ""},
      {"jais", {kGpt2Regex}, false, ""},
      {"smollm", {kDigitRegex, kGpt2Regex}, false, ""},
      {"starcoder", {kDigitRegex, kGpt2Regex}, false, ""},
      {"refact", {kDigitRegex, kGpt2Regex}, false, ""},
      {"command-r", {kDigitRegex, kGpt2Regex}, false, ""},
      {"codeshell", {kDigitRegex, kGpt2Regex}, false, ""},
      {"exaone", {kDigitRegex, kGpt2Regex}, false, ""},
  };
  return table;
}

const family* find_family(std::string_view name) {
  for (const family& f : families()) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

// ---------------------------------------------------------------------------------------------
// Normalizers (utf8proc).

enum class normal_form { none, nfc, nfd, nfkc, nfkd };

normal_form parse_normal_form(std::string_view name) {
  if (name.empty()) return normal_form::none;
  if (name == "nfc" || name == "NFC") return normal_form::nfc;
  if (name == "nfd" || name == "NFD") return normal_form::nfd;
  if (name == "nfkc" || name == "NFKC") return normal_form::nfkc;
  if (name == "nfkd" || name == "NFKD") return normal_form::nfkd;
  throw std::invalid_argument("tokenizer: unsupported normalizer '" + std::string(name) +
                              "' (supported: nfc, nfd, nfkc, nfkd)");
}

// Code points that are their own NFC form and never combine with a neighbour (NFC_QC = Yes,
// canonical combining class 0): a piece made only of them is already in NFC. Conservative:
// Latin up to the combining diacritics, CJK ideographs, Hangul syllables, kana letters,
// CJK punctuation, fullwidth ASCII and the emoji blocks.
bool nfc_inert(uint32_t cp) {
  return cp < 0x300 || (cp >= 0x3000 && cp <= 0x3029) || (cp >= 0x3041 && cp <= 0x3096) ||
         (cp >= 0x30A1 && cp <= 0x30FA) || (cp >= 0x4E00 && cp <= 0x9FFF) ||
         (cp >= 0xAC00 && cp <= 0xD7A3) || (cp >= 0xFF01 && cp <= 0xFF5E) ||
         (cp >= 0x1F300 && cp <= 0x1FAFF);
}

void normalize_valid(std::string_view s, normal_form form, std::string& out) {
  int options = UTF8PROC_STABLE;
  switch (form) {
    case normal_form::nfc:
      options |= UTF8PROC_COMPOSE;
      break;
    case normal_form::nfd:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case normal_form::nfkc:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case normal_form::nfkd:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
    case normal_form::none:
      out.append(s);
      return;
  }
  utf8proc_uint8_t* result = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                          static_cast<utf8proc_ssize_t>(s.size()), &result,
                                          static_cast<utf8proc_option_t>(options));
  if (n < 0) {
    out.append(s);  // cannot happen for valid UTF-8; keep the text rather than lose it
  } else {
    out.append(reinterpret_cast<const char*>(result), static_cast<std::size_t>(n));
  }
  std::free(result);
}

// True when `s` needs no change; otherwise writes the normalized text to `out`. Normalization
// is local: the text can be cut before any inert character (canonical combining class 0,
// quick check Yes), so only the stretches around other characters go through utf8proc, from
// the inert character before them to the one after. Bytes that are not valid UTF-8 are kept
// as they are and cut the text too.
bool normalize_into(std::string_view s, normal_form form, std::string& out) {
  if (form == normal_form::none) return true;
  const auto inert = [form](uint32_t cp) {
    return form == normal_form::nfc ? nfc_inert(cp) : cp < 0xA0;
  };
  std::size_t copied = 0;    // s[0, copied) is in `out` already
  std::size_t boundary = 0;  // a cut point at or before the current character
  bool changed = false;
  std::size_t i = 0;
  while (i < s.size()) {
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      boundary = i++;
      continue;
    }
    utf8_step st = utf8_next(s.substr(i));
    if (st.kind == utf8_step::valid && inert(st.cp)) {
      boundary = i;
      i += st.length;
      continue;
    }
    if (!changed) {
      out.clear();
      changed = true;
    }
    if (st.kind != utf8_step::valid) {  // keep invalid bytes; they end any stretch
      out.append(s.substr(copied, i - copied));
      out.append(s.substr(i, st.length));
      i += st.length;
      copied = boundary = i;
      continue;
    }
    std::size_t j = i + st.length;  // end of the stretch: the next inert or invalid character
    while (j < s.size()) {
      if (static_cast<uint8_t>(s[j]) < 0x80) break;
      st = utf8_next(s.substr(j));
      if (st.kind != utf8_step::valid || inert(st.cp)) break;
      j += st.length;
    }
    out.append(s.substr(copied, boundary - copied));
    normalize_valid(s.substr(boundary, j - boundary), form, out);
    copied = boundary = i = j;
  }
  if (!changed) return true;
  out.append(s.substr(copied));
  return false;
}

// ---------------------------------------------------------------------------------------------
// Added tokens: a byte trie, matched leftmost-longest as HF's Aho-Corasick does.

class added_matcher {
 public:
  struct token {
    int32_t id;
    bool lstrip, rstrip, single_word;
  };

  void add(std::string_view content, token t) {
    if (content.empty()) return;
    int32_t node = 0;
    for (const char c : content) {
      const auto b = static_cast<uint8_t>(c);
      int32_t child = -1;
      for (const auto& [byte, next] : nodes_[node].next) {
        if (byte == b) child = next;
      }
      if (child < 0) {
        child = static_cast<int32_t>(nodes_.size());
        nodes_[node].next.emplace_back(b, child);
        nodes_.emplace_back();
      }
      node = child;
    }
    first_[static_cast<uint8_t>(content[0])] = true;
    if (nodes_[node].token < 0) {
      nodes_[node].token = static_cast<int32_t>(tokens_.size());
      tokens_.push_back(t);
    }
  }
  [[nodiscard]] bool empty() const { return tokens_.empty(); }

  // Splits `s` into text pieces (fn(piece, -1)) and matched tokens (fn({}, id)).
  template <typename F>
  void split(std::string_view s, F&& fn) const {
    if (tokens_.empty()) {
      if (!s.empty()) fn(s, -1);
      return;
    }
    std::size_t emitted = 0;
    std::size_t pos = 0;
    while (pos < s.size()) {
      std::size_t len = 0;
      const token* t = longest_at(s, pos, len);
      if (t == nullptr) {
        ++pos;
        continue;
      }
      std::size_t begin = pos;
      std::size_t end = pos + len;
      if (t->single_word) {
        const auto before = last_cp(s.substr(0, begin));
        const auto after = first_cp(s.substr(end));
        if ((before && is_word_char(*before)) || (after && is_word_char(*after))) {
          pos = end;  // HF's matcher resumes after the rejected match
          continue;
        }
      }
      if (t->lstrip) {
        while (begin > emitted) {
          const auto cp = last_cp(s.substr(emitted, begin - emitted));
          if (!cp || !is_white_space(*cp)) break;
          begin -= utf8_length(*cp);
        }
      }
      if (t->rstrip) {
        while (end < s.size()) {
          const auto cp = first_cp(s.substr(end));
          if (!cp || !is_white_space(*cp)) break;
          end += next_char_len(s.substr(end));
        }
      }
      if (begin > emitted) fn(s.substr(emitted, begin - emitted), -1);
      fn(std::string_view{}, t->id);
      emitted = end;
      pos = end;
    }
    if (emitted < s.size()) fn(s.substr(emitted), -1);
  }

  added_matcher() { nodes_.emplace_back(); }

 private:
  const token* longest_at(std::string_view s, std::size_t pos, std::size_t& len) const {
    if (!first_[static_cast<uint8_t>(s[pos])]) return nullptr;
    const token* best = nullptr;
    int32_t node = 0;
    for (std::size_t i = pos; i < s.size(); ++i) {
      const auto b = static_cast<uint8_t>(s[i]);
      int32_t child = -1;
      for (const auto& [byte, next] : nodes_[node].next) {
        if (byte == b) {
          child = next;
          break;
        }
      }
      if (child < 0) break;
      node = child;
      if (nodes_[node].token >= 0) {
        best = &tokens_[nodes_[node].token];
        len = i + 1 - pos;
      }
    }
    return best;
  }

  struct node {
    std::vector<std::pair<uint8_t, int32_t>> next;
    int32_t token = -1;
  };
  std::vector<node> nodes_;
  std::vector<token> tokens_;
  std::array<bool, 256> first_{};
};

// ---------------------------------------------------------------------------------------------
// Word cache: word bytes -> ids, sharded so that threads rarely meet on one lock.

struct string_hash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return hash_bytes(s); }
};

class word_cache {
 public:
  static constexpr std::size_t kMaxWordBytes = 64;

  bool get(std::string_view word, std::vector<int32_t>& out) const {
    shard& sh = shards_[hash_bytes(word) % kShards];
    std::lock_guard lock(sh.mutex);
    const auto it = sh.map.find(word);
    if (it == sh.map.end()) return false;
    out.insert(out.end(), it->second.begin(), it->second.end());
    return true;
  }
  void put(std::string_view word, std::span<const int32_t> ids) const {
    shard& sh = shards_[hash_bytes(word) % kShards];
    std::lock_guard lock(sh.mutex);
    if (sh.map.size() >= kMaxPerShard) sh.map.clear();  // bounded memory; refills quickly
    sh.map.try_emplace(std::string(word), ids.begin(), ids.end());
  }

 private:
  static constexpr std::size_t kShards = 32;
  static constexpr std::size_t kMaxPerShard = 4096;
  struct shard {
    std::mutex mutex;
    std::unordered_map<std::string, std::vector<int32_t>, string_hash, std::equal_to<>> map;
  };
  mutable std::array<shard, kShards> shards_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------

std::vector<std::string> pre_tokenizer_family_regexes(std::string_view name) {
  if (const family* f = find_family(name)) return f->regexes;
  std::string known;
  for (const family& f : families()) {
    known += known.empty() ? "" : ", ";
    known += f.name;
  }
  throw std::invalid_argument("tokenizer: unknown pre-tokenizer family '" + std::string(name) +
                              "' (known: " + known + ")");
}

bool pre_tokenizer_family_ignores_merges(std::string_view name) {
  const family* f = find_family(name);
  return f != nullptr && f->ignore_merges;
}

std::string pre_tokenizer_family_normalizer(std::string_view name) {
  const family* f = find_family(name);
  return f != nullptr ? std::string(f->normalizer) : std::string{};
}

struct tokenizer::impl {
  tokenizer_spec spec;
  std::vector<std::string> id_token;  // vocab form ("Ġhello") or added content
  std::vector<std::string> id_bytes;  // raw bytes each id decodes to
  std::vector<uint8_t> special;       // 1 for special added tokens
  std::unordered_map<std::string, int32_t, string_hash, std::equal_to<>> token_ids;
  bytes_table word_ids;                // raw bytes -> id, for BPE (vocab entries only)
  std::array<int32_t, 256> byte_id{};  // id of each single byte, -1 when absent
  merge_table merges;
  added_matcher added_raw;   // added tokens matched on the original text
  added_matcher added_norm;  // added tokens with normalized = true, matched after normalizing
  std::vector<std::unique_ptr<split_regex>> regexes;
  normal_form norm = normal_form::none;
  bool ignore_merges = false;
  word_cache cache;

  explicit impl(tokenizer_spec s);
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void pre_tokenize(std::string_view piece, std::size_t step, std::vector<int32_t>& out) const;
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  void merge_small(std::string_view word, std::vector<int32_t>& out) const;
  void merge_large(std::string_view word, std::vector<int32_t>& out) const;
};

tokenizer::impl::impl(tokenizer_spec s) : spec(std::move(s)) {
  // A spec that names only a family (as a GGUF file does) gets the family's HF settings.
  if (spec.pre_tokenizer_regexes.empty() && spec.normalizer.empty()) {
    spec.normalizer = pre_tokenizer_family_normalizer(spec.pre_tokenizer);
  }
  norm = parse_normal_form(spec.normalizer);

  std::size_t n = spec.vocab.size();
  for (const auto& a : spec.added) {
    if (a.id < 0) throw std::invalid_argument("tokenizer: added token with negative id");
    n = std::max(n, static_cast<std::size_t>(a.id) + 1);
  }
  id_token.assign(n, std::string{});
  id_bytes.assign(n, std::string{});
  special.assign(n, 0);
  for (std::size_t id = 0; id < spec.vocab.size(); ++id) id_token[id] = spec.vocab[id];
  for (const auto& a : spec.added) {
    id_token[a.id] = a.content;
    special[a.id] = a.special ? 1 : 0;
  }

  // Vocab form -> id for merges and token_to_id: vocab entries first, then added contents.
  token_ids.reserve(n);
  for (std::size_t id = 0; id < spec.vocab.size(); ++id) {
    if (!spec.vocab[id].empty()) token_ids.emplace(spec.vocab[id], static_cast<int32_t>(id));
  }
  for (const auto& a : spec.added) token_ids.emplace(a.content, a.id);

  // Raw bytes of each id. A token with a character outside the byte-level alphabet decodes to
  // its own UTF-8, as HF's ByteLevel decoder does. Added tokens decode through the same
  // mapping (HF runs that decoder over them too), so an added "café" decodes to "caf\xE9",
  // which becomes U+FFFD. BPE may produce every vocab entry (GGUF vocabs hold the added
  // tokens' contents too) but not ids that only added tokens name.
  std::vector<uint8_t> bpe_entry(n, 0);
  std::string raw;
  for (std::size_t id = 0; id < n; ++id) {
    if (byte_level_to_bytes(id_token[id], raw)) {
      id_bytes[id] = raw;
    } else {
      id_bytes[id] = id_token[id];
    }
    if (id < spec.vocab.size() && !spec.vocab[id].empty() &&
        byte_level_to_bytes(spec.vocab[id], raw) && raw == id_bytes[id]) {
      bpe_entry[id] = 1;
    }
  }
  word_ids.build(id_bytes, bpe_entry);
  for (int b = 0; b < 256; ++b) {
    const char c = static_cast<char>(b);
    byte_id[b] = word_ids.find(std::string_view(&c, 1));
  }

  merges.reserve(spec.merges.size());
  const auto lookup = [&](const std::string& tok, std::size_t rank) {
    const auto it = token_ids.find(tok);
    if (it == token_ids.end()) {
      throw std::invalid_argument("tokenizer: merge #" + std::to_string(rank) + " ('" +
                                  spec.merges[rank].first + "' '" + spec.merges[rank].second +
                                  "'): '" + tok + "' is not in the vocab");
    }
    return it->second;
  };
  for (std::size_t r = 0; r < spec.merges.size(); ++r) {
    const auto& [a, b] = spec.merges[r];
    const int32_t ia = lookup(a, r);
    const int32_t ib = lookup(b, r);
    const int32_t im = lookup(a + b, r);
    merges.insert(ia, ib, static_cast<uint32_t>(r), im);
  }

  for (const auto& a : spec.added) {
    const added_matcher::token t{a.id, a.lstrip, a.rstrip, a.single_word};
    if (a.normalized) {  // matched in the second pass, after normalizing (even when none)
      std::string normalized;
      if (normalize_into(a.content, norm, normalized)) normalized = a.content;
      added_norm.add(normalized, t);
    } else {
      added_raw.add(a.content, t);
    }
  }

  std::vector<std::string> patterns = spec.pre_tokenizer_regexes;
  ignore_merges = spec.ignore_merges;
  if (patterns.empty()) {
    if (spec.pre_tokenizer.empty()) {
      throw std::invalid_argument(
          "tokenizer: the spec names no pre-tokenizer (neither regexes nor a family)");
    }
    patterns = pre_tokenizer_family_regexes(spec.pre_tokenizer);
    ignore_merges = ignore_merges || pre_tokenizer_family_ignores_merges(spec.pre_tokenizer);
  }
  for (const auto& p : patterns) regexes.push_back(std::make_unique<split_regex>(p));
  spec.ignore_merges = ignore_merges;  // spec() tells what is in effect

  if (spec.bos_id && (*spec.bos_id < 0 || static_cast<std::size_t>(*spec.bos_id) >= n)) {
    throw std::invalid_argument("tokenizer: bos id " + std::to_string(*spec.bos_id) +
                                " is outside the vocab");
  }
  if (spec.eos_id && (*spec.eos_id < 0 || static_cast<std::size_t>(*spec.eos_id) >= n)) {
    throw std::invalid_argument("tokenizer: eos id " + std::to_string(*spec.eos_id) +
                                " is outside the vocab");
  }
  if (spec.add_bos && !spec.bos_id) {
    throw std::invalid_argument("tokenizer: add_bos is set but there is no bos token");
  }
}

void tokenizer::impl::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  std::string normalized;
  if (!normalize_into(piece, norm, normalized)) piece = normalized;
  if (added_norm.empty()) {
    pre_tokenize(piece, 0, out);
    return;
  }
  added_norm.split(piece, [&](std::string_view text, int32_t id) {
    if (id >= 0) {
      out.push_back(id);
    } else {
      pre_tokenize(text, 0, out);
    }
  });
}

void tokenizer::impl::pre_tokenize(std::string_view piece, std::size_t step,
                                   std::vector<int32_t>& out) const {
  if (step == regexes.size()) {
    encode_word(piece, out);
    return;
  }
  regexes[step]->split(piece, [&](std::string_view part) { pre_tokenize(part, step + 1, out); });
}

void tokenizer::impl::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    const int32_t id = word_ids.find(word);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  if (word.size() == 1) {
    const int32_t id = byte_id[static_cast<uint8_t>(word[0])];
    if (id >= 0) out.push_back(id);
    return;
  }
  const bool cacheable = word.size() <= word_cache::kMaxWordBytes;
  if (cacheable && cache.get(word, out)) return;
  const std::size_t before = out.size();
  if (word.size() <= 128) {
    merge_small(word, out);
  } else {
    merge_large(word, out);
  }
  if (cacheable) cache.put(word, std::span<const int32_t>(out).subspan(before));
}

// BPE for short words: arrays of symbols and of the rank of each adjacent pair; each step
// merges the lowest-ranked pair (leftmost on ties) and re-ranks only its two neighbours.
void tokenizer::impl::merge_small(std::string_view word, std::vector<int32_t>& out) const {
  constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
  std::array<int32_t, 128> ids;
  std::array<uint32_t, 128> ranks;
  std::array<int32_t, 128> merged;
  std::size_t n = 0;
  for (const char c : word) {
    const int32_t id = byte_id[static_cast<uint8_t>(c)];
    if (id >= 0) ids[n++] = id;  // bytes missing from the vocab are dropped, as HF does
  }
  const auto rank_pair = [&](std::size_t i) {
    const merge_table::entry* e = merges.find(ids[i], ids[i + 1]);
    ranks[i] = e != nullptr ? e->rank : kNone;
    merged[i] = e != nullptr ? e->merged : -1;
  };
  for (std::size_t i = 0; i + 1 < n; ++i) rank_pair(i);
  while (n > 1) {
    std::size_t best = 0;
    uint32_t best_rank = ranks[0];
    for (std::size_t i = 1; i + 1 < n; ++i) {
      if (ranks[i] < best_rank) {
        best_rank = ranks[i];
        best = i;
      }
    }
    if (best_rank == kNone) break;
    ids[best] = merged[best];
    for (std::size_t i = best + 1; i + 1 < n; ++i) ids[i] = ids[i + 1];
    for (std::size_t i = best; i + 2 < n; ++i) {
      ranks[i] = ranks[i + 1];
      merged[i] = merged[i + 1];
    }
    --n;
    if (best > 0) rank_pair(best - 1);
    if (best + 1 < n) rank_pair(best);
  }
  out.insert(out.end(), ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n));
}

// BPE for long words: a linked list of symbols and a heap of candidate merges ordered by
// (rank, position); stale heap entries are recognized and dropped when popped (as HF's
// Word::merge_all).
void tokenizer::impl::merge_large(std::string_view word, std::vector<int32_t>& out) const {
  struct symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
  };
  struct candidate {
    uint32_t rank;
    int32_t pos;
    bool operator>(const candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::vector<symbol> syms;
  syms.reserve(word.size());
  for (const char c : word) {
    const int32_t id = byte_id[static_cast<uint8_t>(c)];
    if (id < 0) continue;
    const auto i = static_cast<int32_t>(syms.size());
    syms.push_back({id, i - 1, -1});
    if (i > 0) syms[i - 1].next = i;
  }
  std::priority_queue<candidate, std::vector<candidate>, std::greater<>> heap;
  const auto push = [&](int32_t pos) {
    if (pos < 0 || syms[pos].next < 0) return;
    if (const merge_table::entry* e = merges.find(syms[pos].id, syms[syms[pos].next].id)) {
      heap.push({e->rank, pos});
    }
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(syms.size()); ++i) push(i);
  while (!heap.empty()) {
    const candidate top = heap.top();
    heap.pop();
    symbol& left = syms[top.pos];
    if (left.id < 0 || left.next < 0) continue;
    const merge_table::entry* e = merges.find(left.id, syms[left.next].id);
    if (e == nullptr || e->rank != top.rank) continue;  // stale: a neighbour has changed
    const int32_t right = left.next;
    left.id = e->merged;
    left.next = syms[right].next;
    if (left.next >= 0) syms[left.next].prev = top.pos;
    syms[right].id = -1;
    push(left.prev);
    push(top.pos);
  }
  for (int32_t i = syms.empty() ? -1 : 0; i >= 0; i = syms[i].next) out.push_back(syms[i].id);
}

// ---------------------------------------------------------------------------------------------

tokenizer::tokenizer(tokenizer_spec spec) : impl_(std::make_unique<impl>(std::move(spec))) {}
tokenizer::~tokenizer() = default;
tokenizer::tokenizer(tokenizer&&) noexcept = default;
tokenizer& tokenizer::operator=(tokenizer&&) noexcept = default;

std::vector<int32_t> tokenizer::encode(std::string_view text, bool add_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 2);
  if (add_special && impl_->spec.add_bos) out.push_back(*impl_->spec.bos_id);
  impl_->added_raw.split(text, [&](std::string_view piece, int32_t id) {
    if (id >= 0) {
      out.push_back(id);
    } else {
      impl_->encode_piece(piece, out);
    }
  });
  return out;
}

std::string tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string bytes;
  for (const int32_t id : ids) {
    if (id < 0 || static_cast<std::size_t>(id) >= impl_->id_bytes.size()) continue;
    if (skip_special && impl_->special[id]) continue;
    bytes += impl_->id_bytes[id];
  }
  if (is_valid_utf8(bytes)) return bytes;
  std::string out;
  out.reserve(bytes.size() + 8);
  append_utf8_lossy(bytes, out, true);
  return out;
}

std::string_view tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= impl_->id_bytes.size()) return {};
  return impl_->id_bytes[id];
}

std::optional<int32_t> tokenizer::token_to_id(std::string_view token) const {
  const auto it = impl_->token_ids.find(token);
  if (it == impl_->token_ids.end()) return std::nullopt;
  return it->second;
}

std::string_view tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= impl_->id_token.size()) return {};
  return impl_->id_token[id];
}

bool tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<std::size_t>(id) < impl_->special.size() && impl_->special[id];
}

std::string tokenizer::normalize(std::string_view text) const {
  std::string out;
  if (normalize_into(text, impl_->norm, out)) return std::string(text);
  return out;
}

std::size_t tokenizer::vocab_size() const {
  return impl_->id_bytes.size();
}
std::optional<int32_t> tokenizer::bos_id() const {
  return impl_->spec.bos_id;
}
std::optional<int32_t> tokenizer::eos_id() const {
  return impl_->spec.eos_id;
}
bool tokenizer::add_bos() const {
  return impl_->spec.add_bos;
}
const std::string& tokenizer::chat_template() const {
  return impl_->spec.chat_template;
}
const tokenizer_spec& tokenizer::spec() const {
  return impl_->spec;
}

// ---------------------------------------------------------------------------------------------

stream_decoder::stream_decoder(const tokenizer& tok, bool skip_special)
    : tok_(&tok), skip_special_(skip_special) {}

std::string stream_decoder::take_complete() {
  std::string out;
  const std::size_t used = append_utf8_lossy(pending_, out, false);
  pending_.erase(0, used);
  return out;
}

std::string stream_decoder::push(int32_t id) {
  if (skip_special_ && tok_->is_special(id)) return {};
  pending_ += tok_->token_bytes(id);
  return take_complete();
}

std::string stream_decoder::push(std::span<const int32_t> ids) {
  for (const int32_t id : ids) {
    if (skip_special_ && tok_->is_special(id)) continue;
    pending_ += tok_->token_bytes(id);
  }
  return take_complete();
}

std::string stream_decoder::flush() {
  std::string out;
  append_utf8_lossy(pending_, out, true);
  pending_.clear();
  return out;
}

// ---------------------------------------------------------------------------------------------
// tokenizer.json loading

namespace {

[[noreturn]] void fail(const std::filesystem::path& file, const std::string& what) {
  throw std::runtime_error(file.string() + ": " + what);
}

json read_json(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) fail(file, "cannot open");
  std::ostringstream buf;
  buf << in.rdbuf();
  try {
    return json::parse(buf.str());
  } catch (const json::parse_error& e) {
    fail(file, std::string("not valid JSON: ") + e.what());
  }
}

std::string type_of(const json& j) {
  if (!j.is_object()) return {};
  const auto it = j.find("type");
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string{};
}

bool flag(const json& j, const char* key, bool fallback) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) throw std::invalid_argument(std::string("'") + key + "' is not a boolean");
  return it->get<bool>();
}

std::string escape_regex(std::string_view literal) {
  std::string out;
  for (const char c : literal) {
    if (c != '\0' && std::strchr("\\^$.|?*+()[]{}-/#", c) != nullptr) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

// Appends the split regexes of an HF pre_tokenizer; returns whether a ByteLevel step was seen.
bool collect_pre_tokenizer(const json& pt, std::vector<std::string>& regexes) {
  const std::string type = type_of(pt);
  if (type == "Sequence") {
    bool byte_level = false;
    for (const json& p : pt.at("pretokenizers")) byte_level |= collect_pre_tokenizer(p, regexes);
    return byte_level;
  }
  if (type == "Split") {
    const json& pattern = pt.at("pattern");
    if (pattern.contains("Regex")) {
      regexes.push_back(pattern.at("Regex").get<std::string>());
    } else if (pattern.contains("String")) {
      regexes.push_back(escape_regex(pattern.at("String").get<std::string>()));
    } else {
      throw std::invalid_argument(
          "Split pattern is neither {\"Regex\": ...} nor {\"String\": ...}");
    }
    const std::string behavior = pt.value("behavior", std::string("Isolated"));
    if (behavior != "Isolated") {
      throw std::invalid_argument("unsupported Split behavior '" + behavior +
                                  "' (only \"Isolated\" is)");
    }
    if (flag(pt, "invert", false)) throw std::invalid_argument("unsupported Split with invert");
    return false;
  }
  if (type == "Digits") {
    regexes.emplace_back(flag(pt, "individual_digits", false) ? kDigitRegex : kDigitsRegex);
    return false;
  }
  if (type == "ByteLevel") {
    if (flag(pt, "add_prefix_space", false)) {
      throw std::invalid_argument("unsupported ByteLevel pre-tokenizer with add_prefix_space");
    }
    if (flag(pt, "use_regex", true)) regexes.emplace_back(kGpt2Regex);
    return true;
  }
  throw std::invalid_argument("unsupported pre_tokenizer type '" + type + "'");
}

std::string parse_normalizer(const json& n) {
  if (n.is_null()) return {};
  const std::string type = type_of(n);
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    std::string lower = type;
    std::transform(lower.begin(), lower.end(), lower.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return lower;
  }
  if (type == "Sequence") {
    const json& list = n.at("normalizers");
    if (list.empty()) return {};
    if (list.size() == 1) return parse_normalizer(list[0]);
  }
  throw std::invalid_argument("unsupported normalizer " + n.dump());
}

// The special token a TemplateProcessing puts first in a single sequence, if any.
std::optional<int32_t> template_bos(const json& pp) {
  const std::string type = type_of(pp);
  if (type == "Sequence") {
    for (const json& p : pp.at("processors")) {
      if (auto id = template_bos(p)) return id;
    }
    return std::nullopt;
  }
  if (type != "TemplateProcessing") return std::nullopt;
  const json& single = pp.at("single");
  if (!single.is_array() || single.empty() || !single[0].contains("SpecialToken")) {
    return std::nullopt;
  }
  const std::string name = single[0].at("SpecialToken").at("id").get<std::string>();
  const json& ids = pp.at("special_tokens").at(name).at("ids");
  if (!ids.is_array() || ids.empty()) return std::nullopt;
  return ids[0].get<int32_t>();
}

// A token given as a string or as {"content": ...} (null when absent).
std::optional<std::string> token_name(const json& config, const char* key) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content")) return it->at("content").get<std::string>();
  throw std::invalid_argument(std::string("'") + key + "' is neither a string nor {content}");
}

std::optional<int32_t> resolve_token(const tokenizer_spec& spec, const std::string& name) {
  for (const auto& a : spec.added) {
    if (a.content == name) return a.id;
  }
  const std::string form = bytes_to_byte_level(name);
  for (std::size_t id = 0; id < spec.vocab.size(); ++id) {
    if (spec.vocab[id] == form || spec.vocab[id] == name) return static_cast<int32_t>(id);
  }
  return std::nullopt;
}

tokenizer_spec::added_token parse_added(const json& a, int32_t id) {
  tokenizer_spec::added_token t;
  t.id = id;
  t.content = a.at("content").get<std::string>();
  t.special = flag(a, "special", false);
  t.lstrip = flag(a, "lstrip", false);
  t.rstrip = flag(a, "rstrip", false);
  t.single_word = flag(a, "single_word", false);
  t.normalized = flag(a, "normalized", !t.special);
  return t;
}

void parse_tokenizer_json(const json& root, tokenizer_spec& spec) {
  if (!root.is_object()) throw std::invalid_argument("the top level is not an object");
  if (!root.contains("model")) throw std::invalid_argument("no \"model\"");
  const json& model = root.at("model");
  const std::string model_type = type_of(model);
  if (!model_type.empty() && model_type != "BPE") {
    throw std::invalid_argument("model type '" + model_type + "' is not BPE");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const auto it = model.find(key);
    if (it != model.end() && it->is_string() && !it->get<std::string>().empty()) {
      throw std::invalid_argument(std::string("unsupported BPE ") + key);
    }
  }
  spec.ignore_merges = flag(model, "ignore_merges", false);

  const json& vocab = model.at("vocab");
  if (!vocab.is_object()) throw std::invalid_argument("model.vocab is not an object");
  constexpr int64_t kMaxVocab = int64_t{1} << 24;
  for (const auto& [token, id_json] : vocab.items()) {
    if (!id_json.is_number_integer()) {
      throw std::invalid_argument("vocab entry '" + token + "' has a non-integer id");
    }
    const auto id = id_json.get<int64_t>();
    if (id < 0 || id >= kMaxVocab) {
      throw std::invalid_argument("vocab entry '" + token + "' has id " + std::to_string(id) +
                                  " out of range");
    }
    if (static_cast<std::size_t>(id) >= spec.vocab.size()) spec.vocab.resize(id + 1);
    spec.vocab[id] = token;
  }

  const json& merges = model.at("merges");
  if (!merges.is_array()) throw std::invalid_argument("model.merges is not an array");
  spec.merges.reserve(merges.size());
  for (std::size_t i = 0; i < merges.size(); ++i) {
    const json& m = merges[i];
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const auto space = s.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 == s.size() ||
          s.find(' ', space + 1) != std::string::npos) {
        throw std::invalid_argument("merge #" + std::to_string(i) + " '" + s +
                                    "' is not two tokens separated by one space");
      }
      spec.merges.emplace_back(s.substr(0, space), s.substr(space + 1));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      spec.merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      throw std::invalid_argument("merge #" + std::to_string(i) + " is neither \"a b\" nor [a, b]");
    }
  }

  if (const auto it = root.find("added_tokens"); it != root.end() && !it->is_null()) {
    // As HF does, an added token whose content is already a vocab entry takes that entry's id.
    std::unordered_map<std::string_view, int32_t> vocab_ids;
    for (const json& a : *it) {
      auto token = parse_added(a, a.at("id").get<int32_t>());
      if (token.id < 0)
        throw std::invalid_argument("added token '" + token.content + "' has a negative id");
      const bool matches = static_cast<std::size_t>(token.id) < spec.vocab.size() &&
                           spec.vocab[token.id] == token.content;
      if (!matches) {
        if (vocab_ids.empty()) {
          for (std::size_t id = 0; id < spec.vocab.size(); ++id) {
            vocab_ids.emplace(spec.vocab[id], static_cast<int32_t>(id));
          }
        }
        if (const auto v = vocab_ids.find(token.content); v != vocab_ids.end())
          token.id = v->second;
      }
      spec.added.push_back(std::move(token));
    }
  }

  spec.normalizer = parse_normalizer(root.value("normalizer", json()));

  const json pt = root.value("pre_tokenizer", json());
  if (pt.is_null() || !collect_pre_tokenizer(pt, spec.pre_tokenizer_regexes)) {
    throw std::invalid_argument("not a byte-level BPE tokenizer (no ByteLevel pre-tokenizer)");
  }
  for (const family& f : families()) {
    if (f.regexes == spec.pre_tokenizer_regexes) {
      spec.pre_tokenizer = f.name;
      break;
    }
  }
  if (spec.pre_tokenizer.empty()) spec.pre_tokenizer = "custom";

  if (const json pp = root.value("post_processor", json()); !pp.is_null()) {
    if (const auto bos = template_bos(pp)) {
      spec.bos_id = bos;
      spec.add_bos = true;
    }
  }
}

void parse_tokenizer_config(const json& config, const std::filesystem::path& dir,
                            tokenizer_spec& spec) {
  if (!config.is_object()) throw std::invalid_argument("the top level is not an object");
  if (const auto it = config.find("added_tokens_decoder"); it != config.end() && it->is_object()) {
    for (const auto& [key, value] : it->items()) {
      const int32_t id = std::stoi(key);
      const bool known = std::any_of(spec.added.begin(), spec.added.end(),
                                     [&](const auto& a) { return a.id == id; });
      if (known) continue;
      spec.added.push_back(parse_added(value, id));
    }
  }
  if (const auto bos = token_name(config, "bos_token")) {
    const auto id = resolve_token(spec, *bos);
    if (!id) throw std::invalid_argument("bos_token '" + *bos + "' is not in the vocab");
    spec.bos_id = id;
  } else if (config.contains("bos_token")) {
    spec.bos_id.reset();  // explicitly null
    spec.add_bos = false;
  }
  if (const auto eos = token_name(config, "eos_token")) {
    const auto id = resolve_token(spec, *eos);
    if (!id) throw std::invalid_argument("eos_token '" + *eos + "' is not in the vocab");
    spec.eos_id = id;
  }
  if (const auto it = config.find("add_bos_token"); it != config.end() && it->is_boolean()) {
    spec.add_bos = it->get<bool>();
  }
  if (spec.add_bos && !spec.bos_id) {
    throw std::invalid_argument("add_bos_token is true but there is no bos_token");
  }
  if (const auto it = config.find("chat_template"); it != config.end()) {
    if (it->is_string()) {
      spec.chat_template = it->get<std::string>();
    } else if (it->is_array()) {
      for (const json& t : *it) {
        if (t.value("name", std::string()) == "default" || spec.chat_template.empty()) {
          spec.chat_template = t.at("template").get<std::string>();
        }
      }
    }
  }
  if (spec.chat_template.empty()) {
    const auto jinja = dir / "chat_template.jinja";
    if (std::filesystem::is_regular_file(jinja)) {
      std::ifstream in(jinja, std::ios::binary);
      std::ostringstream buf;
      buf << in.rdbuf();
      spec.chat_template = buf.str();
    }
  }
}

}  // namespace

tokenizer_spec load_tokenizer_json(const std::filesystem::path& dir_or_file) {
  std::filesystem::path file = dir_or_file;
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec)) file /= "tokenizer.json";
  if (!std::filesystem::is_regular_file(file, ec)) fail(file, "no such file");

  tokenizer_spec spec;
  {
    const json root = read_json(file);
    try {
      parse_tokenizer_json(root, spec);
    } catch (const json::exception& e) {
      fail(file, std::string("unexpected structure: ") + e.what());
    } catch (const std::invalid_argument& e) {
      fail(file, e.what());
    }
  }

  const std::filesystem::path dir = file.parent_path();
  const std::filesystem::path config_file = dir / "tokenizer_config.json";
  if (std::filesystem::is_regular_file(config_file, ec)) {
    const json config = read_json(config_file);
    try {
      parse_tokenizer_config(config, dir, spec);
    } catch (const json::exception& e) {
      fail(config_file, std::string("unexpected structure: ") + e.what());
    } catch (const std::exception& e) {
      fail(config_file, e.what());
    }
  }
  return spec;
}

}  // namespace duet
