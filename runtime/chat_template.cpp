// Jinja chat templates: lexer -> parser -> tree -> evaluator. The behaviour to match is
// Jinja2 3.1 as HF transformers configures it (ImmutableSandboxedEnvironment, trim_blocks,
// lstrip_blocks, loopcontrols, its own tojson/raise_exception/namespace/strftime_now), and the
// Python semantics underneath it (str(), repr(), json.dumps, str methods, ==, <, in). Values
// are nlohmann::ordered_json (shared, never mutated) plus namespaces, loop objects and
// callables. docs/chat-templates.md lists what is supported.
#include "runtime/chat_template.hpp"

#include <utf8proc.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

namespace duet {

chat_template_syntax_error::chat_template_syntax_error(const std::string& message, int line,
                                                       int column)
    : std::runtime_error("line " + std::to_string(line) + ", column " + std::to_string(column) +
                         ": " + message),
      line_(line),
      column_(column) {}

chat_template_render_error::chat_template_render_error(const std::string& message, int line)
    : std::runtime_error("line " + std::to_string(line) + ": " + message), line_(line) {}

namespace {

using json = nlohmann::ordered_json;

// ---------------------------------------------------------------------------------------------
// UTF-8 and Python's character classes
// ---------------------------------------------------------------------------------------------

// Decodes one code point at s[i], advancing i. A byte that does not start a valid sequence
// decodes to U+DC80..U+DCFF (Python's surrogateescape) so that encoding gives the bytes back.
char32_t next_cp(std::string_view s, std::size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  int len = 0;
  char32_t cp = 0;
  if ((b0 & 0xE0) == 0xC0) {
    len = 2;
    cp = b0 & 0x1F;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3;
    cp = b0 & 0x0F;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4;
    cp = b0 & 0x07;
  }
  if (len == 0 || i + len > s.size()) {
    ++i;
    return 0xDC00 + b0;
  }
  for (int k = 1; k < len; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) {
      ++i;
      return 0xDC00 + b0;
    }
    cp = (cp << 6) | (b & 0x3F);
  }
  const bool overlong =
      (len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000);
  if (overlong || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
    ++i;
    return 0xDC00 + b0;
  }
  i += len;
  return cp;
}

void append_cp(std::string& out, char32_t cp) {
  if (cp >= 0xDC80 && cp <= 0xDCFF) {  // an undecodable byte, given back as it was
    out.push_back(static_cast<char>(cp - 0xDC00));
    return;
  }
  utf8proc_uint8_t buf[4];
  const auto n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), buf);
  out.append(reinterpret_cast<const char*>(buf), static_cast<std::size_t>(n));
}

std::u32string decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) out.push_back(next_cp(s, i));
  return out;
}

std::string encode(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t cp : s) append_cp(out, cp);
  return out;
}

std::size_t cp_count(std::string_view s) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < s.size();) {
    next_cp(s, i);
    ++n;
  }
  return n;
}

bool valid_cp(char32_t cp) {
  return cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
}

utf8proc_category_t category(char32_t cp) {
  if (!valid_cp(cp)) return UTF8PROC_CATEGORY_CS;
  return utf8proc_category(static_cast<utf8proc_int32_t>(cp));
}

// str.isspace(): bidirectional class WS, B or S, or category Zs (also Python's re \s).
bool py_isspace(char32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x1F);
  if (!valid_cp(cp)) return false;
  const auto* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(cp));
  return p->category == UTF8PROC_CATEGORY_ZS || p->bidi_class == UTF8PROC_BIDI_CLASS_WS ||
         p->bidi_class == UTF8PROC_BIDI_CLASS_B || p->bidi_class == UTF8PROC_BIDI_CLASS_S;
}

// str.isprintable() for one character.
bool py_isprintable(char32_t cp) {
  if (cp == ' ') return true;
  switch (category(cp)) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS:
      return false;
    default:
      return true;
  }
}

bool is_letter(char32_t cp) {
  const auto c = category(cp);
  return c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LL || c == UTF8PROC_CATEGORY_LT ||
         c == UTF8PROC_CATEGORY_LM || c == UTF8PROC_CATEGORY_LO;
}

bool is_cased(char32_t cp) {
  const auto c = category(cp);
  return c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LL || c == UTF8PROC_CATEGORY_LT;
}

bool is_digit(char32_t cp) {
  return category(cp) == UTF8PROC_CATEGORY_ND;
}

char32_t to_upper(char32_t cp) {
  return valid_cp(cp) ? static_cast<char32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(cp)))
                      : cp;
}
char32_t to_lower(char32_t cp) {
  return valid_cp(cp) ? static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp)))
                      : cp;
}
char32_t to_title(char32_t cp) {
  return valid_cp(cp) ? static_cast<char32_t>(utf8proc_totitle(static_cast<utf8proc_int32_t>(cp)))
                      : cp;
}

std::string map_cps(std::string_view s, char32_t (*f)(char32_t)) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) append_cp(out, f(next_cp(s, i)));
  return out;
}

// str.upper(): utf8proc's simple mappings plus the one full mapping common in chat text,
// German sharp s to "SS".
std::string py_upper(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const char32_t cp = next_cp(s, i);
    if (cp == 0xDF) {
      out += "SS";
    } else {
      append_cp(out, to_upper(cp));
    }
  }
  return out;
}

// str.title(): a cased character after an uncased one starts a word.
std::string py_title(std::string_view s) {
  std::string out;
  bool prev_cased = false;
  for (std::size_t i = 0; i < s.size();) {
    const char32_t cp = next_cp(s, i);
    append_cp(out, prev_cased ? to_lower(cp) : to_title(cp));
    prev_cased = is_cased(cp);
  }
  return out;
}

// str.capitalize(): first character title-cased, the rest lower-cased.
std::string py_capitalize(std::string_view s) {
  std::string out;
  bool first = true;
  for (std::size_t i = 0; i < s.size();) {
    const char32_t cp = next_cp(s, i);
    append_cp(out, first ? to_title(cp) : to_lower(cp));
    first = false;
  }
  return out;
}

// The byte offset where the code point that ends at `end` starts (as next_cp decodes it).
std::size_t prev_cp_start(std::string_view s, std::size_t end) {
  std::size_t i = end - 1;
  for (int back = 0; i > 0 && back < 3 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80; ++back)
    --i;
  std::size_t j = i;
  next_cp(s, j);
  return j == end ? i : end - 1;
}

// str.strip / lstrip / rstrip: with chars absent, Python whitespace. Works on the UTF-8 bytes,
// decoding only the characters at the edges.
std::string py_strip(std::string_view s, const std::optional<std::u32string>& chars, bool left,
                     bool right) {
  auto strip_it = [&](char32_t cp) {
    return chars ? chars->find(cp) != std::u32string::npos : py_isspace(cp);
  };
  std::size_t b = 0;
  std::size_t e = s.size();
  while (left && b < e) {
    std::size_t next = b;
    if (!strip_it(next_cp(s, next))) break;
    b = next;
  }
  while (right && e > b) {
    const std::size_t start = prev_cp_start(s, e);
    std::size_t next = start;
    if (!strip_it(next_cp(s, next))) break;
    e = start;
  }
  return std::string(s.substr(b, e - b));
}

// Python's str.splitlines() line boundaries.
bool is_line_break(char32_t cp) {
  return cp == '\n' || cp == '\r' || cp == 0x0B || cp == 0x0C || cp == 0x1C || cp == 0x1D ||
         cp == 0x1E || cp == 0x85 || cp == 0x2028 || cp == 0x2029;
}

std::vector<std::string> py_splitlines(std::string_view s, bool keepends) {
  const std::u32string cps = decode(s);
  std::vector<std::string> lines;
  std::size_t start = 0;
  for (std::size_t i = 0; i < cps.size();) {
    if (!is_line_break(cps[i])) {
      ++i;
      continue;
    }
    std::size_t end = i + 1;
    if (cps[i] == '\r' && end < cps.size() && cps[end] == '\n') ++end;
    lines.push_back(encode(std::u32string_view(cps).substr(start, (keepends ? end : i) - start)));
    start = i = end;
  }
  if (start < cps.size()) lines.push_back(encode(std::u32string_view(cps).substr(start)));
  return lines;
}

std::string py_replace(std::string_view s, std::string_view old, std::string_view repl,
                       int64_t count) {
  std::string out;
  if (old.empty()) {  // Python inserts repl before every character and at the end
    const std::u32string cps = decode(s);
    int64_t done = 0;
    for (char32_t cp : cps) {
      if (count < 0 || done < count) {
        out.append(repl);
        ++done;
      }
      append_cp(out, cp);
    }
    if (count < 0 || done < count) out.append(repl);
    return out;
  }
  std::size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const std::size_t hit = s.find(old, pos);
    if (hit == std::string_view::npos) break;
    out.append(s.substr(pos, hit - pos));
    out.append(repl);
    pos = hit + old.size();
    ++done;
  }
  out.append(s.substr(pos));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Values
// ---------------------------------------------------------------------------------------------

struct value;
struct call_args;
struct object_ns;

/// A callable: a global (range, namespace, ...), a bound method, a macro, loop.cycle.
struct function {
  std::string name;
  std::function<value(call_args&)> impl;
};

enum class vkind : uint8_t { undefined, json, ns, function };

/// What a template expression evaluates to. JSON values are shared and never mutated: `j`
/// points into the tree that `owner` keeps alive (the caller's context, or a computed value).
struct value {
  vkind kind = vkind::undefined;
  std::shared_ptr<const json> owner;
  const json* j = nullptr;
  std::shared_ptr<object_ns> ns;
  std::shared_ptr<const function> fn;
  std::string hint;  // for undefined: why, as Jinja words it ("'x' is undefined")

  static value undefined(std::string why) {
    value v;
    v.hint = std::move(why);
    return v;
  }
  static value of(json x) {
    value v;
    v.kind = vkind::json;
    v.owner = std::make_shared<const json>(std::move(x));
    v.j = v.owner.get();
    return v;
  }
  static value ref(std::shared_ptr<const json> owner, const json* at) {
    value v;
    v.kind = vkind::json;
    v.owner = std::move(owner);
    v.j = at;
    return v;
  }
  static value of_ns(std::shared_ptr<object_ns> n) {
    value v;
    v.kind = vkind::ns;
    v.ns = std::move(n);
    return v;
  }
  static value of_fn(std::string name, std::function<value(call_args&)> impl) {
    value v;
    v.kind = vkind::function;
    v.fn = std::make_shared<const function>(function{std::move(name), std::move(impl)});
    return v;
  }
  // A part of this JSON value, sharing its owner.
  [[nodiscard]] value child(const json* at) const { return ref(owner, at); }

  [[nodiscard]] bool is_undefined() const { return kind == vkind::undefined; }
  [[nodiscard]] bool is_json() const { return kind == vkind::json; }
  [[nodiscard]] bool is_string() const { return is_json() && j->is_string(); }
  [[nodiscard]] bool is_array() const { return is_json() && j->is_array(); }
  [[nodiscard]] bool is_object() const { return is_json() && j->is_object(); }
  [[nodiscard]] bool is_none() const { return is_json() && j->is_null(); }
  [[nodiscard]] bool is_bool() const { return is_json() && j->is_boolean(); }
  // Python's int includes bool.
  [[nodiscard]] bool is_int() const {
    return is_json() && (j->is_number_integer() || j->is_boolean());
  }
  [[nodiscard]] bool is_number() const { return is_json() && (j->is_number() || j->is_boolean()); }
  [[nodiscard]] const std::string& str() const { return j->get_ref<const std::string&>(); }
};

/// A Jinja namespace() or a loop object: named attributes, shared by reference.
struct object_ns {
  bool is_loop = false;
  std::vector<std::pair<std::string, value>> attrs;
  // A loop object computes its attributes when read: position and the loop's items.
  int64_t loop_index0 = 0;
  std::shared_ptr<const std::vector<value>> loop_items;

  value* find(std::string_view name) {
    for (auto& [k, v] : attrs)
      if (k == name) return &v;
    return nullptr;
  }
  void set(const std::string& name, value v) {
    if (value* slot = find(name)) {
      *slot = std::move(v);
    } else {
      attrs.emplace_back(name, std::move(v));
    }
  }
};

struct call_args {
  std::vector<value> pos;
  std::vector<std::pair<std::string, value>> kw;
  int line = 0;

  // Argument `index` by position or `name` by keyword; nullptr when absent.
  [[nodiscard]] const value* get(std::size_t index, std::string_view name) const {
    if (index < pos.size()) return &pos[index];
    for (const auto& [k, v] : kw)
      if (k == name) return &v;
    return nullptr;
  }
};

int64_t as_int(const value& v) {
  if (v.j->is_boolean()) return v.j->get<bool>() ? 1 : 0;
  if (v.j->is_number_unsigned()) {
    const auto u = v.j->get<uint64_t>();
    return u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
               ? std::numeric_limits<int64_t>::max()
               : static_cast<int64_t>(u);
  }
  return v.j->get<int64_t>();
}

double as_float(const value& v) {
  if (v.j->is_boolean()) return v.j->get<bool>() ? 1.0 : 0.0;
  return v.j->get<double>();
}

bool truthy(const value& v) {
  switch (v.kind) {
    case vkind::undefined:
      return false;
    case vkind::ns:
    case vkind::function:
      return true;
    case vkind::json:
      break;
  }
  const json& j = *v.j;
  switch (j.type()) {
    case json::value_t::null:
      return false;
    case json::value_t::boolean:
      return j.get<bool>();
    case json::value_t::number_integer:
      return j.get<int64_t>() != 0;
    case json::value_t::number_unsigned:
      return j.get<uint64_t>() != 0;
    case json::value_t::number_float:
      return j.get<double>() != 0.0;
    case json::value_t::string:
      return !j.get_ref<const std::string&>().empty();
    case json::value_t::array:
    case json::value_t::object:
      return !j.empty();
    default:
      return true;
  }
}

std::string type_name(const value& v) {
  switch (v.kind) {
    case vkind::undefined:
      return "Undefined";
    case vkind::ns:
      return v.ns->is_loop ? "LoopContext" : "Namespace";
    case vkind::function:
      return "function";
    case vkind::json:
      break;
  }
  switch (v.j->type()) {
    case json::value_t::null:
      return "NoneType";
    case json::value_t::boolean:
      return "bool";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "int";
    case json::value_t::number_float:
      return "float";
    case json::value_t::string:
      return "str";
    case json::value_t::array:
      return "list";
    case json::value_t::object:
      return "dict";
    default:
      return "object";
  }
}

// ---------------------------------------------------------------------------------------------
// Python's text forms: float repr, str(), repr(), json.dumps
// ---------------------------------------------------------------------------------------------

// float.__repr__: the shortest digits that round-trip; fixed notation for exponents -4..15.
std::string py_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<std::size_t>(res.ptr - buf));
  std::string out;
  if (sci.front() == '-') {
    out.push_back('-');
    sci.remove_prefix(1);
  }
  const std::size_t e_pos = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e_pos))
    if (c != '.') digits.push_back(c);
  int exp = 0;
  std::from_chars(sci.data() + e_pos + 1 + (sci[e_pos + 1] == '+' ? 1 : 0), sci.data() + sci.size(),
                  exp);
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      const std::size_t int_len = static_cast<std::size_t>(exp) + 1;
      std::string int_part = digits.substr(0, std::min(int_len, digits.size()));
      int_part.append(int_len > digits.size() ? int_len - digits.size() : 0, '0');
      const std::string frac = digits.size() > int_len ? digits.substr(int_len) : "0";
      out += int_part + "." + frac;
    } else {
      out += "0." + std::string(static_cast<std::size_t>(-exp - 1), '0') + digits;
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += exp < 0 ? "e-" : "e+";
    const std::string e = std::to_string(std::abs(exp));
    out += (e.size() < 2 ? "0" : "") + e;
  }
  return out;
}

void append_hex_escape(std::string& out, char32_t cp) {
  char buf[16];
  if (cp < 0x100) {
    std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(cp));
  } else if (cp < 0x10000) {
    std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(cp));
  } else {
    std::snprintf(buf, sizeof buf, "\\U%08x", static_cast<unsigned>(cp));
  }
  out += buf;
}

// str.__repr__.
void py_repr_str(std::string& out, std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  out.push_back(quote);
  for (std::size_t i = 0; i < s.size();) {
    const char32_t cp = next_cp(s, i);
    if (cp == static_cast<char32_t>(quote) || cp == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(cp));
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp < 0x20 || cp == 0x7F || (cp >= 0x80 && !py_isprintable(cp))) {
      append_hex_escape(out, cp);
    } else {
      append_cp(out, cp);
    }
  }
  out.push_back(quote);
}

void py_repr(std::string& out, const json& j);

