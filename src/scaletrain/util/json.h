#pragma once
// Reading the JSON files users give us (DeepSpeed configs, a Hub model's
// config.json and tokenizer.json, checkpoint indexes, adapter_config.json)
// as strictly as their owners do, with one-line errors.
//
// Note [Strict JSON]: RFC 8259 only says object names "should" be unique and
// nlohmann::json keeps the last of repeated keys, so {"stage": 2, "stage": 3}
// would silently mean 3; DeepSpeed (Python's json with an object hook) and
// Hugging Face's Rust tokenizers (serde) refuse it, and so do we. A number
// beyond double's range (1e400) is refused by name rather than by the
// library's exception text. Parse errors name the byte offset and show the
// bytes around it with anything unprintable escaped (\xNN), so a binary file
// never writes raw bytes to the terminal.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "scaletrain/util/error.h"

namespace scaletrain::util {

// Up to `radius` bytes either side of `at`, unprintable ones as \xNN.
inline std::string printable_excerpt(const std::string& text, size_t at, size_t radius = 16) {
  const size_t begin = at > radius ? at - radius : 0, end = std::min(text.size(), at + radius);
  std::string out;
  for (size_t i = begin; i < end; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

// The reason in a nlohmann::json message, without its "[json.exception...]"
// prefix, position and "last read" echo (which may hold raw bytes).
inline std::string json_reason(const std::string& what) {
  std::string r = what;
  if (auto end = r.find("] "); r.rfind("[json.exception", 0) == 0 && end != std::string::npos) r = r.substr(end + 2);
  if (auto colon = r.find(": "); r.rfind("parse error", 0) == 0 && colon != std::string::npos) r = r.substr(colon + 2);
  if (auto last = r.find("; last read"); last != std::string::npos) r = r.substr(0, last);
  if (auto dash = r.find(" - "); dash != std::string::npos) r = r.substr(dash + 3);
  for (char& c : r)
    if (c == '\n' || static_cast<unsigned char>(c) < 0x20) c = ' ';
  return r;
}

// Parses `text` (from `source`, named in every error) per Note [Strict JSON].
// Throws UsageError: "SOURCE: not valid JSON at byte N (REASON): ...EXCERPT...",
// "SOURCE: key 'a.b' appears twice in one object", "SOURCE: number ... is out of range".
// parse_json_as<nlohmann::ordered_json> keeps each object's keys in file order
// (what a chat template's tojson prints, as Python's dicts do).
template <typename json>
json parse_json_as(const std::string& text, const std::string& source) {
  std::vector<std::set<std::string>> seen;  // keys of each open object
  std::vector<std::string> path;            // the key being read at each depth
  std::string repeated;
  typename json::parser_callback_t check = [&](int /*depth*/, typename json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      seen.emplace_back();
      path.emplace_back();
    } else if (event == json::parse_event_t::object_end && !seen.empty()) {
      seen.pop_back();
      path.pop_back();
    } else if (event == json::parse_event_t::key && !seen.empty()) {
      const std::string key = parsed.template get<std::string>();
      path.back() = key;
      if (!seen.back().insert(key).second && repeated.empty()) {
        for (const std::string& k : path) repeated += (repeated.empty() ? "" : ".") + k;
      }
    }
    return true;
  };
  json out;
  try {
    out = json::parse(text, check);
  } catch (const typename json::parse_error& e) {
    const size_t at = e.byte > 0 ? e.byte - 1 : 0;
    throw UsageError(source + ": not valid JSON at byte " + std::to_string(at) + " (" + json_reason(e.what()) +
                     "): '" + printable_excerpt(text, at) + "'");
  } catch (const typename json::out_of_range& e) {
    throw UsageError(source + ": " + json_reason(e.what()) + " (beyond the range of a double)");
  } catch (const typename json::exception& e) {
    throw UsageError(source + ": not valid JSON (" + json_reason(e.what()) + ")");
  }
  if (!repeated.empty())
    throw UsageError(source + ": key '" + repeated + "' appears twice in one object (keys must be unique)");
  return out;
}

inline nlohmann::json parse_json(const std::string& text, const std::string& source) {
  return parse_json_as<nlohmann::json>(text, source);
}

// Reads the file at `path` and parses it as parse_json does.
inline nlohmann::json read_json_file(const std::string& path, const std::string& source) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(source + ": cannot be read");
  std::ostringstream ss;
  ss << in.rdbuf();
  return parse_json(ss.str(), source);
}

}  // namespace scaletrain::util