// str() of a JSON value as Python would print the equivalent object.
void py_str(std::string& out, const json& j) {
  switch (j.type()) {
    case json::value_t::null:
      out += "None";
      return;
    case json::value_t::boolean:
      out += j.get<bool>() ? "True" : "False";
      return;
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      out += j.dump();
      return;
    case json::value_t::number_float:
      out += py_float_repr(j.get<double>());
      return;
    case json::value_t::string:
      out += j.get_ref<const std::string&>();
      return;
    case json::value_t::array: {
      out.push_back('[');
      bool first = true;
      for (const auto& e : j) {
        if (!first) out += ", ";
        first = false;
        py_repr(out, e);
      }
      out.push_back(']');
      return;
    }
    case json::value_t::object: {
      out.push_back('{');
      bool first = true;
      for (const auto& [k, e] : j.items()) {
        if (!first) out += ", ";
        first = false;
        py_repr_str(out, k);
        out += ": ";
        py_repr(out, e);
      }
      out.push_back('}');
      return;
    }
    default:
      out += j.dump();
  }
}

void py_repr(std::string& out, const json& j) {
  if (j.is_string()) {
    py_repr_str(out, j.get_ref<const std::string&>());
  } else {
    py_str(out, j);
  }
}

std::string to_str(const value& v);

std::string ns_repr(const object_ns& n) {
  if (n.is_loop)
    return "<LoopContext " + std::to_string(n.loop_index0 + 1) + "/" +
           std::to_string(n.loop_items->size()) + ">";
  std::string out = "<Namespace {";
  bool first = true;
  for (const auto& [k, v] : n.attrs) {
    if (!first) out += ", ";
    first = false;
    py_repr_str(out, k);
    out += ": ";
    if (v.is_json()) {
      py_repr(out, *v.j);
    } else {
      out += to_str(v);
    }
  }
  return out + "}>";
}

std::string to_str(const value& v) {
  switch (v.kind) {
    case vkind::undefined:
      return {};
    case vkind::ns:
      return ns_repr(*v.ns);
    case vkind::function:
      return "<function " + v.fn->name + ">";
    case vkind::json:
      break;
  }
  if (v.j->is_string()) return v.str();
  std::string out;
  py_str(out, *v.j);
  return out;
}

struct dump_options {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // None: one line
  std::string item_sep = ", ";
  std::string key_sep = ": ";
  bool sort_keys = false;
};

void json_escape(std::string& out, std::string_view s, bool ensure_ascii) {
  out.push_back('"');
  char buf[16];
  for (std::size_t i = 0; i < s.size();) {
    const char32_t cp = next_cp(s, i);
    switch (cp) {
      case '"':
        out += "\\\"";
        continue;
      case '\\':
        out += "\\\\";
        continue;
      case '\n':
        out += "\\n";
        continue;
      case '\r':
        out += "\\r";
        continue;
      case '\t':
        out += "\\t";
        continue;
      case '\b':
        out += "\\b";
        continue;
      case '\f':
        out += "\\f";
        continue;
      default:
        break;
    }
    if (cp < 0x20 || (ensure_ascii && cp >= 0x7F)) {
      if (cp >= 0x10000) {
        const char32_t v = cp - 0x10000;
        std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", static_cast<unsigned>(0xD800 + (v >> 10)),
                      static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
      } else {
        std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(cp));
      }
      out += buf;
    } else {
      append_cp(out, cp);
    }
  }
  out.push_back('"');
}

// json.dumps(x, ensure_ascii, indent, separators, sort_keys) as Python writes it.
void json_dump(std::string& out, const json& j, const dump_options& o, int depth) {
  auto newline = [&](int d) {
    out.push_back('\n');
    for (int k = 0; k < d; ++k) out += *o.indent;
  };
  switch (j.type()) {
    case json::value_t::null:
      out += "null";
      return;
    case json::value_t::boolean:
      out += j.get<bool>() ? "true" : "false";
      return;
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      out += j.dump();
      return;
    case json::value_t::number_float: {
      const double d = j.get<double>();
      if (std::isnan(d)) {
        out += "NaN";
      } else if (std::isinf(d)) {
        out += d < 0 ? "-Infinity" : "Infinity";
      } else {
        out += py_float_repr(d);
      }
      return;
    }
    case json::value_t::string:
      json_escape(out, j.get_ref<const std::string&>(), o.ensure_ascii);
      return;
    case json::value_t::array: {
      if (j.empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      bool first = true;
      for (const auto& e : j) {
        if (!first) out += o.item_sep;
        first = false;
        if (o.indent) newline(depth + 1);
        json_dump(out, e, o, depth + 1);
      }
      if (o.indent) newline(depth);
      out.push_back(']');
      return;
    }
    case json::value_t::object: {
      if (j.empty()) {
        out += "{}";
        return;
      }
      std::vector<std::pair<const std::string*, const json*>> items;
      for (const auto& [k, e] : j.items()) items.emplace_back(&k, &e);
      if (o.sort_keys) {
        std::stable_sort(items.begin(), items.end(),
                         [](const auto& a, const auto& b) { return *a.first < *b.first; });
      }
      out.push_back('{');
      bool first = true;
      for (const auto& [k, e] : items) {
        if (!first) out += o.item_sep;
        first = false;
        if (o.indent) newline(depth + 1);
        json_escape(out, *k, o.ensure_ascii);
        out += o.key_sep;
        json_dump(out, *e, o, depth + 1);
      }
      if (o.indent) newline(depth);
      out.push_back('}');
      return;
    }
    default:
      out += j.dump();
  }
}

// Python ==, for JSON values (int, float and bool compare as numbers).
bool py_eq(const json& a, const json& b) {
  const bool an = a.is_number() || a.is_boolean();
  const bool bn = b.is_number() || b.is_boolean();
  if (an && bn) {
    if (a.is_number_float() || b.is_number_float()) {
      const double x = a.is_boolean() ? (a.get<bool>() ? 1.0 : 0.0) : a.get<double>();
      const double y = b.is_boolean() ? (b.get<bool>() ? 1.0 : 0.0) : b.get<double>();
      return x == y;
    }
    if (a.is_number_unsigned() && b.is_number_unsigned())
      return a.get<uint64_t>() == b.get<uint64_t>();
    const int64_t x = a.is_boolean() ? (a.get<bool>() ? 1 : 0) : a.get<int64_t>();
    const int64_t y = b.is_boolean() ? (b.get<bool>() ? 1 : 0) : b.get<int64_t>();
    return x == y;
  }
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case json::value_t::null:
      return true;
    case json::value_t::string:
      return a.get_ref<const std::string&>() == b.get_ref<const std::string&>();
    case json::value_t::array: {
      if (a.size() != b.size()) return false;
      for (std::size_t i = 0; i < a.size(); ++i)
        if (!py_eq(a[i], b[i])) return false;
      return true;
    }
    case json::value_t::object: {
      if (a.size() != b.size()) return false;
      for (const auto& [k, e] : a.items()) {
        const auto it = b.find(k);
        if (it == b.end() || !py_eq(e, *it)) return false;
      }
      return true;
    }
    default:
      return a == b;
  }
}

bool value_eq(const value& a, const value& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case vkind::undefined:
      return true;
    case vkind::ns:
      return a.ns == b.ns;
    case vkind::function:
      return a.fn == b.fn;
    case vkind::json:
      return py_eq(*a.j, *b.j);
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// Lexer: Jinja2's, with trim_blocks and lstrip_blocks on (whitespace control happens here, on
// the template data around the tags, exactly as jinja2/lexer.py does it)
// ---------------------------------------------------------------------------------------------

enum class tok : uint8_t {
  data,
  var_begin,
  var_end,
  block_begin,
  block_end,
  name,
  string,
  integer,
  floating,
  op,
  eof
};

struct token {
  tok type;
  std::string text;  // data, name, operator; a string literal already decoded
  int64_t ival = 0;
  double fval = 0;
  int line = 1;
  int column = 1;
};

std::string describe(const token& t) {
  switch (t.type) {
    case tok::data:
      return "template data";
    case tok::var_begin:
      return "begin of print statement";
    case tok::var_end:
      return "end of print statement";
    case tok::block_begin:
      return "begin of statement block";
    case tok::block_end:
      return "end of statement block";
    case tok::string:
      return "string";
    case tok::integer:
      return "integer";
    case tok::floating:
      return "float";
    case tok::eof:
      return "end of template";
    default:
      return "'" + t.text + "'";
  }
}

class lexer {
 public:
  explicit lexer(std::string_view source) {
    // Newlines become \n and one trailing newline goes (keep_trailing_newline=False).
    src_.reserve(source.size());
    for (std::size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_.push_back('\n');
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_.push_back(source[i]);
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    line_starts_.push_back(0);
    for (std::size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  std::vector<token> run() {
    bool line_starting = true;
    while (pos_ < src_.size()) {
      const std::size_t tag = find_tag_start(pos_);
      if (tag == std::string::npos) {
        push(tok::data, pos_, src_.substr(pos_));
        break;
      }
      const char kind = src_[tag + 1];
      std::size_t after = tag + 2;
      char sign = 0;
      if (after < src_.size() && (src_[after] == '-' || src_[after] == '+')) sign = src_[after++];
      std::string text = src_.substr(pos_, tag - pos_);
      strip_before_tag(text, sign, kind != '{', line_starting);
      if (!text.empty()) push(tok::data, pos_, std::move(text));

      std::size_t raw_end = 0;
      if (kind == '%' && match_raw_begin(after, raw_end)) {
        line_starting = src_[raw_end - 1] == '\n';
        pos_ = raw_end;
        lex_raw_body(tag, line_starting);
      } else if (kind == '#') {
        lex_comment(tag, after, line_starting);
      } else {
        push(kind == '{' ? tok::var_begin : tok::block_begin, tag, src_.substr(tag, after - tag));
        pos_ = after;
        lex_tag(tag, kind == '%', line_starting);
      }
    }
    token end{tok::eof, {}};
    std::tie(end.line, end.column) = where(src_.size());
    tokens_.push_back(std::move(end));
    return std::move(tokens_);
  }

 private:
  std::string src_;
  std::vector<std::size_t> line_starts_;
  std::size_t pos_ = 0;
  std::vector<token> tokens_;
  mutable int where_line_ = 0;
  mutable std::size_t where_offset_ = 0;
  mutable std::size_t where_column_ = 1;

  // Line and column (in characters) of an offset. Tokens arrive in order, so the column is
  // counted on from the previous position when it lies on the same line.
  std::pair<int, int> where(std::size_t offset) const {
    const auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
    const std::size_t line_start = *(it - 1);
    const auto line = static_cast<int>(it - line_starts_.begin());
    std::size_t from = line_start;
    std::size_t column = 1;
    if (line == where_line_ && offset >= where_offset_) {
      from = where_offset_;
      column = where_column_;
    }
    column += cp_count(std::string_view(src_).substr(from, offset - from));
    where_line_ = line;
    where_offset_ = offset;
    where_column_ = column;
    return {line, static_cast<int>(column)};
  }

  [[noreturn]] void fail(const std::string& message, std::size_t offset) const {
    const auto [line, column] = where(offset);
    throw chat_template_syntax_error(message, line, column);
  }

  void push(tok type, std::size_t offset, std::string text) {
    token t{type, std::move(text)};
    std::tie(t.line, t.column) = where(offset);
    tokens_.push_back(std::move(t));
  }

  std::size_t find_tag_start(std::size_t from) const {
    for (std::size_t i = src_.find('{', from); i != std::string::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#'))
        return i;
    }
    return std::string::npos;
  }

  bool space_at(std::size_t i, std::size_t* next = nullptr) const {
    if (i >= src_.size()) return false;
    std::size_t j = i;
    const char32_t cp = next_cp(src_, j);
    if (!py_isspace(cp)) return false;
    if (next) *next = j;
    return true;
  }

  std::size_t skip_space(std::size_t i) const {
    std::size_t next = 0;
    while (space_at(i, &next)) i = next;
    return i;
  }

  bool all_space(std::string_view s) const {
    for (std::size_t i = 0; i < s.size();)
      if (!py_isspace(next_cp(s, i))) return false;
    return true;
  }

  // "-" strips all whitespace before the tag; otherwise lstrip_blocks removes the spaces and
  // tabs between the start of the line and a block or comment tag.
  void strip_before_tag(std::string& text, char sign, bool block_or_comment,
                        bool line_starting) const {
    if (sign == '-') {
      text = py_strip(text, std::nullopt, false, true);
    } else if (sign != '+' && block_or_comment) {
      const std::size_t nl = text.rfind('\n');
      const std::size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting) && l_pos < text.size() &&
          all_space(std::string_view(text).substr(l_pos)))
        text.resize(l_pos);
    }
  }

  // The end of a block tag at i: "+%}", "-%}" and the whitespace after it, or "%}" and one
  // newline (trim_blocks). Returns the offset after it, or npos.
  std::size_t block_end_at(std::size_t i) const {
    if (src_.compare(i, 3, "+%}") == 0) return i + 3;
    if (src_.compare(i, 3, "-%}") == 0) return skip_space(i + 3);
    if (src_.compare(i, 2, "%}") == 0)
      return i + 2 < src_.size() && src_[i + 2] == '\n' ? i + 3 : i + 2;
    return std::string::npos;
  }

  std::size_t var_end_at(std::size_t i) const {
    if (src_.compare(i, 3, "-}}") == 0) return skip_space(i + 3);
    if (src_.compare(i, 2, "}}") == 0) return i + 2;
    return std::string::npos;
  }

  bool word_at(std::size_t i, std::string_view word) const {
    return src_.compare(i, word.size(), word) == 0;
  }

  // "{% raw %}" (the "{%" and sign already read): "raw" between optional whitespace, then
  // "-%}" with the whitespace after it, or a bare "%}" (no trim_blocks newline here).
  bool match_raw_begin(std::size_t after, std::size_t& end) const {
    std::size_t i = skip_space(after);
    if (!word_at(i, "raw")) return false;
    i = skip_space(i + 3);
    if (word_at(i, "-%}")) {
      end = skip_space(i + 3);
      return true;
    }
    if (word_at(i, "%}")) {
      end = i + 2;
      return true;
    }
    return false;
  }

  void lex_raw_body(std::size_t tag, bool& line_starting) {
    for (std::size_t i = src_.find("{%", pos_); i != std::string::npos;
         i = src_.find("{%", i + 1)) {
      std::size_t j = i + 2;
      char sign = 0;
      if (j < src_.size() && (src_[j] == '-' || src_[j] == '+')) sign = src_[j++];
      j = skip_space(j);
      if (!word_at(j, "endraw")) continue;
      j = skip_space(j + 6);
      const std::size_t end = block_end_at(j);
      if (end == std::string::npos) continue;
      std::string text = src_.substr(pos_, i - pos_);
      strip_before_tag(text, sign, true, line_starting);
      if (!text.empty()) push(tok::data, pos_, std::move(text));
      pos_ = end;
      line_starting = src_[end - 1] == '\n';
      return;
    }
    fail("Missing end of raw directive", tag);
  }

  void lex_comment(std::size_t tag, std::size_t after, bool& line_starting) {
    for (std::size_t i = after; i < src_.size(); ++i) {
      std::size_t end = std::string::npos;
      if (word_at(i, "+#}")) {
        end = i + 3;
      } else if (word_at(i, "-#}")) {
        end = skip_space(i + 3);
      } else if (word_at(i, "#}")) {
        end = i + 2 < src_.size() && src_[i + 2] == '\n' ? i + 3 : i + 2;
      }
      if (end != std::string::npos) {
        pos_ = end;
        line_starting = src_[end - 1] == '\n';
        return;
      }
    }
    fail("Missing end of comment tag", tag);
  }

  // The inside of {{ }} or {% %}: expression tokens until the closing tag, which only counts
  // while no bracket is open (a dict literal's "}}" is two operators).
  void lex_tag(std::size_t tag, bool block, bool& line_starting) {
    std::vector<char> brackets;
    while (true) {
      if (pos_ >= src_.size())
        fail(block ? "unexpected end of template, expected '%}'"
                   : "unexpected end of template, expected '}}'",
             tag);
      if (brackets.empty()) {
        const std::size_t end = block ? block_end_at(pos_) : var_end_at(pos_);
        if (end != std::string::npos) {
          push(block ? tok::block_end : tok::var_end, pos_, src_.substr(pos_, end - pos_));
          line_starting = src_[end - 1] == '\n';
          pos_ = end;
          return;
        }
      }
      std::size_t next = 0;
      if (space_at(pos_, &next)) {
        pos_ = next;
        continue;
      }
      const char c = src_[pos_];
      if (c >= '0' && c <= '9') {
        lex_number();
      } else if (c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
        std::size_t e = pos_ + 1;
        while (e < src_.size() &&
               (src_[e] == '_' || std::isalnum(static_cast<unsigned char>(src_[e]))))
          ++e;
        push(tok::name, pos_, src_.substr(pos_, e - pos_));
        pos_ = e;
      } else if (c == '\'' || c == '"') {
        lex_string();
      } else {
        lex_operator(brackets);
      }
    }
  }

  // Digits with optional single underscores between them, at i; returns the end or i.
  std::size_t digits_at(std::size_t i) const {
    if (i >= src_.size() || !std::isdigit(static_cast<unsigned char>(src_[i]))) return i;
    std::size_t e = i + 1;
    while (e < src_.size()) {
      if (std::isdigit(static_cast<unsigned char>(src_[e]))) {
        ++e;
      } else if (src_[e] == '_' && e + 1 < src_.size() &&
                 std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
        e += 2;
      } else {
        break;
      }
    }
    return e;
  }

  static std::string without_underscores(std::string_view s) {
    std::string out;
    for (char c : s)
      if (c != '_') out.push_back(c);
    return out;
  }

  void lex_number() {
    const std::size_t start = pos_;
    // Float: digits then either [.digits] e[+-]digits, or .digits; never right after a '.'.
    const bool after_dot = start > 0 && src_[start - 1] == '.';
    const std::size_t int_end = digits_at(start);
    if (!after_dot) {
      std::size_t e = int_end;
      bool is_float = false;
      if (e < src_.size() && src_[e] == '.' && digits_at(e + 1) > e + 1) {
        e = digits_at(e + 1);
        is_float = true;
      }
      if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
        std::size_t x = e + 1;
        if (x < src_.size() && (src_[x] == '+' || src_[x] == '-')) ++x;
        if (digits_at(x) > x) {
          e = digits_at(x);
          is_float = true;
        }
      }
      if (is_float) {
        token t{tok::floating, src_.substr(start, e - start)};
        const std::string clean = without_underscores(t.text);
        t.fval = std::strtod(clean.c_str(), nullptr);
        std::tie(t.line, t.column) = where(start);
        tokens_.push_back(std::move(t));
        pos_ = e;
        return;
      }
    }
    int base = 10;
    std::size_t digits_start = start;
    std::size_t end = int_end;
    if (src_[start] == '0' && start + 1 < src_.size()) {
      const char p = static_cast<char>(std::tolower(static_cast<unsigned char>(src_[start + 1])));
      if (p == 'b' || p == 'o' || p == 'x') {
        base = p == 'b' ? 2 : p == 'o' ? 8 : 16;
        digits_start = start + 2;
        end = digits_start;
        while (end < src_.size() &&
               (src_[end] == '_' || std::isxdigit(static_cast<unsigned char>(src_[end]))))
          ++end;
      } else {
        // "0" followed by more zeros only; "012" lexes as 0 then 12, as in Jinja.
        end = start + 1;
        while (end + 1 < src_.size() && src_[end] == '_' && src_[end + 1] == '0') end += 2;
        while (end < src_.size() && src_[end] == '0') ++end;
      }
    }
    const std::string clean = without_underscores(src_.substr(digits_start, end - digits_start));
    token t{tok::integer, src_.substr(start, end - start)};
    const auto res = std::from_chars(clean.data(), clean.data() + clean.size(), t.ival, base);
    if (clean.empty() || res.ec != std::errc{} || res.ptr != clean.data() + clean.size())
      fail("invalid integer literal '" + t.text + "'", start);
    std::tie(t.line, t.column) = where(start);
    tokens_.push_back(std::move(t));
    pos_ = end;
  }

  // A string literal, decoded as Python's "unicode-escape" codec does.
  void lex_string() {
    const std::size_t start = pos_;
    const char quote = src_[pos_];
    std::string out;
    std::size_t i = pos_ + 1;
    while (true) {
      if (i >= src_.size()) fail("unterminated string literal", start);
      const char c = src_[i];
      if (c == quote) break;
      if (c != '\\') {
        out.push_back(c);
        ++i;
        continue;
      }
      if (i + 1 >= src_.size()) fail("unterminated string literal", start);
      const char e = src_[i + 1];
      i += 2;
      auto hex = [&](int n) {
        if (i + static_cast<std::size_t>(n) > src_.size())
          fail("truncated \\x, \\u or \\U escape", i - 2);
        uint32_t cp = 0;
        const auto res = std::from_chars(src_.data() + i, src_.data() + i + n, cp, 16);
        if (res.ptr != src_.data() + i + n) fail("truncated \\x, \\u or \\U escape", i - 2);
        i += static_cast<std::size_t>(n);
        if (cp > 0x10FFFF) fail("illegal Unicode character in escape", i - 2);
        append_cp(out, cp);
      };
      switch (e) {
        case '\n':
          break;  // line continuation
        case '\\':
        case '\'':
        case '"':
          out.push_back(e);
          break;
        case 'a':
          out.push_back('\a');
          break;
        case 'b':
          out.push_back('\b');
          break;
        case 'f':
          out.push_back('\f');
          break;
        case 'n':
          out.push_back('\n');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'v':
          out.push_back('\v');
          break;
        case 'x':
          hex(2);
          break;
        case 'u':
          hex(4);
          break;
        case 'U':
          hex(8);
          break;
        case 'N':
          fail("\\N{...} escapes are not supported", i - 2);
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && i < src_.size() && src_[i] >= '0' && src_[i] <= '7'; ++k)
              cp = cp * 8 + static_cast<uint32_t>(src_[i++] - '0');
            append_cp(out, cp);
          } else {  // unknown escapes keep their backslash
            out.push_back('\\');
            out.push_back(e);
          }
      }
    }
    token t{tok::string, std::move(out)};
    std::tie(t.line, t.column) = where(start);
    tokens_.push_back(std::move(t));
    pos_ = i + 1;
  }

  void lex_operator(std::vector<char>& brackets) {
    static constexpr std::string_view two[] = {"//", "**", "==", "!=", ">=", "<="};
    std::string_view op;
    for (std::string_view candidate : two) {
      if (word_at(pos_, candidate)) {
        op = candidate;
        break;
      }
    }
    if (op.empty()) {
      static constexpr std::string_view one = "+-*/%~[](){}><=.:|,;";
      if (one.find(src_[pos_]) == std::string_view::npos) {
        std::size_t j = pos_;
        std::string ch;
        append_cp(ch, next_cp(src_, j));
        fail("unexpected char '" + ch + "'", pos_);
      }
      op = std::string_view(src_).substr(pos_, 1);
    }
    if (op == "(" || op == "[" || op == "{") {
      brackets.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
    } else if (op == ")" || op == "]" || op == "}") {
      if (brackets.empty()) fail("unexpected '" + std::string(op) + "'", pos_);
      if (brackets.back() != op[0])
        fail("unexpected '" + std::string(op) + "', expected '" + std::string(1, brackets.back()) +
                 "'",
             pos_);
      brackets.pop_back();
    }
    push(tok::op, pos_, std::string(op));
    pos_ += op.size();
  }
};

// ---------------------------------------------------------------------------------------------
// Tree
// ---------------------------------------------------------------------------------------------

enum class ek : uint8_t {
  constant,
  name,
  list,
  tuple,
  dict,
  attr,    // args[0].name
  item,    // args[0][args[1]]
  slice,   // args[0][args[1]:args[2]:args[3]], absent parts null
  call,    // args[0](args[1..], kwargs)
  filter,  // args[0] | name(args[1..], kwargs); args[0] null in filter blocks
  test,    // args[0] is name(args[1..], kwargs)
  neg,
  pos,
  not_,
  binop,    // args[0] name args[1]
  concat,   // args joined with ~
  compare,  // args[0] ops[0] args[1] ops[1] args[2] ...
  and_,
  or_,
  cond  // args[0] if args[1] else args[2] (absent: undefined)
};

struct expr;
using expr_ptr = std::unique_ptr<expr>;

struct expr {
  ek kind;
  int line = 0;
  value constant;
  std::string name;
  std::vector<expr_ptr> args;
  std::vector<std::pair<std::string, expr_ptr>> kwargs;
  std::vector<std::string> ops;
  std::vector<expr_ptr> keys;  // dict keys; values are in args
};

enum class sk : uint8_t {
  text,
  output,
  if_,
  for_,
  set,
  set_attr,
  set_block,
  macro,
  filter_block,
  break_,
  continue_,
  generation
};

struct stmt;
using body = std::vector<std::unique_ptr<stmt>>;

struct stmt {
  sk kind;
  int line = 0;
  std::string text;                                      // text; set_attr namespace; macro name
  std::string attr;                                      // set_attr attribute
  std::vector<std::string> targets;                      // for and set targets
  expr_ptr e;                                            // output, set value, for iterable
  expr_ptr cond;                                         // for's filter
  std::vector<std::pair<expr_ptr, body>> branches;       // if / elif
  body inner;                                            // for, set_block, macro, filter_block
  body else_body;                                        // if, for
  std::vector<std::pair<std::string, expr_ptr>> params;  // macro parameters and defaults
  std::vector<expr_ptr> filters;  // set_block / filter_block: filter nodes with a null input
  // Names that start out undefined in the frame this statement opens (inner), and in a for
  // loop's else frame; see scope_analyzer.
  std::vector<std::string> fresh;
  std::vector<std::string> else_fresh;
};

// ---------------------------------------------------------------------------------------------
// Parser: Jinja2's grammar and precedence (jinja2/parser.py)
// ---------------------------------------------------------------------------------------------

class parser {
 public:
  explicit parser(std::vector<token> tokens) : toks_(std::move(tokens)) {}

  body parse_template() {
    body b = subparse({});
    if (cur().type != tok::eof) fail_at(cur(), "unexpected " + describe(cur()));
    return b;
  }

 private:
  std::vector<token> toks_;
  std::size_t i_ = 0;
  std::vector<std::string> open_blocks_;  // innermost last, for error messages
  int loop_depth_ = 0;
  // Expression and block nesting, bounded so that hostile input cannot exhaust the stack.
  int nesting_ = 0;
  static constexpr int max_nesting = 256;

  struct nesting_guard {
    parser& p;
    nesting_guard(parser& owner, const token& at) : p(owner) {
      if (++p.nesting_ > max_nesting) fail_at(at, "template nested too deeply");
    }
    ~nesting_guard() { --p.nesting_; }
  };

  const token& cur() const { return toks_[i_]; }
  const token& peek(std::size_t n = 1) const { return toks_[std::min(i_ + n, toks_.size() - 1)]; }
  const token& advance() { return toks_[i_ < toks_.size() - 1 ? i_++ : i_]; }

  [[noreturn]] static void fail_at(const token& t, const std::string& message) {
    throw chat_template_syntax_error(message, t.line, t.column);
  }

  bool is_op(std::string_view op) const { return cur().type == tok::op && cur().text == op; }
  bool is_name(std::string_view n) const { return cur().type == tok::name && cur().text == n; }
  bool skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    advance();
    return true;
  }
  bool skip_name(std::string_view n) {
    if (!is_name(n)) return false;
    advance();
    return true;
  }
  void expect_op(std::string_view op) {
    if (!skip_op(op))
      fail_at(cur(), "expected token '" + std::string(op) + "', got " + describe(cur()));
  }
  std::string expect_name() {
    if (cur().type != tok::name) fail_at(cur(), "expected token 'name', got " + describe(cur()));
    return advance().text;
  }
  void expect_block_end() {
    if (cur().type != tok::block_end)
      fail_at(cur(), "expected token 'end of statement block', got " + describe(cur()));
    advance();
  }

  static expr_ptr node(ek kind, int line) {
    auto e = std::make_unique<expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }
  static std::unique_ptr<stmt> snode(sk kind, int line) {
    auto s = std::make_unique<stmt>();
    s->kind = kind;
    s->line = line;
    return s;
  }

  // Statements until one of `ends` opens a block tag; stops on its name (after "{%").
  body subparse(std::initializer_list<std::string_view> ends) {
    body b;
    while (true) {
      const token& t = cur();
      if (t.type == tok::eof) {
        if (ends.size() == 0) return b;
        std::string wanted;
        for (std::string_view e : ends)
          wanted += (wanted.empty() ? "'" : " or '") + std::string(e) + "'";
        fail_at(t, "Unexpected end of template. Jinja was looking for the following tags: " +
                       wanted + ". The innermost block that needs to be closed is '" +
                       open_blocks_.back() + "'.");
      }
      if (t.type == tok::data) {
        auto s = snode(sk::text, t.line);
        s->text = t.text;
        advance();
        b.push_back(std::move(s));
      } else if (t.type == tok::var_begin) {
        advance();
        auto s = snode(sk::output, t.line);
        s->e = parse_tuple(true, false);
        if (cur().type != tok::var_end)
          fail_at(cur(), "expected token 'end of print statement', got " + describe(cur()));
        advance();
        b.push_back(std::move(s));
      } else if (t.type == tok::block_begin) {
        advance();
        if (cur().type != tok::name) fail_at(cur(), "tag name expected");
        for (std::string_view e : ends)
          if (cur().text == e) return b;
        b.push_back(parse_statement(ends));
      } else {
        fail_at(t, "unexpected " + describe(t));
      }
    }
  }

  std::unique_ptr<stmt> parse_statement(std::initializer_list<std::string_view> ends) {
    const token& t = cur();
    nesting_guard guard(*this, t);
    const std::string& name = t.text;
    if (name == "if") return parse_if();
    if (name == "for") return parse_for();
    if (name == "set") return parse_set();
    if (name == "macro") return parse_macro();
    if (name == "filter") return parse_filter_block();
    if (name == "generation") return parse_generation();
    if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) fail_at(t, "'" + name + "' can only appear in a loop");
      auto s = snode(name == "break" ? sk::break_ : sk::continue_, t.line);
      advance();
      expect_block_end();
      return s;
    }
    static constexpr std::string_view unsupported[] = {
        "call", "include", "import", "from", "extends", "block", "with", "autoescape", "do"};
    for (std::string_view u : unsupported)
      if (name == u) fail_at(t, "the '" + name + "' tag is not supported in chat templates");
    std::string message = "Encountered unknown tag '" + name + "'.";
    if (ends.size() > 0) {
      std::string wanted;
      for (std::string_view e : ends)
        wanted += (wanted.empty() ? "'" : " or '") + std::string(e) + "'";
      message += " Jinja was looking for the following tags: " + wanted +
                 ". The innermost block that needs to be closed is '" + open_blocks_.back() + "'.";
    }
    fail_at(t, message);
  }

  std::unique_ptr<stmt> parse_if() {
    auto s = snode(sk::if_, cur().line);
    advance();
    open_blocks_.push_back("if");
    while (true) {
      expr_ptr cond = parse_tuple(false, false);
      expect_block_end();
      body b = subparse({"elif", "else", "endif"});
      s->branches.emplace_back(std::move(cond), std::move(b));
      const std::string which = advance().text;
      if (which == "elif") continue;
      if (which == "else") {
        expect_block_end();
        s->else_body = subparse({"endif"});
        advance();
      }
      break;
    }
    expect_block_end();
    open_blocks_.pop_back();
    return s;
  }

  std::vector<std::string> parse_assign_targets() {
    std::vector<std::string> names;
    const bool paren = skip_op("(");
    names.push_back(expect_name());
    while (skip_op(",")) {
      if (cur().type != tok::name) break;
      names.push_back(expect_name());
    }
    if (paren) expect_op(")");
    for (const auto& n : names)
      if (n == "true" || n == "false" || n == "none" || n == "True" || n == "False" || n == "None")
        fail_at(cur(), "can't assign to '" + n + "'");
    return names;
  }

  std::unique_ptr<stmt> parse_for() {
    auto s = snode(sk::for_, cur().line);
    advance();
    open_blocks_.push_back("for");
    s->targets = parse_assign_targets();
    if (!skip_name("in")) fail_at(cur(), "expected token 'in', got " + describe(cur()));
    s->e = parse_tuple(false, false);
    if (skip_name("if")) s->cond = parse_expression(true);
    if (is_name("recursive")) fail_at(cur(), "recursive loops are not supported");
    expect_block_end();
    ++loop_depth_;
    s->inner = subparse({"endfor", "else"});
    --loop_depth_;
    if (advance().text == "else") {
      expect_block_end();
      s->else_body = subparse({"endfor"});
      advance();
    }
    expect_block_end();
    open_blocks_.pop_back();
    return s;
  }

  std::unique_ptr<stmt> parse_set() {
    const int line = cur().line;
    advance();
    if (cur().type == tok::name && peek().type == tok::op && peek().text == ".") {
      auto s = snode(sk::set_attr, line);
      s->text = advance().text;
      advance();
      s->attr = expect_name();
      expect_op("=");
      s->e = parse_tuple(true, false);
      expect_block_end();
      return s;
    }
    std::vector<std::string> targets = parse_assign_targets();
    if (skip_op("=")) {
      auto s = snode(sk::set, line);
      s->targets = std::move(targets);
      s->e = parse_tuple(true, false);
      expect_block_end();
      return s;
    }
    if (targets.size() != 1) fail_at(cur(), "a block set takes one name");
    auto s = snode(sk::set_block, line);
    s->targets = std::move(targets);
    while (is_op("|")) s->filters.push_back(parse_filter(nullptr));
    expect_block_end();
    open_blocks_.push_back("set");
    s->inner = subparse({"endset"});
    advance();
    expect_block_end();
    open_blocks_.pop_back();
    return s;
  }

  std::unique_ptr<stmt> parse_macro() {
    auto s = snode(sk::macro, cur().line);
    advance();
    s->text = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      if (!s->params.empty()) expect_op(",");
      if (is_op(")")) break;
      std::string pname = expect_name();
      expr_ptr def;
      if (skip_op("=")) def = parse_expression(true);
      s->params.emplace_back(std::move(pname), std::move(def));
    }
    expect_op(")");
    expect_block_end();
    open_blocks_.push_back("macro");
    const int saved_depth = loop_depth_;
    loop_depth_ = 0;
    s->inner = subparse({"endmacro"});
    loop_depth_ = saved_depth;
    advance();
    expect_block_end();
    open_blocks_.pop_back();
    return s;
  }

  std::unique_ptr<stmt> parse_filter_block() {
    auto s = snode(sk::filter_block, cur().line);
    advance();
    s->filters.push_back(parse_filter(nullptr, false));
    while (is_op("|")) s->filters.push_back(parse_filter(nullptr));
    expect_block_end();
    open_blocks_.push_back("filter");
    s->inner = subparse({"endfilter"});
    advance();
    expect_block_end();
    open_blocks_.pop_back();
    return s;
  }

  std::unique_ptr<stmt> parse_generation() {
    auto s = snode(sk::generation, cur().line);
    advance();
    expect_block_end();
    open_blocks_.push_back("generation");
    s->inner = subparse({"endgeneration"});
    advance();
    expect_block_end();
    open_blocks_.pop_back();
    return s;
  }

  // ---- expressions ----

  // An expression, or several separated by commas (a tuple). Parenthesised tuples are
  // handled in parse_primary.
  expr_ptr parse_tuple(bool with_condexpr, bool explicit_parens) {
    const int line = cur().line;
    std::vector<expr_ptr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) {
        if (!skip_op(",")) break;
        is_tuple = true;
      }
      if (tuple_ends()) break;
      items.push_back(parse_expression(with_condexpr));
    }
    if (!is_tuple) {
      if (items.empty()) {
        if (explicit_parens) return node(ek::tuple, line);
        fail_at(cur(), "Expected an expression, got " + describe(cur()));
      }
      return std::move(items.front());
    }
    auto t = node(ek::tuple, line);
    t->args = std::move(items);
    return t;
  }

  bool tuple_ends() const {
    const token& t = cur();
    if (t.type == tok::var_end || t.type == tok::block_end || t.type == tok::eof) return true;
    return t.type == tok::op && t.text == ")";
  }

  expr_ptr parse_expression(bool with_condexpr) {
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  expr_ptr parse_condexpr() {
    nesting_guard guard(*this, cur());
    expr_ptr e1 = parse_or();
    while (is_name("if")) {
      const int line = advance().line;
      expr_ptr cond = parse_or();
      expr_ptr e3;
      if (skip_name("else")) e3 = parse_condexpr();
      auto c = node(ek::cond, line);
      c->args.push_back(std::move(e1));
      c->args.push_back(std::move(cond));
      c->args.push_back(std::move(e3));
      e1 = std::move(c);
    }
    return e1;
  }

  expr_ptr parse_or() {
    expr_ptr left = parse_and();
    while (is_name("or")) {
      auto n = node(ek::or_, advance().line);
      n->args.push_back(std::move(left));
      n->args.push_back(parse_and());
      left = std::move(n);
    }
    return left;
  }

  expr_ptr parse_and() {
    expr_ptr left = parse_not();
    while (is_name("and")) {
      auto n = node(ek::and_, advance().line);
      n->args.push_back(std::move(left));
      n->args.push_back(parse_not());
      left = std::move(n);
    }
    return left;
  }

  expr_ptr parse_not() {
    nesting_guard guard(*this, cur());
    if (is_name("not")) {
      auto n = node(ek::not_, advance().line);
      n->args.push_back(parse_not());
      return n;
    }
    return parse_compare();
  }

  expr_ptr parse_compare() {
    const int line = cur().line;
    expr_ptr first = parse_math1();
    std::vector<std::string> ops;
    std::vector<expr_ptr> operands;
    while (true) {
      const token& t = cur();
      if (t.type == tok::op && (t.text == "==" || t.text == "!=" || t.text == "<" ||
                                t.text == ">" || t.text == "<=" || t.text == ">=")) {
        ops.push_back(advance().text);
      } else if (is_name("in")) {
        advance();
        ops.emplace_back("in");
      } else if (is_name("not") && peek().type == tok::name && peek().text == "in") {
        advance();
        advance();
        ops.emplace_back("notin");
      } else {
        break;
      }
      operands.push_back(parse_math1());
    }
    if (ops.empty()) return first;
    auto n = node(ek::compare, line);
    n->args.push_back(std::move(first));
    for (auto& o : operands) n->args.push_back(std::move(o));
    n->ops = std::move(ops);
    return n;
  }

  expr_ptr binop(std::string op, expr_ptr l, expr_ptr r, int line) {
    auto n = node(ek::binop, line);
    n->name = std::move(op);
    n->args.push_back(std::move(l));
    n->args.push_back(std::move(r));
    return n;
  }

  expr_ptr parse_math1() {
    expr_ptr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const token& t = advance();
      left = binop(t.text, std::move(left), parse_concat(), t.line);
    }
    return left;
  }

  expr_ptr parse_concat() {
    const int line = cur().line;
    expr_ptr first = parse_math2();
    if (!is_op("~")) return first;
    auto n = node(ek::concat, line);
    n->args.push_back(std::move(first));
    while (skip_op("~")) n->args.push_back(parse_math2());
    return n;
  }

  expr_ptr parse_math2() {
    expr_ptr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const token& t = advance();
      left = binop(t.text, std::move(left), parse_pow(), t.line);
    }
    return left;
  }

  expr_ptr parse_pow() {
    expr_ptr left = parse_unary(true);
    while (is_op("**")) {
      const token& t = advance();
      left = binop(t.text, std::move(left), parse_unary(true), t.line);
    }
    return left;
  }

  expr_ptr parse_unary(bool with_filter) {
    nesting_guard guard(*this, cur());
    expr_ptr n;
    if (is_op("-") || is_op("+")) {
      const token& t = advance();
      n = node(t.text == "-" ? ek::neg : ek::pos, t.line);
      n->args.push_back(parse_unary(false));
    } else {
      n = parse_primary();
    }
    n = parse_postfix(std::move(n));
    if (with_filter) n = parse_filter_expr(std::move(n));
    return n;
  }

  expr_ptr parse_primary() {
    const token& t = cur();
    if (t.type == tok::name) {
      advance();
      if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
        auto n = node(ek::constant, t.line);
        n->constant = value::of(json(t.text == "true" || t.text == "True"));
        return n;
      }
      if (t.text == "none" || t.text == "None") {
        auto n = node(ek::constant, t.line);
        n->constant = value::of(json(nullptr));
        return n;
      }
      auto n = node(ek::name, t.line);
      n->name = t.text;
      return n;
    }
    if (t.type == tok::string) {
      std::string s = advance().text;
      while (cur().type == tok::string) s += advance().text;  // adjacent literals concatenate
      auto n = node(ek::constant, t.line);
      n->constant = value::of(json(std::move(s)));
      return n;
    }
    if (t.type == tok::integer || t.type == tok::floating) {
      advance();
      auto n = node(ek::constant, t.line);
      n->constant = t.type == tok::integer ? value::of(json(t.ival)) : value::of(json(t.fval));
      return n;
    }
    if (is_op("(")) {
      advance();
      expr_ptr inner = parse_tuple(true, true);
      expect_op(")");
      return inner;
    }
    if (is_op("[")) {
      auto n = node(ek::list, advance().line);
      while (!is_op("]")) {
        if (!n->args.empty()) expect_op(",");
        if (is_op("]")) break;
        n->args.push_back(parse_expression(true));
      }
      expect_op("]");
      return n;
    }
    if (is_op("{")) {
      auto n = node(ek::dict, advance().line);
      while (!is_op("}")) {
        if (!n->args.empty()) expect_op(",");
        if (is_op("}")) break;
        n->keys.push_back(parse_expression(true));
        expect_op(":");
        n->args.push_back(parse_expression(true));
      }
      expect_op("}");
      return n;
    }
    fail_at(t, "unexpected " + describe(t));
  }

  expr_ptr parse_postfix(expr_ptr n) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        n = parse_subscript(std::move(n));
      } else if (is_op("(")) {
        n = parse_call(std::move(n));
      } else {
        return n;
      }
    }
  }

  expr_ptr parse_filter_expr(expr_ptr n) {
    while (true) {
      if (is_op("|")) {
        n = parse_filter(std::move(n));
      } else if (is_name("is")) {
        n = parse_test(std::move(n));
      } else if (is_op("(")) {
        n = parse_call(std::move(n));
      } else {
        return n;
      }
    }
  }

  expr_ptr parse_subscript(expr_ptr obj) {
    const token& t = advance();
    if (t.text == ".") {
      const token& a = cur();
      if (a.type == tok::name) {
        auto n = node(ek::attr, t.line);
        n->name = advance().text;
        n->args.push_back(std::move(obj));
        return n;
      }
      if (a.type == tok::integer) {
        auto n = node(ek::item, t.line);
        auto key = node(ek::constant, a.line);
        key->constant = value::of(json(a.ival));
        advance();
        n->args.push_back(std::move(obj));
        n->args.push_back(std::move(key));
        return n;
      }
      fail_at(a, "expected name or number");
    }
    // "[": an index or a slice
    expr_ptr parts[3];
    bool is_slice = false;
    int part = 0;
    while (!is_op("]")) {
      if (is_op(":")) {
        advance();
        is_slice = true;
        if (++part > 2) fail_at(cur(), "too many ':' in slice");
        continue;
      }
      if (parts[part]) fail_at(cur(), "expected token ']', got " + describe(cur()));
      parts[part] = parse_expression(true);
      if (is_op(",")) fail_at(cur(), "tuple subscripts are not supported");
    }
    expect_op("]");
    if (!is_slice) {
      if (!parts[0]) fail_at(t, "expected an expression in []");
      auto n = node(ek::item, t.line);
      n->args.push_back(std::move(obj));
      n->args.push_back(std::move(parts[0]));
      return n;
    }
    auto n = node(ek::slice, t.line);
    n->args.push_back(std::move(obj));
    for (auto& p : parts) n->args.push_back(std::move(p));
    return n;
  }

  void parse_call_args(expr& n) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) fail_at(cur(), "*args and **kwargs are not supported");
      if (cur().type == tok::name && peek().type == tok::op && peek().text == "=") {
        std::string key = advance().text;
        advance();
        n.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!n.kwargs.empty()) fail_at(cur(), "positional argument follows keyword argument");
        n.args.push_back(parse_expression(true));
      }
    }
    expect_op(")");
  }

  expr_ptr parse_call(expr_ptr callee) {
    auto n = node(ek::call, cur().line);
    n->args.push_back(std::move(callee));
    parse_call_args(*n);
    return n;
  }

  std::string dotted_name() {
    std::string name = expect_name();
    while (is_op(".")) {
      advance();
      name += "." + expect_name();
    }
    return name;
  }

  // "| name" or "| name(args)"; `input` is null in filter blocks and block sets.
  expr_ptr parse_filter(expr_ptr input, bool skip_pipe = true) {
    const int line = cur().line;
    if (skip_pipe) expect_op("|");
    auto n = node(ek::filter, line);
    n->name = dotted_name();
    n->args.push_back(std::move(input));
    if (is_op("(")) parse_call_args(*n);
    return n;
  }

  expr_ptr parse_test(expr_ptr input) {
    const int line = advance().line;  // "is"
    const bool negated = skip_name("not");
    auto n = node(ek::test, line);
    n->name = dotted_name();
    n->args.push_back(std::move(input));
    const token& t = cur();
    if (is_op("(")) {
      parse_call_args(*n);
    } else if ((t.type == tok::name || t.type == tok::string || t.type == tok::integer ||
                t.type == tok::floating || is_op("(") || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail_at(t, "You cannot chain multiple tests with is");
      n->args.push_back(parse_postfix(parse_primary()));
    }
    if (!negated) return n;
    auto neg = node(ek::not_, line);
    neg->args.push_back(std::move(n));
    return neg;
  }
};

// ---------------------------------------------------------------------------------------------
// Scoping: Jinja2 decides at compile time how each frame (the template, a loop body, a macro, a
// block set or filter block) starts out (jinja2/idtracking.py). A name the frame assigns, but
// neither reads before the assignment nor finds in an enclosing frame, starts out undefined,
// hiding a context variable of that name from loops and macros that run before the
// assignment. This pass marks those names; every other lookup is dynamic, which gives the same
// results as Jinja's resolve-and-alias.
// ---------------------------------------------------------------------------------------------

class frame_symbols {
 public:
  enum class load_kind : uint8_t { parameter, resolve, alias, undefined };

  explicit frame_symbols(const frame_symbols* parent) : parent_(parent) {}

  bool find_ref(const std::string& name) const {
    for (const frame_symbols* s = this; s; s = s->parent_)
      if (s->refs_.count(name)) return true;
    return false;
  }

  void load(const std::string& name) {
    if (!find_ref(name)) define(name, load_kind::resolve);
  }

  void store(const std::string& name) {
    stores_.insert(name);
    if (refs_.count(name)) return;
    define(name, parent_ && parent_->find_ref(name) ? load_kind::alias : load_kind::undefined);
  }

  void declare_parameter(const std::string& name) {
    stores_.insert(name);
    define(name, load_kind::parameter);
  }

  // After the branches of an if: a name first assigned inside them starts out as what it
  // was outside (the branch may not run).
  void branch_update(const std::vector<const frame_symbols*>& branches) {
    std::set<std::string> fresh_stores;
    for (const frame_symbols* b : branches)
      for (const auto& name : b->stores_)
        if (!stores_.count(name)) fresh_stores.insert(name);
    for (const frame_symbols* b : branches) {
      refs_.insert(b->refs_.begin(), b->refs_.end());
      for (const auto& [k, v] : b->loads_) loads_[k] = v;
      stores_.insert(b->stores_.begin(), b->stores_.end());
    }
    for (const auto& name : fresh_stores)
      loads_[name] = parent_ && parent_->find_ref(name) ? load_kind::alias : load_kind::resolve;
  }

  std::vector<std::string> undefined_names() const {
    std::vector<std::string> out;
    for (const auto& [name, kind] : loads_)
      if (kind == load_kind::undefined) out.push_back(name);
    return out;
  }

 private:
  const frame_symbols* parent_;
  std::set<std::string> refs_;
  std::map<std::string, load_kind> loads_;
  std::set<std::string> stores_;

  void define(const std::string& name, load_kind kind) {
    refs_.insert(name);
    loads_[name] = kind;
  }
};

class scope_analyzer {
 public:
  // Analyses the template's top frame and, recursively, every frame inside it.
  std::vector<std::string> analyze_root(body& root) {
    frame_symbols sym(nullptr);
    std::vector<stmt*> children;
    visit_body(root, sym, children);
    analyze_children(children, sym);
    return sym.undefined_names();
  }

 private:
  void visit_expr(const expr* e, frame_symbols& sym) {
    if (!e) return;
    if (e->kind == ek::name) sym.load(e->name);
    for (const auto& k : e->keys) visit_expr(k.get(), sym);
    for (const auto& a : e->args) visit_expr(a.get(), sym);
    for (const auto& [k, v] : e->kwargs) visit_expr(v.get(), sym);
  }

  // The statements of one frame, in order; frames nested in it are collected for later, as
  // Jinja analyses a whole frame before the frames inside it.
  void visit_body(body& b, frame_symbols& sym, std::vector<stmt*>& children) {
    for (auto& s : b) visit_stmt(*s, sym, children);
  }

  void visit_stmt(stmt& s, frame_symbols& sym, std::vector<stmt*>& children) {
    switch (s.kind) {
      case sk::text:
      case sk::break_:
      case sk::continue_:
        return;
      case sk::output:
        visit_expr(s.e.get(), sym);
        return;
      case sk::if_: {
        // Jinja's If: the first test, then three branches (body, all elifs, else).
        visit_expr(s.branches[0].first.get(), sym);
        frame_symbols body_sym = sym;
        visit_body(s.branches[0].second, body_sym, children);
        frame_symbols elif_sym = sym;
        for (std::size_t i = 1; i < s.branches.size(); ++i) {
          visit_expr(s.branches[i].first.get(), elif_sym);
          frame_symbols inner = elif_sym;
          visit_body(s.branches[i].second, inner, children);
          const frame_symbols none_sym = elif_sym;
          elif_sym.branch_update({&inner, &none_sym, &none_sym});
        }
        frame_symbols else_sym = sym;
        visit_body(s.else_body, else_sym, children);
        sym.branch_update({&body_sym, &elif_sym, &else_sym});
        return;
      }
      case sk::for_:
        visit_expr(s.e.get(), sym);
        children.push_back(&s);
        return;
      case sk::set:
        visit_expr(s.e.get(), sym);
        for (const auto& t : s.targets) sym.store(t);
        return;
      case sk::set_attr:
        visit_expr(s.e.get(), sym);
        sym.load(s.text);
        return;
      case sk::set_block:
        sym.store(s.targets[0]);
        children.push_back(&s);
        return;
      case sk::macro:
        sym.store(s.text);
        children.push_back(&s);
        return;
      case sk::filter_block:
        for (const auto& f : s.filters) visit_expr(f.get(), sym);
        children.push_back(&s);
        return;
      case sk::generation:
        children.push_back(&s);
        return;
    }
  }

  void analyze_children(const std::vector<stmt*>& children, const frame_symbols& parent) {
    for (stmt* s : children) {
      frame_symbols sym(&parent);
      std::vector<stmt*> grandchildren;
      if (s->kind == sk::for_) {
        for (const auto& t : s->targets) sym.declare_parameter(t);
        sym.declare_parameter("loop");
        visit_body(s->inner, sym, grandchildren);
        frame_symbols else_sym(&parent);
        std::vector<stmt*> else_children;
        visit_body(s->else_body, else_sym, else_children);
        s->else_fresh = else_sym.undefined_names();
        analyze_children(else_children, else_sym);
      } else if (s->kind == sk::macro) {
        for (const auto& [name, def] : s->params) sym.declare_parameter(name);
        for (const auto& [name, def] : s->params) visit_expr(def.get(), sym);
        visit_body(s->inner, sym, grandchildren);
      } else {
        for (const auto& f : s->filters) visit_expr(f.get(), sym);
        visit_body(s->inner, sym, grandchildren);
      }
      s->fresh = sym.undefined_names();
      analyze_children(grandchildren, sym);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Evaluator
// ---------------------------------------------------------------------------------------------

enum class flow : uint8_t { normal, break_, continue_ };

constexpr int max_call_depth = 256;
constexpr std::size_t max_text = std::size_t{1} << 26;  // 64 MiB: any string, or the output
constexpr int64_t max_range = 100000;                   // Jinja's sandbox MAX_RANGE

[[noreturn]] void fail(int line, const std::string& message) {
  throw chat_template_render_error(message, line);
}

[[noreturn]] void fail_undefined(int line, const value& v) {
  fail(line, v.hint.empty() ? "value is undefined" : v.hint);
}

value none_value() {
  static const value v = value::of(json(nullptr));
  return v;
}
value bool_value(bool b) {
  static const value t = value::of(json(true));
  static const value f = value::of(json(false));
  return b ? t : f;
}
// Bounds memory for templates that grow strings without end (doubling one in a loop).
void check_size(std::size_t n, int line) {
  if (n > max_text) fail(line, "string or output larger than 64 MiB");
}

value str_value(std::string s) {
  return value::of(json(std::move(s)));
}
value int_value(int64_t i) {
  // Loop counters and indexes: small integers are shared, not allocated each time.
  static const std::vector<value> small = [] {
    std::vector<value> v;
    for (int64_t k = -1; k <= 1024; ++k) v.push_back(value::of(json(k)));
    return v;
  }();
  if (i >= -1 && i <= 1024) return small[static_cast<std::size_t>(i + 1)];
  return value::of(json(i));
}
value float_value(double d) {
  return value::of(json(d));
}

// A value put inside a list or dict: it must be plain data.
json to_json(const value& v, int line) {
  if (v.is_json()) return *v.j;
  if (v.is_undefined()) fail_undefined(line, v);
  fail(line, "a " + type_name(v) + " cannot be stored in a list or dict");
}

std::optional<std::u32string> chars_arg(const value* v, int line) {
  if (!v || v->is_none()) return std::nullopt;
  if (!v->is_string()) fail(line, "strip arg must be None or str");
  return decode(v->str());
}

int64_t int_arg(const value* v, int64_t fallback, int line, const char* what) {
  if (!v || v->is_none()) return fallback;
  if (!v->is_int()) fail(line, std::string(what) + " must be an integer, not " + type_name(*v));
  return as_int(*v);
}

bool bool_arg(const value* v, bool fallback) {
  return v ? truthy(*v) : fallback;
}

// Python's int(str): optional sign, digits with single underscores, surrounding whitespace.
std::optional<int64_t> parse_py_int(std::string_view s, int base) {
  const std::string t = py_strip(s, std::nullopt, true, true);
  std::string digits;
  std::size_t i = 0;
  bool negative = false;
  if (i < t.size() && (t[i] == '+' || t[i] == '-')) negative = t[i++] == '-';
  if (base == 16 && t.compare(i, 2, "0x") == 0) i += 2;
  if (base == 8 && t.compare(i, 2, "0o") == 0) i += 2;
  if (base == 2 && t.compare(i, 2, "0b") == 0) i += 2;
  bool last_underscore = true;
  for (; i < t.size(); ++i) {
    if (t[i] == '_') {
      if (last_underscore) return std::nullopt;
      last_underscore = true;
      continue;
    }
    digits.push_back(t[i]);
    last_underscore = false;
  }
  if (digits.empty() || last_underscore) return std::nullopt;
  int64_t out = 0;
  const auto res = std::from_chars(digits.data(), digits.data() + digits.size(), out, base);
  if (res.ec != std::errc{} || res.ptr != digits.data() + digits.size()) return std::nullopt;
  return negative ? -out : out;
}

std::optional<double> parse_py_float(std::string_view s) {
  std::string t = py_strip(s, std::nullopt, true, true);
  t.erase(std::remove(t.begin(), t.end(), '_'), t.end());
  if (t.empty()) return std::nullopt;
  std::string lower = map_cps(t, to_lower);
  std::size_t sign = lower[0] == '+' || lower[0] == '-' ? 1 : 0;
  const std::string body = lower.substr(sign);
  if (body == "inf" || body == "infinity" || body == "nan") {
    const double x = body == "nan" ? std::numeric_limits<double>::quiet_NaN()
                                   : std::numeric_limits<double>::infinity();
    return lower[0] == '-' ? -x : x;
  }
  for (char c : body)
    if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == 'e' || c == '+' ||
          c == '-'))
      return std::nullopt;
  double out = 0;
  const auto res = std::from_chars(t.data() + (t[0] == '+' ? 1 : 0), t.data() + t.size(), out);
  if (res.ec != std::errc{} || res.ptr != t.data() + t.size()) return std::nullopt;
  return out;
}

// Python slice indices for a sequence of n items.
std::vector<std::size_t> slice_indices(int64_t n, std::optional<int64_t> start,
                                       std::optional<int64_t> stop, std::optional<int64_t> step,
                                       int line) {
  const int64_t st = step.value_or(1);
  if (st == 0) fail(line, "slice step cannot be zero");
  auto adjust = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v;
    if (x < 0) {
      x += n;
      if (x < 0) x = st < 0 ? -1 : 0;
    } else if (x >= n) {
      x = st < 0 ? n - 1 : n;
    }
    return x;
  };
  const int64_t b = adjust(start, st > 0 ? 0 : n - 1);
  const int64_t e = adjust(stop, st > 0 ? n : -1);
  std::vector<std::size_t> out;
  for (int64_t i = b; st > 0 ? i < e : i > e; i += st) out.push_back(static_cast<std::size_t>(i));
  return out;
}

// str.split / str.rsplit.
json py_split(std::string_view s, const value* sep_v, int64_t maxsplit, bool from_right, int line) {
  json out = json::array();
  if (!sep_v || sep_v->is_none()) {
    const std::u32string cps = decode(s);
    std::vector<std::pair<std::size_t, std::size_t>> words;  // [begin, end)
    std::size_t i = 0;
    while (i < cps.size()) {
      while (i < cps.size() && py_isspace(cps[i])) ++i;
      if (i == cps.size()) break;
      std::size_t j = i;
      while (j < cps.size() && !py_isspace(cps[j])) ++j;
      words.emplace_back(i, j);
      i = j;
    }
    if (maxsplit >= 0 && static_cast<int64_t>(words.size()) > maxsplit) {
      // The unsplit remainder runs to the end (start) of the string, whitespace and all.
      if (!from_right) {
        const auto k = static_cast<std::size_t>(maxsplit);
        words[k].second = cps.size();
        words.resize(k + 1);
      } else {
        const std::size_t keep = static_cast<std::size_t>(maxsplit);
        const std::size_t first = words.size() - keep - 1;
        words[first].first = 0;
        words.erase(words.begin(), words.begin() + static_cast<std::ptrdiff_t>(first));
      }
    }
    for (const auto& [b, e] : words)
      out.push_back(encode(std::u32string_view(cps).substr(b, e - b)));
    return out;
  }
  if (!sep_v->is_string()) fail(line, "must be str or None, not " + type_name(*sep_v));
  const std::string& sep = sep_v->str();
  if (sep.empty()) fail(line, "empty separator");
  std::vector<std::string> parts;
  if (!from_right) {
    std::size_t pos = 0;
    int64_t done = 0;
    while (maxsplit < 0 || done < maxsplit) {
      const std::size_t hit = s.find(sep, pos);
      if (hit == std::string_view::npos) break;
      parts.emplace_back(s.substr(pos, hit - pos));
      pos = hit + sep.size();
      ++done;
    }
    parts.emplace_back(s.substr(pos));
  } else {
    std::size_t end = s.size();
    int64_t done = 0;
    std::vector<std::string> rev;
    while (maxsplit < 0 || done < maxsplit) {
      if (end < sep.size()) break;
      const std::size_t hit = s.rfind(sep, end - sep.size());
      if (hit == std::string_view::npos) break;
      rev.emplace_back(s.substr(hit + sep.size(), end - hit - sep.size()));
      end = hit;
      ++done;
    }
    rev.emplace_back(s.substr(0, end));
    parts.assign(rev.rbegin(), rev.rend());
  }
  for (auto& p : parts) out.push_back(std::move(p));
  return out;
}

// Jinja's do_title: capitalise each run that follows a separator of [-\s({[<].
std::string jinja_title(std::string_view s) {
  std::string out;
  bool at_start = true;
  for (std::size_t i = 0; i < s.size();) {
    const char32_t cp = next_cp(s, i);
    const bool sep =
        py_isspace(cp) || cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<';
    if (sep) {
      append_cp(out, cp);
      at_start = true;
    } else {
      append_cp(out, at_start ? to_upper(cp) : to_lower(cp));
      at_start = false;
    }
  }
  return out;
}

std::string html_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

class renderer {
 public:
  renderer(const json& context, std::shared_ptr<const json> owner)
      : ctx_(context), ctx_owner_(std::move(owner)) {}

  std::string run(const body& root, const std::vector<std::string>& fresh) {
    if (!ctx_.is_object()) fail(0, "the context must be a JSON object");
    declare_fresh(root_, fresh);
    std::string out;
    exec(root, root_, out);
    return out;
  }

 private:
  // Scopes live on the C++ stack, each inside its parent's lifetime. A macro refers to the
  // scope it was defined in (as a Python closure does); `alive` tells it whether that scope
  // still exists when the macro is called.
  struct scope {
    std::vector<std::pair<std::string, value>> vars;
    scope* parent = nullptr;
    std::shared_ptr<int> alive;

    scope() = default;
    explicit scope(scope* enclosing) : parent(enclosing) {}

    value* find(std::string_view name) {
      for (auto& [k, v] : vars)
        if (k == name) return &v;
      return nullptr;
    }
    void set(const std::string& name, value v) {
      if (value* slot = find(name)) {
        *slot = std::move(v);
      } else {
        vars.emplace_back(name, std::move(v));
      }
    }
  };

  const json& ctx_;
  std::shared_ptr<const json> ctx_owner_;
  scope root_;
  int depth_ = 0;

  // ---- names ----

  value lookup(const std::string& name) {
    for (scope* s = current_; s; s = s->parent)
      if (value* v = s->find(name)) return *v;
    const auto it = ctx_.find(name);
    if (it != ctx_.end()) return value::ref(ctx_owner_, &*it);
    for (const auto& [k, v] : globals())
      if (k == name) return v;
    return value::undefined("'" + name + "' is undefined");
  }

  scope* current_ = &root_;

  struct scope_guard {
    renderer& r;
    scope* saved;
    scope_guard(renderer& owner, scope* now) : r(owner), saved(owner.current_) { r.current_ = now; }
    ~scope_guard() { r.current_ = saved; }
  };

  static const std::vector<std::pair<std::string, value>>& globals() {
    static const std::vector<std::pair<std::string, value>> g = make_globals();
    return g;
  }

  static std::vector<std::pair<std::string, value>> make_globals() {
    std::vector<std::pair<std::string, value>> g;
    g.emplace_back("raise_exception", value::of_fn("raise_exception", [](call_args& a) -> value {
                     const value* msg = a.get(0, "message");
                     throw chat_template_exception(msg ? to_str(*msg) : std::string());
                   }));
    g.emplace_back("namespace", value::of_fn("namespace", [](call_args& a) {
                     auto n = std::make_shared<object_ns>();
                     auto add = [&](const std::string& k, value v) {
                       if (!k.empty() && k[0] == '_')
                         fail(a.line,
                              "Chat templates cannot store underscore-prefixed attributes on a "
                              "namespace, but got '" +
                                  k + "'. Please rename the attribute.");
                       n->set(k, std::move(v));
                     };
                     for (const value& p : a.pos) {
                       if (!p.is_object()) fail(a.line, "namespace() takes a dict positionally");
                       for (const auto& [k, e] : p.j->items()) add(k, p.child(&e));
                     }
                     for (auto& [k, v] : a.kw) add(k, v);
                     return value::of_ns(std::move(n));
                   }));
    g.emplace_back("dict", value::of_fn("dict", [](call_args& a) {
                     json out = json::object();
                     for (const value& p : a.pos) {
                       if (!p.is_object()) fail(a.line, "dict() takes a dict positionally");
                       for (const auto& [k, e] : p.j->items()) out[k] = e;
                     }
                     for (auto& [k, v] : a.kw) out[k] = to_json(v, a.line);
                     return value::of(std::move(out));
                   }));
    g.emplace_back("range", value::of_fn("range", [](call_args& a) {
                     if (a.pos.empty() || a.pos.size() > 3)
                       fail(a.line, "range expected 1 to 3 arguments");
                     int64_t start = 0, stop = 0, step = 1;
                     for (const value& p : a.pos)
                       if (!p.is_int())
                         fail(a.line,
                              "'" + type_name(p) + "' object cannot be interpreted as an integer");
                     if (a.pos.size() == 1) {
                       stop = as_int(a.pos[0]);
                     } else {
                       start = as_int(a.pos[0]);
                       stop = as_int(a.pos[1]);
                       if (a.pos.size() == 3) step = as_int(a.pos[2]);
                     }
                     if (step == 0) fail(a.line, "range() arg 3 must not be zero");
                     json out = json::array();
                     for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
                       if (static_cast<int64_t>(out.size()) >= max_range)
                         fail(a.line, "Range too big. The sandbox blocks ranges larger than " +
                                          std::to_string(max_range) + ".");
                       out.push_back(i);
                     }
                     return value::of(std::move(out));
                   }));
    g.emplace_back("strftime_now", value::of_fn("strftime_now", [](call_args& a) {
                     const value* f = a.get(0, "format");
                     if (!f || !f->is_string())
                       fail(a.line, "strftime_now() takes a format string");
                     const std::time_t now = std::time(nullptr);
                     std::tm tm{};
                     localtime_r(&now, &tm);
                     char buf[512];
                     const std::size_t n = std::strftime(buf, sizeof buf, f->str().c_str(), &tm);
                     return str_value(std::string(buf, n));
                   }));
    return g;
  }

  // ---- statements ----

  static void declare_fresh(scope& sc, const std::vector<std::string>& names) {
    for (const auto& n : names) sc.set(n, value::undefined("'" + n + "' is undefined"));
  }

  flow exec(const body& b, scope& sc, std::string& out) {
    scope_guard guard(*this, &sc);
    for (const auto& s : b) {
      const flow f = exec_stmt(*s, sc, out);
      if (f != flow::normal) return f;
    }
    return flow::normal;
  }

  flow exec_stmt(const stmt& s, scope& sc, std::string& out) {
    switch (s.kind) {
      case sk::text:
        out += s.text;
        check_size(out.size(), s.line);
        return flow::normal;
      case sk::output:
        out += to_str(eval(*s.e));
        check_size(out.size(), s.line);
        return flow::normal;
      case sk::if_:
        for (const auto& [cond, b] : s.branches)
          if (truthy(eval(*cond))) return exec(b, sc, out);
        return exec(s.else_body, sc, out);
      case sk::for_:
        return exec_for(s, sc, out);
      case sk::set:
        assign(sc, s.targets, eval(*s.e), s.line);
        return flow::normal;
      case sk::set_attr: {
        value target = lookup(s.text);
        if (target.kind != vkind::ns || target.ns->is_loop)
          fail(s.line, "cannot assign attribute on non-namespace object");
        if (!s.attr.empty() && s.attr[0] == '_')
          fail(s.line,
               "Chat templates cannot store underscore-prefixed attributes on a namespace, but "
               "got '" +
                   s.attr + "'. Please rename the attribute.");
        target.ns->set(s.attr, eval(*s.e));
        return flow::normal;
      }
      case sk::set_block: {
        std::string buf;
        scope inner(&sc);
        declare_fresh(inner, s.fresh);
        exec(s.inner, inner, buf);
        value v = str_value(std::move(buf));
        for (const auto& f : s.filters) v = apply_filter(*f, std::move(v));
        sc.set(s.targets[0], std::move(v));
        return flow::normal;
      }
      case sk::macro: {
        const stmt* m = &s;
        if (!sc.alive) sc.alive = std::make_shared<int>(0);
        scope* defined_in = &sc;
        std::weak_ptr<int> token = sc.alive;
        sc.set(s.text, value::of_fn(s.text, [this, m, defined_in, token](call_args& a) {
                 if (token.expired())
                   fail(a.line,
                        "macro '" + m->text + "' called after the block that defined it ended");
                 return call_macro(*m, a, *defined_in);
               }));
        return flow::normal;
      }
      case sk::filter_block: {
        std::string buf;
        scope inner(&sc);
        declare_fresh(inner, s.fresh);
        exec(s.inner, inner, buf);
        value v = str_value(std::move(buf));
        for (const auto& f : s.filters) v = apply_filter(*f, std::move(v));
        out += to_str(v);
        return flow::normal;
      }
      case sk::break_:
        return flow::break_;
      case sk::continue_:
        return flow::continue_;
      case sk::generation: {
        scope inner(&sc);
        declare_fresh(inner, s.fresh);
        return exec(s.inner, inner, out);
      }
    }
    return flow::normal;
  }

  void assign(scope& sc, const std::vector<std::string>& targets, value v, int line) {
    if (targets.size() == 1) {
      sc.set(targets[0], std::move(v));
      return;
    }
    std::vector<value> items = iterate(v, line);
    if (items.size() != targets.size())
      fail(line,
           items.size() < targets.size()
               ? "not enough values to unpack (expected " + std::to_string(targets.size()) +
                     ", got " + std::to_string(items.size()) + ")"
               : "too many values to unpack (expected " + std::to_string(targets.size()) + ")");
    for (std::size_t i = 0; i < targets.size(); ++i) sc.set(targets[i], std::move(items[i]));
  }

  flow exec_for(const stmt& s, scope& sc, std::string& out) {
    auto items = std::make_shared<std::vector<value>>(iterate(eval(*s.e), s.line));
    if (s.cond) {
      std::vector<value> kept;
      for (auto& item : *items) {
        scope probe(&sc);
        assign(probe, s.targets, item, s.line);
        scope_guard guard(*this, &probe);
        if (truthy(eval(*s.cond))) kept.push_back(std::move(item));
      }
      *items = std::move(kept);
    }
    if (items->empty()) {
      scope else_scope(&sc);
      declare_fresh(else_scope, s.else_fresh);
      return exec(s.else_body, else_scope, out);
    }
    const auto n = static_cast<int64_t>(items->size());
    for (int64_t i = 0; i < n; ++i) {
      scope iteration(&sc);
      declare_fresh(iteration, s.fresh);
      assign(iteration, s.targets, (*items)[static_cast<std::size_t>(i)], s.line);
      auto loop = std::make_shared<object_ns>();
      loop->is_loop = true;
      loop->loop_index0 = i;
      loop->loop_items = items;
      iteration.set("loop", value::of_ns(std::move(loop)));
      const flow f = exec(s.inner, iteration, out);
      if (f == flow::break_) break;
    }
    return flow::normal;
  }

  value call_macro(const stmt& m, call_args& a, scope& defined_in) {
    if (a.pos.size() > m.params.size())
      fail(a.line, "macro '" + m.text + "' takes not more than " + std::to_string(m.params.size()) +
                       " argument(s)");
    for (const auto& [k, v] : a.kw) {
      const auto it = std::find_if(m.params.begin(), m.params.end(),
                                   [&](const auto& p) { return p.first == k; });
      if (it == m.params.end())
        fail(a.line, "macro '" + m.text + "' takes no keyword argument '" + k + "'");
      if (static_cast<std::size_t>(it - m.params.begin()) < a.pos.size())
        fail(a.line, "macro '" + m.text + "' got multiple values for argument '" + k + "'");
    }
    if (depth_ >= max_call_depth) fail(a.line, "maximum macro recursion depth exceeded");
    struct depth_guard {
      int& d;
      explicit depth_guard(int& depth) : d(++depth) {}
      ~depth_guard() { --d; }
    } guard_depth(depth_);
    scope frame(&defined_in);  // the names where it was defined, not the caller's
    scope_guard guard(*this, &frame);
    declare_fresh(frame, m.fresh);
    for (std::size_t i = 0; i < m.params.size(); ++i) {
      const auto& [pname, def] = m.params[i];
      const value* given = i < a.pos.size() ? &a.pos[i] : nullptr;
      for (const auto& [k, v] : a.kw)
        if (k == pname) given = &v;
      if (given) {
        frame.set(pname, *given);
      } else if (def) {
        frame.set(pname, eval(*def));
      } else {
        frame.set(pname, value::undefined("parameter '" + pname + "' was not provided"));
      }
    }
    std::string buf;
    exec(m.inner, frame, buf);
    return str_value(std::move(buf));
  }

  // ---- expressions ----

  value eval(const expr& e) {
    switch (e.kind) {
      case ek::constant:
        return e.constant;
      case ek::name:
        return lookup(e.name);
      case ek::list:
      case ek::tuple: {
        json out = json::array();
        for (const auto& a : e.args) out.push_back(to_json(eval(*a), e.line));
        return value::of(std::move(out));
      }
      case ek::dict: {
        json out = json::object();
        for (std::size_t i = 0; i < e.keys.size(); ++i) {
          const value k = eval(*e.keys[i]);
          if (!k.is_string()) fail(e.line, "dict keys must be strings, not " + type_name(k));
          out[k.str()] = to_json(eval(*e.args[i]), e.line);
        }
        return value::of(std::move(out));
      }
      case ek::attr:
        return get_attr(eval(*e.args[0]), e.name, e.line);
      case ek::item:
        return get_item(eval(*e.args[0]), eval(*e.args[1]), e.line);
      case ek::slice:
        return eval_slice(e);
      case ek::call:
        return eval_call(e);
      case ek::filter:
        return apply_filter(e, eval(*e.args[0]));
      case ek::test:
        return bool_value(apply_test(e, eval(*e.args[0])));
      case ek::neg:
      case ek::pos: {
        const value v = eval(*e.args[0]);
        if (v.is_undefined()) fail_undefined(e.line, v);
        if (!v.is_number())
          fail(e.line, std::string("bad operand type for unary ") +
                           (e.kind == ek::neg ? "-" : "+") + ": '" + type_name(v) + "'");
        if (e.kind == ek::pos) return v.is_bool() ? int_value(as_int(v)) : v;
        if (v.j->is_number_float()) return float_value(-as_float(v));
        return int_value(-as_int(v));
      }
      case ek::not_:
        return bool_value(!truthy(eval(*e.args[0])));
      case ek::binop:
        return binary(e.name, eval(*e.args[0]), eval(*e.args[1]), e.line);
      case ek::concat: {
        std::string out;
        for (const auto& a : e.args) {
          out += to_str(eval(*a));
          check_size(out.size(), e.line);
        }
        return str_value(std::move(out));
      }
      case ek::compare: {
        value left = eval(*e.args[0]);
        for (std::size_t i = 0; i < e.ops.size(); ++i) {
          value right = eval(*e.args[i + 1]);
          if (!compare(e.ops[i], left, right, e.line)) return bool_value(false);
          left = std::move(right);
        }
        return bool_value(true);
      }
      case ek::and_: {
        value l = eval(*e.args[0]);
        return truthy(l) ? eval(*e.args[1]) : l;
      }
      case ek::or_: {
        value l = eval(*e.args[0]);
        return truthy(l) ? l : eval(*e.args[1]);
      }
      case ek::cond:
        if (truthy(eval(*e.args[1]))) return eval(*e.args[0]);
        if (e.args[2]) return eval(*e.args[2]);
        return value::undefined("the inline if-expression on line " + std::to_string(e.line) +
                                " evaluated to false and no else section was defined.");
    }
    fail(e.line, "unknown expression");
  }

  call_args eval_args(const expr& e, std::size_t first) {
    call_args a;
    a.line = e.line;
    for (std::size_t i = first; i < e.args.size(); ++i) a.pos.push_back(eval(*e.args[i]));
    for (const auto& [k, v] : e.kwargs) a.kw.emplace_back(k, eval(*v));
    return a;
  }

  value eval_call(const expr& e) {
    const value callee = eval(*e.args[0]);
    if (callee.is_undefined()) fail_undefined(e.line, callee);
    if (callee.kind != vkind::function)
      fail(e.line, "'" + type_name(callee) + "' object is not callable");
    call_args a = eval_args(e, 1);
    return callee.fn->impl(a);
  }

  value eval_slice(const expr& e) {
    const value obj = eval(*e.args[0]);
    if (obj.is_undefined()) fail_undefined(e.line, obj);
    std::optional<int64_t> bounds[3];
    for (std::size_t k = 0; k < 3; ++k) {
      if (!e.args[k + 1]) continue;
      const value b = eval(*e.args[k + 1]);
      if (b.is_none()) continue;
      if (!b.is_int()) fail(e.line, "slice indices must be integers or None, not " + type_name(b));
      bounds[k] = as_int(b);
    }
    if (obj.is_string()) {
      const std::u32string cps = decode(obj.str());
      std::u32string out;
      for (std::size_t i :
           slice_indices(static_cast<int64_t>(cps.size()), bounds[0], bounds[1], bounds[2], e.line))
        out.push_back(cps[i]);
      return str_value(encode(out));
    }
    if (obj.is_array()) {
      json out = json::array();
      for (std::size_t i : slice_indices(static_cast<int64_t>(obj.j->size()), bounds[0], bounds[1],
                                         bounds[2], e.line))
        out.push_back((*obj.j)[i]);
      return value::of(std::move(out));
    }
    // Jinja compiles a slice to a plain Python subscript: anything else is a TypeError.
    if (obj.is_object()) fail(e.line, "unhashable type: 'slice'");
    fail(e.line, "'" + type_name(obj) + "' object is not subscriptable");
  }

  // obj.name: a method of the value's Python type wins over a dict key, as getattr does.
  value get_attr(const value& obj, const std::string& name, int line) {
    switch (obj.kind) {
      case vkind::undefined:
        fail_undefined(line, obj);
      case vkind::ns:
        if (obj.ns->is_loop) return loop_attr(*obj.ns, name);
        if (value* v = obj.ns->find(name)) return *v;
        return value::undefined("'" + type_name(obj) + "' object has no attribute '" + name + "'");
      case vkind::function:
        return value::undefined("'function' object has no attribute '" + name + "'");
      case vkind::json:
        break;
    }
    if (has_method(*obj.j, name)) return bound_method(obj, name);
    if (obj.is_object()) {
      const auto it = obj.j->find(name);
      if (it != obj.j->end()) return obj.child(&*it);
    }
    return value::undefined("'" + type_name(obj) + " object' has no attribute '" + name + "'");
  }

  static value loop_attr(const object_ns& loop, const std::string& name) {
    const int64_t i = loop.loop_index0;
    const auto& items = *loop.loop_items;
    const auto n = static_cast<int64_t>(items.size());
    if (name == "index") return int_value(i + 1);
    if (name == "index0") return int_value(i);
    if (name == "revindex") return int_value(n - i);
    if (name == "revindex0") return int_value(n - i - 1);
    if (name == "first") return bool_value(i == 0);
    if (name == "last") return bool_value(i == n - 1);
    if (name == "length") return int_value(n);
    if (name == "depth") return int_value(1);
    if (name == "depth0") return int_value(0);
    if (name == "previtem")
      return i > 0 ? items[static_cast<std::size_t>(i - 1)]
                   : value::undefined("there is no previous item");
    if (name == "nextitem")
      return i + 1 < n ? items[static_cast<std::size_t>(i + 1)]
                       : value::undefined("there is no next item");
    if (name == "cycle")
      return value::of_fn("cycle", [i](call_args& a) {
        if (a.pos.empty()) fail(a.line, "no items for cycling given");
        return a.pos[static_cast<std::size_t>(i) % a.pos.size()];
      });
    return value::undefined("'LoopContext' object has no attribute '" + name + "'");
  }

  // obj[key]: an item first, then an attribute of that name (Jinja's getitem).
  value get_item(const value& obj, const value& key, int line) {
    if (obj.is_undefined()) fail_undefined(line, obj);
    if (obj.kind == vkind::ns) {
      if (key.is_string()) return get_attr(obj, key.str(), line);
      return value::undefined("'Namespace' object is not subscriptable");
    }
    if (obj.kind == vkind::json) {
      const json& j = *obj.j;
      if (j.is_object() && key.is_string()) {
        const auto it = j.find(key.str());
        if (it != j.end()) return obj.child(&*it);
      } else if ((j.is_array() || j.is_string()) && key.is_int()) {
        int64_t i = as_int(key);
        if (j.is_array()) {
          const auto n = static_cast<int64_t>(j.size());
          if (i < 0) i += n;
          if (i >= 0 && i < n) return obj.child(&j[static_cast<std::size_t>(i)]);
        } else {
          const std::u32string cps = decode(obj.str());
          const auto n = static_cast<int64_t>(cps.size());
          if (i < 0) i += n;
          if (i >= 0 && i < n) {
            std::string out;
            append_cp(out, cps[static_cast<std::size_t>(i)]);
            return str_value(std::move(out));
          }
        }
        return value::undefined(std::string(j.is_array() ? "list" : "string") +
                                " index out of range");
      }
      if (key.is_string() && has_method(j, key.str())) return bound_method(obj, key.str());
    }
    std::string key_text;
    if (key.is_json()) {
      py_repr(key_text, *key.j);
    } else {
      key_text = to_str(key);
    }
    return value::undefined("'" + type_name(obj) + " object' has no attribute " + key_text);
  }

  // ---- Python operators ----

  value binary(const std::string& op, const value& l, const value& r, int line) {
    if (l.is_undefined()) fail_undefined(line, l);
    if (r.is_undefined()) fail_undefined(line, r);
    auto unsupported = [&]() -> value {
      if (op == "+" && l.is_string())
        fail(line, "can only concatenate str (not \"" + type_name(r) + "\") to str");
      if (op == "+" && l.is_array())
        fail(line, "can only concatenate list (not \"" + type_name(r) + "\") to list");
      fail(line, "unsupported operand type(s) for " + op + ": '" + type_name(l) + "' and '" +
                     type_name(r) + "'");
    };
    const bool nums = l.is_number() && r.is_number();
    const bool ints = l.is_int() && r.is_int();
    if (op == "+" || op == "-" || op == "*") {
      if (ints) {
        int64_t out = 0;
        const bool overflow = op == "+"   ? __builtin_add_overflow(as_int(l), as_int(r), &out)
                              : op == "-" ? __builtin_sub_overflow(as_int(l), as_int(r), &out)
                                          : __builtin_mul_overflow(as_int(l), as_int(r), &out);
        if (overflow) fail(line, "integer overflow");
        return int_value(out);
      }
      if (nums) {
        const double x = as_float(l);
        const double y = as_float(r);
        return float_value(op == "+" ? x + y : op == "-" ? x - y : x * y);
      }
    }
    if (op == "+") {
      if (l.is_string() && r.is_string()) {
        check_size(l.str().size() + r.str().size(), line);
        return str_value(l.str() + r.str());
      }
      if (l.is_array() && r.is_array()) {
        json out = *l.j;
        for (const auto& x : *r.j) out.push_back(x);
        return value::of(std::move(out));
      }
      return unsupported();
    }
    if (op == "-") return unsupported();
    if (op == "*") return repeat(l, r, line, unsupported);
    if (op == "/") {
      if (!nums) return unsupported();
      if (as_float(r) == 0.0) fail(line, "division by zero");
      return float_value(as_float(l) / as_float(r));
    }
    if (op == "//" || op == "%") {
      if (!nums) {
        if (op == "%" && l.is_string())
          fail(line, "printf-style string formatting with % is not supported");
        return unsupported();
      }
      if (ints) {
        const int64_t a = as_int(l);
        const int64_t b = as_int(r);
        if (b == 0) fail(line, "integer division or modulo by zero");
        int64_t q = a / b;
        int64_t m = a % b;
        if (m != 0 && ((m < 0) != (b < 0))) {  // Python floors
          --q;
          m += b;
        }
        return int_value(op == "//" ? q : m);
      }
      const double a = as_float(l);
      const double b = as_float(r);
      if (b == 0.0) fail(line, "float division by zero");
      if (op == "//") return float_value(std::floor(a / b));
      double m = std::fmod(a, b);
      if (m != 0.0 && ((m < 0) != (b < 0))) m += b;
      return float_value(m);
    }
    if (op == "**") {
      if (!nums) return unsupported();
      if (ints && as_int(r) >= 0) {
        int64_t base = as_int(l);
        int64_t exp = as_int(r);
        int64_t out = 1;
        while (exp > 0) {
          if ((exp & 1) && __builtin_mul_overflow(out, base, &out)) fail(line, "integer overflow");
          exp >>= 1;
          if (exp > 0 && __builtin_mul_overflow(base, base, &base)) fail(line, "integer overflow");
        }
        return int_value(out);
      }
      return float_value(std::pow(as_float(l), as_float(r)));
    }
    fail(line, "unknown operator " + op);
  }

  // str * int, list * int (either order).
  template <typename F>
  value repeat(const value& l, const value& r, int line, F unsupported) {
    const value* seq = l.is_string() || l.is_array() ? &l : &r;
    const value* count = seq == &l ? &r : &l;
    if (!(seq->is_string() || seq->is_array()) || !count->is_int()) return unsupported();
    const int64_t n = as_int(*count);
    const std::size_t unit = seq->is_string() ? seq->str().size() : seq->j->size();
    if (n > 0 && static_cast<double>(n) * static_cast<double>(unit) > static_cast<double>(max_text))
      fail(line, "string or output larger than 64 MiB");
    if (seq->is_string()) {
      std::string out;
      for (int64_t i = 0; i < n; ++i) out += seq->str();
      return str_value(std::move(out));
    }
    json out = json::array();
    for (int64_t i = 0; i < n; ++i)
      for (const auto& x : *seq->j) out.push_back(x);
    return value::of(std::move(out));
  }

  // Python <, for values of one kind.
  bool less(const value& l, const value& r, const std::string& op, int line) {
    if (l.is_undefined()) fail_undefined(line, l);
    if (r.is_undefined()) fail_undefined(line, r);
    if (l.is_number() && r.is_number()) {
      if (l.is_int() && r.is_int()) return as_int(l) < as_int(r);
      return as_float(l) < as_float(r);
    }
    if (l.is_string() && r.is_string()) return l.str() < r.str();
    if (l.is_array() && r.is_array()) {
      const json& a = *l.j;
      const json& b = *r.j;
      for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
        if (py_eq(a[i], b[i])) continue;
        return less(l.child(&a[i]), r.child(&b[i]), op, line);
      }
      return a.size() < b.size();
    }
    fail(line, "'" + op + "' not supported between instances of '" + type_name(l) + "' and '" +
                   type_name(r) + "'");
  }

  bool contains(const value& container, const value& item, int line) {
    switch (container.kind) {
      case vkind::undefined:
        return false;
      case vkind::ns:
      case vkind::function:
        fail(line, "argument of type '" + type_name(container) + "' is not iterable");
      case vkind::json:
        break;
    }
    const json& c = *container.j;
    if (c.is_string()) {
      if (!item.is_string())
        fail(line, "'in <string>' requires string as left operand, not " + type_name(item));
      return container.str().find(item.str()) != std::string::npos;
    }
    if (c.is_array()) {
      for (const auto& x : c)
        if (value_eq(container.child(&x), item)) return true;
      return false;
    }
    if (c.is_object()) {
      if (item.is_array() || item.is_object() || item.kind == vkind::ns)
        fail(line, "unhashable type: '" + type_name(item) + "'");
      return item.is_string() && c.find(item.str()) != c.end();
    }
    fail(line, "argument of type '" + type_name(container) + "' is not iterable");
  }

  bool compare(const std::string& op, const value& l, const value& r, int line) {
    if (op == "==") return value_eq(l, r);
    if (op == "!=") return !value_eq(l, r);
    if (op == "<") return less(l, r, op, line);
    if (op == ">") return less(r, l, op, line);
    if (op == "<=") return less(l, r, op, line) || value_eq(l, r);
    if (op == ">=") return less(r, l, op, line) || value_eq(l, r);
    if (op == "in") return contains(r, l, line);
    if (op == "notin") return !contains(r, l, line);
    fail(line, "unknown comparison " + op);
  }

  // iter(v) as a list.
  std::vector<value> iterate(const value& v, int line) {
    std::vector<value> out;
    switch (v.kind) {
      case vkind::undefined:
        return out;
      case vkind::ns:
      case vkind::function:
        fail(line, "'" + type_name(v) + "' object is not iterable");
      case vkind::json:
        break;
    }
    const json& j = *v.j;
    if (j.is_array()) {
      out.reserve(j.size());
      for (const auto& x : j) out.push_back(v.child(&x));
    } else if (j.is_object()) {
      for (const auto& [k, x] : j.items()) out.push_back(str_value(k));
    } else if (j.is_string()) {
      const std::string& s = v.str();
      for (std::size_t i = 0; i < s.size();) {
        std::string ch;
        append_cp(ch, next_cp(s, i));
        out.push_back(str_value(std::move(ch)));
      }
    } else {
      fail(line, "'" + type_name(v) + "' object is not iterable");
    }
    return out;
  }

  static json to_array(const std::vector<value>& items, int line) {
    json out = json::array();
    for (const auto& v : items) out.push_back(to_json(v, line));
    return out;
  }

  // An attribute path for map/selectattr/sort: "a.b.0".
  value get_path(const value& obj, const std::string& path, int line) {
    value cur = obj;
    std::size_t start = 0;
    while (true) {
      const std::size_t dot = path.find('.', start);
      const std::string part =
          path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      const bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) {
        return std::isdigit(static_cast<unsigned char>(c));
      });
      cur = numeric ? get_item(cur, int_value(std::stoll(part)), line)
                    : get_item(cur, str_value(part), line);
      if (dot == std::string::npos) return cur;
      start = dot + 1;
    }
  }

  // ---- methods of str, dict and list ----

  static bool has_method(const json& j, std::string_view name) {
    static constexpr std::string_view str_methods[] = {
        "strip",        "lstrip",  "rstrip",  "split",   "rsplit",  "splitlines", "startswith",
        "endswith",     "replace", "upper",   "lower",   "title",   "capitalize", "swapcase",
        "find",         "rfind",   "index",   "rindex",  "count",   "join",       "isdigit",
        "isalpha",      "isalnum", "isspace", "isupper", "islower", "format",     "removeprefix",
        "removesuffix", "zfill",   "center",  "ljust",   "rjust"};
    static constexpr std::string_view dict_methods[] = {"items",      "keys", "values",  "get",
                                                        "copy",       "pop",  "popitem", "update",
                                                        "setdefault", "clear"};
    static constexpr std::string_view list_methods[] = {"index",   "count",  "copy", "append",
                                                        "extend",  "insert", "pop",  "remove",
                                                        "reverse", "sort",   "clear"};
    auto in = [&](const auto& names) {
      return std::find(std::begin(names), std::end(names), name) != std::end(names);
    };
    if (j.is_string()) return in(str_methods);
    if (j.is_object()) return in(dict_methods);
    if (j.is_array()) return in(list_methods);
    return false;
  }

  value bound_method(const value& self, const std::string& name) {
    return value::of_fn(name,
                        [this, self, name](call_args& a) { return call_method(self, name, a); });
  }

  value call_method(const value& self, const std::string& name, call_args& a) {
    const int line = a.line;
    const json& j = *self.j;
    if (j.is_object()) {
      if (name == "items") {
        json out = json::array();
        for (const auto& [k, v] : j.items()) out.push_back(json::array({k, v}));
        return value::of(std::move(out));
      }
      if (name == "keys") {
        json out = json::array();
        for (const auto& [k, v] : j.items()) out.push_back(k);
        return value::of(std::move(out));
      }
      if (name == "values") {
        json out = json::array();
        for (const auto& [k, v] : j.items()) out.push_back(v);
        return value::of(std::move(out));
      }
      if (name == "get") {
        const value* key = a.get(0, "key");
        if (!key) fail(line, "get expected at least 1 argument, got 0");
        if (key->is_string()) {
          const auto it = j.find(key->str());
          if (it != j.end()) return self.child(&*it);
        }
        const value* dflt = a.get(1, "default");
        return dflt ? *dflt : none_value();
      }
      if (name == "copy") return self;
      fail(line, "access to the mutating method '" + name + "' of dict is unsafe");
    }
    if (j.is_array()) {
      if (name == "copy") return self;
      if (name == "count" || name == "index") {
        const value* x = a.get(0, "value");
        if (!x) fail(line, name + "() takes exactly one argument");
        int64_t count = 0;
        for (std::size_t i = 0; i < j.size(); ++i) {
          if (!value_eq(self.child(&j[i]), *x)) continue;
          if (name == "index") return int_value(static_cast<int64_t>(i));
          ++count;
        }
        if (name == "index") fail(line, "value is not in list");
        return int_value(count);
      }
      fail(line, "access to the mutating method '" + name + "' of list is unsafe");
    }
    return call_str_method(self.str(), name, a);
  }

  static bool startswith_any(std::string_view s, const value& prefix, bool at_end, int line) {
    auto one = [&](const value& p) {
      if (!p.is_string()) fail(line, "expected str or a tuple of str, not " + type_name(p));
      const std::string& x = p.str();
      if (x.size() > s.size()) return false;
      return at_end ? s.substr(s.size() - x.size()) == x : s.substr(0, x.size()) == x;
    };
    if (prefix.is_array()) {
      for (const auto& x : *prefix.j)
        if (one(prefix.child(&x))) return true;
      return false;
    }
    return one(prefix);
  }

  value call_str_method(const std::string& s, const std::string& name, call_args& a) {
    const int line = a.line;
    if (name == "strip" || name == "lstrip" || name == "rstrip")
      return str_value(
          py_strip(s, chars_arg(a.get(0, "chars"), line), name != "rstrip", name != "lstrip"));
    if (name == "split" || name == "rsplit")
      return value::of(py_split(s, a.get(0, "sep"),
                                int_arg(a.get(1, "maxsplit"), -1, line, "maxsplit"),
                                name == "rsplit", line));
    if (name == "splitlines") {
      json out = json::array();
      for (auto& l : py_splitlines(s, bool_arg(a.get(0, "keepends"), false))) out.push_back(l);
      return value::of(std::move(out));
    }
    if (name == "startswith" || name == "endswith") {
      const value* p = a.get(0, "prefix");
      if (!p) fail(line, name + "() takes at least 1 argument (0 given)");
      return bool_value(startswith_any(s, *p, name == "endswith", line));
    }
    if (name == "replace") {
      const value* old = a.get(0, "old");
      const value* repl = a.get(1, "new");
      if (!old || !repl || !old->is_string() || !repl->is_string())
        fail(line, "replace() takes two str arguments");
      return str_value(
          py_replace(s, old->str(), repl->str(), int_arg(a.get(2, "count"), -1, line, "count")));
    }
    if (name == "upper") return str_value(py_upper(s));
    if (name == "lower") return str_value(map_cps(s, to_lower));
    if (name == "title") return str_value(py_title(s));
    if (name == "capitalize") return str_value(py_capitalize(s));
    if (name == "swapcase")
      return str_value(map_cps(s, [](char32_t c) {
        return category(c) == UTF8PROC_CATEGORY_LU ? to_lower(c) : to_upper(c);
      }));
    if (name == "find" || name == "rfind" || name == "index" || name == "rindex" ||
        name == "count") {
      const value* sub = a.get(0, "sub");
      if (!sub || !sub->is_string()) fail(line, name + "() takes a str argument");
      const std::string& x = sub->str();
      if (name == "count") {
        if (x.empty()) return int_value(static_cast<int64_t>(cp_count(s)) + 1);
        int64_t n = 0;
        for (std::size_t p = s.find(x); p != std::string::npos; p = s.find(x, p + x.size())) ++n;
        return int_value(n);
      }
      const bool right = name[0] == 'r';
      const std::size_t hit = right ? s.rfind(x) : s.find(x);
      if (hit == std::string::npos) {
        if (name == "index" || name == "rindex") fail(line, "substring not found");
        return int_value(-1);
      }
      return int_value(static_cast<int64_t>(cp_count(std::string_view(s).substr(0, hit))));
    }
    if (name == "join") {
      const value* items = a.get(0, "iterable");
      if (!items) fail(line, "join() takes exactly one argument (0 given)");
      std::string out;
      bool first = true;
      for (const value& v : iterate(*items, line)) {
        if (!v.is_string())
          fail(line, "sequence item: expected str instance, " + type_name(v) + " found");
        if (!first) out += s;
        first = false;
        out += v.str();
      }
      return str_value(std::move(out));
    }
    if (name == "removeprefix" || name == "removesuffix") {
      const value* x = a.get(0, "prefix");
      if (!x || !x->is_string()) fail(line, name + "() takes a str argument");
      const std::string& p = x->str();
      if (name == "removeprefix")
        return str_value(s.compare(0, p.size(), p) == 0 ? s.substr(p.size()) : s);
      return str_value(s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0
                           ? s.substr(0, s.size() - p.size())
                           : s);
    }
    if (name == "zfill" || name == "center" || name == "ljust" || name == "rjust") {
      const int64_t width = int_arg(a.get(0, "width"), 0, line, "width");
      const std::u32string cps = decode(s);
      const auto n = static_cast<int64_t>(cps.size());
      if (width <= n) return str_value(s);
      char32_t fill = name == "zfill" ? U'0' : U' ';
      if (const value* f = a.get(1, "fillchar"); f && name != "zfill") {
        if (!f->is_string() || cp_count(f->str()) != 1)
          fail(line, "The fill character must be exactly one character long");
        fill = decode(f->str())[0];
      }
      const auto pad = static_cast<std::size_t>(width - n);
      std::u32string out;
      if (name == "ljust") {
        out = cps + std::u32string(pad, fill);
      } else if (name == "rjust") {
        out = std::u32string(pad, fill) + cps;
      } else if (name == "center") {
        // CPython: left = pad / 2 + (pad & width & 1)
        const std::size_t left = pad / 2 + (pad & static_cast<std::size_t>(width) & 1);
        out = std::u32string(left, fill) + cps + std::u32string(pad - left, fill);
      } else {
        const bool sign = !cps.empty() && (cps[0] == '+' || cps[0] == '-');
        out =
            (sign ? cps.substr(0, 1) : U"") + std::u32string(pad, U'0') + cps.substr(sign ? 1 : 0);
      }
      return str_value(encode(out));
    }
    if (name == "format") return str_value(py_format(s, a));
    // is* predicates
    const std::u32string cps = decode(s);
    if (cps.empty()) return bool_value(false);
    auto all = [&](auto pred) { return bool_value(std::all_of(cps.begin(), cps.end(), pred)); };
    if (name == "isdigit") return all(is_digit);
    if (name == "isalpha") return all(is_letter);
    if (name == "isalnum") return all([](char32_t c) { return is_letter(c) || is_digit(c); });
    if (name == "isspace") return all(py_isspace);
    if (name == "isupper" || name == "islower") {
      bool any_cased = false;
      for (char32_t c : cps) {
        const auto cat = category(c);
        if (cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LT) {
          if (name == "islower") return bool_value(false);
          any_cased = true;
        } else if (cat == UTF8PROC_CATEGORY_LL) {
          if (name == "isupper") return bool_value(false);
          any_cased = true;
        }
      }
      return bool_value(any_cased);
    }
    fail(line, "'str' object has no method '" + name + "'");
  }

  // str.format with {}, {0} and {name} fields (no format specs or conversions).
  std::string py_format(const std::string& s, const call_args& a) {
    std::string out;
    std::size_t auto_index = 0;
    for (std::size_t i = 0; i < s.size(); ++i) {
      const char c = s[i];
      if (c == '{' && i + 1 < s.size() && s[i + 1] == '{') {
        out.push_back('{');
        ++i;
      } else if (c == '}' && i + 1 < s.size() && s[i + 1] == '}') {
        out.push_back('}');
        ++i;
      } else if (c == '{') {
        const std::size_t close = s.find('}', i);
        if (close == std::string::npos) fail(a.line, "Single '{' encountered in format string");
        const std::string field = s.substr(i + 1, close - i - 1);
        if (field.find_first_of(":!") != std::string::npos)
          fail(a.line, "format specs and conversions are not supported in str.format");
        const value* v = nullptr;
        if (field.empty()) {
          if (auto_index < a.pos.size()) v = &a.pos[auto_index];
          ++auto_index;
        } else if (std::all_of(field.begin(), field.end(), [](char d) {
                     return std::isdigit(static_cast<unsigned char>(d));
                   })) {
          const auto k = static_cast<std::size_t>(std::stoul(field));
          if (k < a.pos.size()) v = &a.pos[k];
        } else {
          for (const auto& [k, x] : a.kw)
            if (k == field) v = &x;
        }
        if (!v) fail(a.line, "missing argument for format field '{" + field + "}'");
        out += to_str(*v);
        i = close;
      } else if (c == '}') {
        fail(a.line, "Single '}' encountered in format string");
      } else {
        out.push_back(c);
      }
    }
    return out;
  }

  // ---- tests ----

  bool apply_test(const expr& e, const value& v) {
    call_args a = eval_args(e, 1);
    return run_test(e.name, v, a);
  }

  bool run_test(const std::string& name, const value& v, call_args& a) {
    const int line = a.line;
    auto arg = [&]() -> const value& {
      if (a.pos.empty()) fail(line, "test '" + name + "' takes an argument");
      return a.pos[0];
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "boolean") return v.is_bool();
    if (name == "true") return v.is_bool() && v.j->get<bool>();
    if (name == "false") return v.is_bool() && !v.j->get<bool>();
    if (name == "integer") return v.is_json() && v.j->is_number_integer();
    if (name == "float") return v.is_json() && v.j->is_number_float();
    if (name == "number") return v.is_number();
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.is_object();
    if (name == "iterable")
      return v.is_undefined() || v.is_string() || v.is_array() || v.is_object();
    if (name == "sequence")
      return v.is_undefined() || v.is_string() || v.is_array() || v.is_object();
    if (name == "callable") return v.kind == vkind::function;
    if (name == "sameas") {
      const value& o = arg();
      if (v.is_json() && o.is_json()) {
        if (v.j->is_null() || v.j->is_boolean()) return v.j->type() == o.j->type() && *v.j == *o.j;
        return v.j == o.j;
      }
      return value_eq(v, o) && v.kind != vkind::json;
    }
    if (name == "odd" || name == "even" || name == "divisibleby") {
      // value % 2 == 1, value % 2 == 0, value % num == 0, with Python's %.
      const value divisor = name == "divisibleby" ? arg() : int_value(2);
      const value rest = binary("%", v, divisor, line);
      return value_eq(rest, int_value(name == "odd" ? 1 : 0));
    }
    if (name == "lower" || name == "upper") {  // str(value).islower() / .isupper()
      call_args none;
      none.line = line;
      return truthy(call_str_method(to_str(v), name == "lower" ? "islower" : "isupper", none));
    }
    if (name == "eq" || name == "equalto" || name == "==") return value_eq(v, arg());
    if (name == "ne" || name == "!=") return !value_eq(v, arg());
    if (name == "lt" || name == "lessthan" || name == "<") return compare("<", v, arg(), line);
    if (name == "le" || name == "<=") return compare("<=", v, arg(), line);
    if (name == "gt" || name == "greaterthan" || name == ">") return compare(">", v, arg(), line);
    if (name == "ge" || name == ">=") return compare(">=", v, arg(), line);
    if (name == "in") return contains(arg(), v, line);
    if (name == "escaped") return false;
    fail(line, "No test named '" + name + "'.");
  }

  // ---- filters ----

  value apply_filter(const expr& f, value input) {
    call_args a = eval_args(f, 1);
    return run_filter(f.name, input, a);
  }

  value tojson(const value& v, const call_args& a) {
    // HF's override: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
    dump_options o;
    o.ensure_ascii = bool_arg(a.get(0, "ensure_ascii"), false);
    if (const value* ind = a.get(1, "indent"); ind && !ind->is_none()) {
      if (ind->is_string()) {
        o.indent = ind->str();
      } else if (ind->is_int()) {
        o.indent = std::string(static_cast<std::size_t>(std::max<int64_t>(0, as_int(*ind))), ' ');
      } else {
        fail(a.line, "tojson indent must be an integer or a string");
      }
      o.item_sep = ",";
    }
    if (const value* sep = a.get(2, "separators"); sep && !sep->is_none()) {
      if (!sep->is_array() || sep->j->size() != 2 || !(*sep->j)[0].is_string() ||
          !(*sep->j)[1].is_string())
        fail(a.line, "tojson separators must be a pair of strings");
      o.item_sep = (*sep->j)[0].get<std::string>();
      o.key_sep = (*sep->j)[1].get<std::string>();
    }
    o.sort_keys = bool_arg(a.get(3, "sort_keys"), false);
    if (v.is_undefined()) fail(a.line, "Object of type Undefined is not JSON serializable");
    if (!v.is_json()) fail(a.line, "Object of type " + type_name(v) + " is not JSON serializable");
    std::string out;
    json_dump(out, *v.j, o, 0);
    return str_value(std::move(out));
  }

  // The value a sort/unique/min/max compares: lower-cased strings unless case_sensitive.
  value compare_key(const value& v, bool case_sensitive) {
    if (!case_sensitive && v.is_string()) return str_value(map_cps(v.str(), to_lower));
    return v;
  }

  value run_filter(const std::string& name, const value& v, call_args& a) {
    const int line = a.line;
    auto need_str = [&]() { return to_str(v); };
    if (name == "safe") return v;
    if (name == "string") return v.is_string() ? v : str_value(to_str(v));
    if (name == "tojson") return tojson(v, a);
    if (name == "trim")
      return str_value(py_strip(need_str(), chars_arg(a.get(0, "chars"), line), true, true));
    if (name == "upper") return str_value(py_upper(need_str()));
    if (name == "lower") return str_value(map_cps(need_str(), to_lower));
    if (name == "capitalize") return str_value(py_capitalize(need_str()));
    if (name == "title") return str_value(jinja_title(need_str()));
    if (name == "escape" || name == "e") return str_value(html_escape(need_str()));
    if (name == "length" || name == "count") {
      if (v.is_undefined()) return int_value(0);
      if (v.is_string()) return int_value(static_cast<int64_t>(cp_count(v.str())));
      if (v.is_array() || v.is_object()) return int_value(static_cast<int64_t>(v.j->size()));
      fail(line, "object of type '" + type_name(v) + "' has no len()");
    }
    if (name == "default" || name == "d") {
      const value* dflt = a.get(0, "default_value");
      const bool boolean = bool_arg(a.get(1, "boolean"), false);
      if (v.is_undefined() || (boolean && !truthy(v))) return dflt ? *dflt : str_value("");
      return v;
    }
    if (name == "first" || name == "last") {
      std::vector<value> items = iterate(v, line);
      if (items.empty())
        return value::undefined(std::string("No ") + name + " item, sequence was empty.");
      return name == "first" ? items.front() : items.back();
    }
    if (name == "join") {
      const value* sep = a.get(0, "d");
      const value* attribute = a.get(1, "attribute");
      std::string out;
      bool first = true;
      for (const value& item : iterate(v, line)) {
        if (!first) out += sep ? to_str(*sep) : std::string();
        first = false;
        out += to_str(attribute ? get_path(item, to_str(*attribute), line) : item);
      }
      return str_value(std::move(out));
    }
    if (name == "replace") {
      const value* old = a.get(0, "old");
      const value* repl = a.get(1, "new");
      if (!old || !repl) fail(line, "replace takes an old and a new string");
      return str_value(py_replace(need_str(), to_str(*old), to_str(*repl),
                                  int_arg(a.get(2, "count"), -1, line, "count")));
    }
    if (name == "items") {
      if (v.is_undefined()) return value::of(json::array());
      if (!v.is_object()) fail(line, "Can only get item pairs from a mapping.");
      json out = json::array();
      for (const auto& [k, x] : v.j->items()) out.push_back(json::array({k, x}));
      return value::of(std::move(out));
    }
    if (name == "list") return value::of(to_array(iterate(v, line), line));
    if (name == "reverse") {
      if (v.is_string()) {
        std::u32string cps = decode(v.str());
        std::reverse(cps.begin(), cps.end());
        return str_value(encode(cps));
      }
      std::vector<value> items = iterate(v, line);
      std::reverse(items.begin(), items.end());
      return value::of(to_array(items, line));
    }
    if ((name == "int" || name == "float") && v.is_undefined()) fail_undefined(line, v);
    if (name == "int") {
      const value* dflt = a.get(0, "default");
      const int64_t base = int_arg(a.get(1, "base"), 10, line, "base");
      const value fallback = dflt ? *dflt : int_value(0);
      auto from_float = [&](double d) {
        if (!std::isfinite(d)) return fallback;
        if (std::fabs(d) >= 9223372036854775808.0) fail(line, "integer overflow (64-bit)");
        return int_value(static_cast<int64_t>(std::trunc(d)));
      };
      if (v.is_int()) return int_value(as_int(v));
      if (v.is_number()) return from_float(as_float(v));
      if (v.is_string()) {
        if (auto i = parse_py_int(v.str(), static_cast<int>(base))) return int_value(*i);
        if (auto d = parse_py_float(v.str())) return from_float(*d);
      }
      return fallback;
    }
    if (name == "float") {
      const value* dflt = a.get(0, "default");
      const value fallback = dflt ? *dflt : float_value(0.0);
      if (v.is_number()) return float_value(as_float(v));
      if (v.is_string())
        if (auto d = parse_py_float(v.str())) return float_value(*d);
      return fallback;
    }
    if (name == "abs") {
      if (!v.is_number()) fail(line, "bad operand type for abs(): '" + type_name(v) + "'");
      if (v.is_int()) return int_value(std::llabs(as_int(v)));
      return float_value(std::fabs(as_float(v)));
    }
    if (name == "round") {
      if (!v.is_number()) fail(line, "round needs a number, got " + type_name(v));
      const int64_t precision = int_arg(a.get(0, "precision"), 0, line, "precision");
      const value* method_v = a.get(1, "method");
      const std::string method = method_v ? to_str(*method_v) : "common";
      const double scale = std::pow(10.0, static_cast<double>(precision));
      const double x = as_float(v) * scale;
      double r = 0;
      if (method == "common" && v.is_int()) {  // round(int, n) stays an int
        if (precision >= 0) return int_value(as_int(v));
        return int_value(static_cast<int64_t>(std::nearbyint(x) / scale));
      }
      if (method == "common") {
        r = std::nearbyint(x);  // round-half-even, as Python's round()
      } else if (method == "ceil") {
        r = std::ceil(x);
      } else if (method == "floor") {
        r = std::floor(x);
      } else {
        fail(line, "method must be common, ceil or floor");
      }
      return float_value(r / scale);
    }
    if (name == "indent") {
      if (v.is_undefined()) fail_undefined(line, v);
      if (!v.is_string()) fail(line, "indent needs a string, not " + type_name(v));
      const value* width_v = a.get(0, "width");
      std::string indention = "    ";
      if (width_v)
        indention = width_v->is_string() ? width_v->str()
                                         : std::string(static_cast<std::size_t>(std::max<int64_t>(
                                                           0, int_arg(width_v, 4, line, "width"))),
                                                       ' ');
      const bool first = bool_arg(a.get(1, "first"), false);
      const bool blank = bool_arg(a.get(2, "blank"), false);
      const std::vector<std::string> lines = py_splitlines(need_str() + "\n", false);
      std::string out;
      for (std::size_t i = 0; i < lines.size(); ++i) {
        if (i > 0) {
          out += "\n";
          if (blank || !lines[i].empty()) out += indention;
        }
        out += lines[i];
      }
      if (first) out = indention + out;
      return str_value(std::move(out));
    }
    if (name == "wordcount") {
      int64_t n = 0;
      bool in_word = false;
      const std::string s = need_str();
      for (std::size_t i = 0; i < s.size();) {
        const char32_t c = next_cp(s, i);
        const bool w = is_letter(c) || is_digit(c) || c == '_';
        if (w && !in_word) ++n;
        in_word = w;
      }
      return int_value(n);
    }
    if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
      const bool by_attr = name.size() > 6;
      const bool keep_match = name[0] == 's';
      std::size_t next = 0;
      std::string attribute;
      if (by_attr) {
        if (a.pos.empty()) fail(line, name + " needs an attribute name");
        attribute = to_str(a.pos[next++]);
      }
      std::string test;
      if (next < a.pos.size()) test = to_str(a.pos[next++]);
      call_args test_args;
      test_args.line = line;
      test_args.pos.assign(a.pos.begin() + static_cast<std::ptrdiff_t>(next), a.pos.end());
      test_args.kw = a.kw;
      std::vector<value> kept;
      if (!truthy(v)) return value::of(json::array());  // Jinja: `if value:` first
      for (const value& item : iterate(v, line)) {
        const value probe = by_attr ? get_path(item, attribute, line) : item;
        const bool hit = test.empty() ? truthy(probe) : run_test(test, probe, test_args);
        if (hit == keep_match) kept.push_back(item);
      }
      return value::of(to_array(kept, line));
    }
    if (name == "map") {
      std::vector<value> out;
      if (!truthy(v)) return value::of(json::array());  // Jinja: `if value:` first
      const value* attribute = nullptr;
      for (const auto& [k, x] : a.kw)
        if (k == "attribute") attribute = &x;
      if (attribute) {
        const value* dflt = nullptr;
        for (const auto& [k, x] : a.kw)
          if (k == "default") dflt = &x;
        for (const value& item : iterate(v, line)) {
          value got = get_path(item, to_str(*attribute), line);
          out.push_back(got.is_undefined() && dflt ? *dflt : got);
        }
      } else {
        if (a.pos.empty()) fail(line, "map requires a filter argument");
        const std::string filter = to_str(a.pos[0]);
        call_args rest;
        rest.line = line;
        rest.pos.assign(a.pos.begin() + 1, a.pos.end());
        rest.kw = a.kw;
        for (const value& item : iterate(v, line)) {
          call_args each = rest;
          out.push_back(run_filter(filter, item, each));
        }
      }
      return value::of(to_array(out, line));
    }
    if (name == "unique" || name == "sort" || name == "min" || name == "max") {
      bool case_sensitive = false;
      const value* attribute = nullptr;
      bool reverse = false;
      for (const auto& [k, x] : a.kw) {
        if (k == "case_sensitive") case_sensitive = truthy(x);
        if (k == "attribute") attribute = &x;
        if (k == "reverse") reverse = truthy(x);
      }
      if (name == "sort" && !a.pos.empty()) reverse = truthy(a.pos[0]);
      if (name == "sort" && a.pos.size() > 1) case_sensitive = truthy(a.pos[1]);
      if (name != "sort" && !a.pos.empty()) case_sensitive = truthy(a.pos[0]);
      std::vector<value> items = iterate(v, line);
      auto key = [&](const value& item) {
        return compare_key(attribute ? get_path(item, to_str(*attribute), line) : item,
                           case_sensitive);
      };
      if (name == "unique") {
        std::vector<value> out, seen;
        for (const value& item : items) {
          const value k = key(item);
          bool dup = false;
          for (const value& s : seen) dup = dup || value_eq(s, k);
          if (dup) continue;
          seen.push_back(k);
          out.push_back(item);
        }
        return value::of(to_array(out, line));
      }
      if (name == "sort") {
        std::vector<std::pair<value, value>> keyed;
        for (const value& item : items) keyed.emplace_back(key(item), item);
        std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
          return reverse ? less(y.first, x.first, "<", line) : less(x.first, y.first, "<", line);
        });
        std::vector<value> out;
        for (auto& [k, item] : keyed) out.push_back(item);
        return value::of(to_array(out, line));
      }
      if (items.empty()) return value::undefined("No aggregated item, sequence was empty.");
      std::size_t best = 0;
      for (std::size_t i = 1; i < items.size(); ++i) {
        const bool better = name == "min" ? less(key(items[i]), key(items[best]), "<", line)
                                          : less(key(items[best]), key(items[i]), "<", line);
        if (better) best = i;
      }
      return items[best];
    }
    if (name == "sum") {
      const value* attribute = a.get(0, "attribute");
      value total = a.get(1, "start") ? *a.get(1, "start") : int_value(0);
      for (const value& item : iterate(v, line))
        total =
            binary("+", total, attribute ? get_path(item, to_str(*attribute), line) : item, line);
      return total;
    }
    if (name == "dictsort") {
      if (!v.is_object()) fail(line, "dictsort needs a dict");
      const bool case_sensitive = bool_arg(a.get(0, "case_sensitive"), false);
      const value* by_v = a.get(1, "by");
      const bool by_value = by_v && to_str(*by_v) == "value";
      const bool reverse = bool_arg(a.get(2, "reverse"), false);
      std::vector<std::pair<value, json>> keyed;
      for (const auto& [k, x] : v.j->items())
        keyed.emplace_back(compare_key(by_value ? v.child(&x) : str_value(k), case_sensitive),
                           json::array({k, x}));
      std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
        return reverse ? less(y.first, x.first, "<", line) : less(x.first, y.first, "<", line);
      });
      json out = json::array();
      for (auto& [k, pair] : keyed) out.push_back(std::move(pair));
      return value::of(std::move(out));
    }
    fail(line, "No filter named '" + name + "'.");
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// chat_template
// ---------------------------------------------------------------------------------------------

struct chat_template::program {
  body root;
  std::vector<std::string> fresh;  // names that start out undefined in the top frame
};

chat_template::chat_template(std::string source) : source_(std::move(source)) {
  auto p = std::make_shared<program>();
  p->root = parser(lexer(source_).run()).parse_template();
  p->fresh = scope_analyzer().analyze_root(p->root);
  program_ = std::move(p);
}

std::string chat_template::render(const nlohmann::ordered_json& context) const {
  // The caller's context outlives the render: refer to it without copying or owning it.
  std::shared_ptr<const json> view(std::shared_ptr<const json>{}, &context);
  return renderer(context, std::move(view)).run(program_->root, program_->fresh);
}

std::string chat_template::render(const nlohmann::json& context) const {
  const nlohmann::ordered_json ordered(context);
  return render(ordered);
}

std::string chat_template::render_chat(const nlohmann::ordered_json& messages,
                                       bool add_generation_prompt, std::string_view bos_token,
                                       std::string_view eos_token) const {
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  context["messages"] = messages;
  context["tools"] = nullptr;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = add_generation_prompt;
  context["bos_token"] = std::string(bos_token);
  context["eos_token"] = std::string(eos_token);
  return render(context);
}

}  // namespace duet
