#include "scaletrain/data/hf_tokenizer.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "scaletrain/data/bpe.h"
#include "scaletrain/data/text_pipeline.h"
#include "scaletrain/data/utf8.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/json.h"

namespace scaletrain::data {

using nlohmann::json;

namespace {

// Byte-level spelling -> raw bytes (Note [Byte-level vocabularies] in bpe.h);
// false if a character is outside the alphabet.
bool from_byte_level(const std::string& s, std::string& out) {
  out.clear();
  for (std::size_t i = 0, len = 0; i < s.size(); i += len) {
    const int b = byte_level_byte(utf8::decode(s, i, len));
    if (b < 0) return false;
    out.push_back(static_cast<char>(b));
  }
  return true;
}

std::string read_file(const std::string& path, const std::string& source) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw UsageError(source + ": " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw UsageError(source + ": not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(source + ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json parse_json(const std::string& path, const std::string& source) {
  return util::parse_json(read_file(path, source), source);  // Note [Strict JSON]
}

bool is_file(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Ids above this are refused: real vocabularies stay under 2^18, and a
// corrupt id must not turn into a multi-gigabyte table.
constexpr uint32_t kMaxTokenId = (1u << 24) - 1;

uint32_t checked_id(const json& j, const std::string& source, const std::string& what) {
  if (!j.is_number_unsigned() || j.get<uint64_t>() > kMaxTokenId)
    throw UsageError(source + ": " + what + " has id " + j.dump() + ", not an integer in [0, " +
                     std::to_string(kMaxTokenId) + "]");
  return j.get<uint32_t>();
}

// Leftmost-longest search for a set of strings (the added tokens), a byte trie.
class Matcher {
 public:
  bool empty() const { return nodes_.size() <= 1; }
  void add(const std::string& s, int token) {
    if (s.empty()) return;
    int node = 0;
    for (unsigned char c : s) {
      auto& next = nodes_[node].next;
      auto it = std::find_if(next.begin(), next.end(), [&](const auto& p) { return p.first == c; });
      if (it != next.end()) {
        node = it->second;
      } else {
        next.emplace_back(c, static_cast<int>(nodes_.size()));
        node = static_cast<int>(nodes_.size());
        nodes_.emplace_back();
      }
    }
    if (nodes_[node].token < 0) nodes_[node].token = token;  // the first of equal strings wins
    first_[static_cast<unsigned char>(s[0])] = true;
  }
  // The leftmost match at or after `from` (the longest there): [begin, end) and its token.
  bool find(std::string_view text, std::size_t from, std::size_t& begin, std::size_t& end, int& token) const {
    for (std::size_t i = from; i < text.size(); ++i) {
      if (!first_[static_cast<unsigned char>(text[i])]) continue;
      int node = 0, best = -1;
      std::size_t best_end = 0;
      for (std::size_t k = i; k < text.size(); ++k) {
        const auto& next = nodes_[node].next;
        auto it = std::find_if(next.begin(), next.end(),
                               [&](const auto& p) { return p.first == static_cast<unsigned char>(text[k]); });
        if (it == next.end()) break;
        node = it->second;
        if (nodes_[node].token >= 0) best = nodes_[node].token, best_end = k + 1;
      }
      if (best >= 0) {
        begin = i, end = best_end, token = best;
        return true;
      }
    }
    return false;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int>> next;
    int token = -1;
  };
  std::vector<Node> nodes_{1};
  bool first_[256] = {};
};

// A stretch of the input: text [begin, end), or an added token.
struct Piece {
  std::size_t begin, end;
  int added;  // index into added_, or -1 for text
};

std::size_t white_space_before(std::string_view t, std::size_t at, std::size_t floor) {
  while (at > floor) {
    std::size_t start = at - 1;
    while (start > floor && (static_cast<unsigned char>(t[start]) & 0xC0) == 0x80) --start;
    std::size_t len = 0;
    if (!utf8::is_white_space(utf8::decode(t, start, len))) break;
    at = start;
  }
  return at;
}

std::size_t white_space_after(std::string_view t, std::size_t at) {
  std::size_t len = 0;
  while (at < t.size() && utf8::is_white_space(utf8::decode(t, at, len))) at += len;
  return at;
}

}  // namespace

struct HfTokenizer::Impl {
  Impl(Normalizer n, PreTokenizer p, Decoder d) : normalizer(std::move(n)), pre(std::move(p)), decoder(std::move(d)) {}
  Normalizer normalizer;
  PreTokenizer pre;
  Decoder decoder;
  std::unique_ptr<BpeModel> bpe;
  Matcher raw_added, normalized_added;
  // Post-processor template for one sequence: an entry is the ids of a
  // special token, or (empty, is_sequence) for the encoded text.
  struct Item {
    std::vector<uint32_t> ids;
    bool is_sequence = false;
  };
  std::vector<Item> single;
  // Scratch reused across calls.
  std::vector<std::string_view> words;
  std::deque<std::string> storage;
  std::string normalized;
  std::vector<uint32_t> body;

  void split(const Matcher& m, const std::vector<AddedToken>& added, std::string_view text,
             std::vector<Piece>& out) const {
    out.clear();
    std::size_t pos = 0, from = 0, b = 0, e = 0;
    int tok = -1;
    while (!m.empty() && m.find(text, from, b, e, tok)) {
      const AddedToken& t = added[static_cast<std::size_t>(tok)];
      const std::size_t lb = t.lstrip ? white_space_before(text, b, pos) : b;
      const std::size_t re = t.rstrip ? white_space_after(text, e) : e;
      if (lb > pos) out.push_back({pos, lb, -1});
      out.push_back({lb, re, tok});
      pos = from = re;
    }
    if (pos < text.size()) out.push_back({pos, text.size(), -1});
  }
};

HfTokenizer::HfTokenizer(std::string file) : file_(std::move(file)) {}
HfTokenizer::~HfTokenizer() = default;

namespace {

void check_keys_we_ignore(const json& j, const std::string& source) {
  for (const char* key : {"truncation", "padding"})
    if (j.contains(key) && !j[key].is_null())
      throw UsageError(source + ": unsupported \"" + key + "\" (only null is supported: it changes the ids)");
}

std::vector<std::pair<std::string, std::string>> merges_of(const json& m, const std::string& source) {
  std::vector<std::pair<std::string, std::string>> merges;
  if (!m.contains("merges")) return merges;
  merges.reserve(m["merges"].size());
  for (const json& entry : m["merges"]) {
    if (entry.is_string()) {  // "a b" (tokens cannot contain a space in this form)
      const std::string s = entry.get<std::string>();
      const std::size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        throw UsageError(source + ": merge '" + s + "' is not two tokens separated by one space");
      merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
    } else if (entry.is_array() && entry.size() == 2) {  // ["a", "b"]
      merges.emplace_back(entry[0].get<std::string>(), entry[1].get<std::string>());
    } else {
      throw UsageError(source + ": a merge is neither \"a b\" nor [\"a\", \"b\"]");
    }
  }
  return merges;
}

}  // namespace

// Builds the BPE model from the "model" object (or GPT-2's two files, in the same shape).
static std::unique_ptr<BpeModel> build_model(const json& m, bool byte_level, const std::string& source,
                                             std::vector<std::string>& tokens) {
  const std::string type = m.value("type", std::string(m.contains("merges") ? "BPE" : ""));
  if (type != "BPE") throw UsageError(source + ": unsupported model type " + (type.empty() ? "(none)" : type));
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() != 0.0)
    throw UsageError(source + ": unsupported BPE dropout (ids would be random)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.contains(key) && m[key].is_string() && !m[key].get<std::string>().empty())
      throw UsageError(source + ": unsupported BPE " + key);
  if (!m.contains("vocab") || !m["vocab"].is_object()) throw UsageError(source + ": the model has no vocab object");

  std::unordered_map<std::string, uint32_t> vocab;
  vocab.reserve(m["vocab"].size());
  std::string raw;
  for (const auto& [spelling, id_json] : m["vocab"].items()) {
    const uint32_t id = checked_id(id_json, source, "token '" + spelling + "'");
    if (tokens.size() <= id) tokens.resize(static_cast<std::size_t>(id) + 1);
    tokens[id] = spelling;
    // A byte-level token outside the alphabet can never be produced by
    // merges; it stays decodable by id.
    if (!byte_level) {
      vocab.emplace(spelling, id);
    } else if (from_byte_level(spelling, raw)) {
      vocab.emplace(raw, id);
    }
  }
  auto merges = merges_of(m, source);
  if (byte_level) {
    for (auto& [a, b] : merges) {
      if (!from_byte_level(a, raw)) throw UsageError(source + ": merge token '" + a + "' is not byte-level");
      a = raw;
      if (!from_byte_level(b, raw)) throw UsageError(source + ": merge token '" + b + "' is not byte-level");
      b = raw;
    }
  }
  BpeOptions o;
  o.byte_level = byte_level;
  o.byte_fallback = m.value("byte_fallback", false);
  o.ignore_merges = m.value("ignore_merges", false);
  o.fuse_unk = m.value("fuse_unk", false);
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    const std::string unk = m["unk_token"].get<std::string>();
    auto it = m["vocab"].find(unk);
    if (it == m["vocab"].end()) throw UsageError(source + ": unk_token '" + unk + "' is not in the vocabulary");
    o.unk_id = it->get<uint32_t>();
  }
  return std::make_unique<BpeModel>(std::move(vocab), merges, o, source);
}

namespace {

// Where a tokenizer is: `file` (tokenizer.json, or a directory's), or GPT-2's
// two files.
struct TokenizerFiles {
  std::string file;
  bool gpt2_files = false;
  std::string vocab_file, merges_file;
};

TokenizerFiles find_files(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw UsageError("tokenizer " + path + ": " + std::strerror(errno));
  TokenizerFiles f;
  f.file = path;
  if (S_ISDIR(st.st_mode)) {
    const std::string dir = path.back() == '/' ? path : path + "/";
    if (is_file(dir + "tokenizer.json")) {
      f.file = dir + "tokenizer.json";
    } else if (is_file(dir + "encoder.json") && is_file(dir + "vocab.bpe")) {
      f.gpt2_files = true, f.vocab_file = dir + "encoder.json", f.merges_file = dir + "vocab.bpe";
    } else if (is_file(dir + "vocab.json") && is_file(dir + "merges.txt")) {
      f.gpt2_files = true, f.vocab_file = dir + "vocab.json", f.merges_file = dir + "merges.txt";
    } else {
      throw UsageError(
          "tokenizer " + path +
          ": the directory has no tokenizer.json (nor encoder.json + vocab.bpe, nor vocab.json + merges.txt)");
    }
  }
  return f;
}

// GPT-2's own release as a tokenizer.json "model": a byte-level vocabulary,
// one merge per line after a "#version" header.
json gpt2_model(const std::string& vocab_file, const std::string& merges_file, const std::string& source) {
  json model = {{"type", "BPE"}, {"vocab", parse_json(vocab_file, "tokenizer " + vocab_file)}};
  json merges = json::array();
  std::istringstream lines(read_file(merges_file, source));
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    merges.push_back(line);
  }
  model["merges"] = std::move(merges);
  return model;
}

// The added tokens of tokenizer.json `j`: into the vocabulary (`tokens`),
// `added`, and the matchers of `impl`.
void load_added_tokens(const json& j, const std::string& source, HfTokenizer::Impl& impl,
                       std::vector<std::string>& tokens, std::vector<AddedToken>& added) {
  for (const json& a : j.value("added_tokens", json::array())) {
    AddedToken tok;
    tok.id = checked_id(a.at("id"), source, "an added token");
    tok.content = a.at("content").get<std::string>();
    tok.special = a.value("special", false);
    tok.lstrip = a.value("lstrip", false);
    tok.rstrip = a.value("rstrip", false);
    tok.normalized = a.value("normalized", !tok.special);
    if (a.value("single_word", false))
      throw UsageError(source + ": unsupported single_word added token '" + tok.content + "'");
    if (tokens.size() <= tok.id) tokens.resize(static_cast<std::size_t>(tok.id) + 1);
    tokens[tok.id] = tok.content;
    const int index = static_cast<int>(added.size());
    if (tok.normalized && !impl.normalizer.empty()) {
      std::string n;
      impl.normalizer.apply(tok.content, n);
      impl.normalized_added.add(n, index);
    } else {
      (tok.normalized ? impl.normalized_added : impl.raw_added).add(tok.content, index);
    }
    added.push_back(std::move(tok));
  }
}

// Post-processor: only the single-sequence template matters for ids.
void load_post_processor(const json& j, const std::string& source, const std::vector<std::string>& tokens,
                         std::vector<HfTokenizer::Impl::Item>& single) {
  std::vector<json> processors;
  const json pp = j.value("post_processor", json());
  if (!pp.is_null()) {
    if (pp.value("type", "") == "Sequence")
      for (const json& p : pp.at("processors")) processors.push_back(p);
    else
      processors.push_back(pp);
  }
  for (const json& p : processors) {
    const std::string type = p.value("type", "");
    if (type == "ByteLevel") continue;  // only moves offsets
    if (type != "TemplateProcessing") throw UsageError(source + ": unsupported post_processor type " + type);
    single.clear();
    for (const json& item : p.at("single")) {
      HfTokenizer::Impl::Item it;
      if (item.contains("SpecialToken")) {
        const std::string name = item["SpecialToken"].at("id").get<std::string>();
        const json& specials = p.at("special_tokens");
        if (!specials.contains(name))
          throw UsageError(source + ": post_processor names special token '" + name + "' it does not define");
        for (const json& id : specials[name].at("ids")) {
          it.ids.push_back(checked_id(id, source, "post_processor token '" + name + "'"));
          if (it.ids.back() >= tokens.size() || tokens[it.ids.back()].empty())
            throw UsageError(source + ": post_processor token '" + name + "' has id " + std::to_string(it.ids.back()) +
                             ", which is not in the vocabulary");
        }
      } else if (item.contains("Sequence") && item["Sequence"].value("id", "A") == "A") {
        it.is_sequence = true;
      } else {
        throw UsageError(source + ": unsupported post_processor item " + item.dump());
      }
      single.push_back(std::move(it));
    }
  }
}

}  // namespace

std::unique_ptr<HfTokenizer> HfTokenizer::load(const std::string& path) {
  const auto [file, gpt2_files, vocab_file, merges_file] = find_files(path);
  try {
    if (gpt2_files) {
      // GPT-2's own release: a byte-level vocabulary, one merge per line after
      // a "#version" header, and the ByteLevel pre-tokenizer with its regex.
      const std::string source = "tokenizer " + merges_file;
      std::unique_ptr<HfTokenizer> t(new HfTokenizer(vocab_file));
      const json model = gpt2_model(vocab_file, merges_file, source);
      t->impl_ = std::make_unique<Impl>(Normalizer(nullptr, source),
                                        PreTokenizer(json{{"type", "ByteLevel"}, {"add_prefix_space", false}}, source),
                                        Decoder(json{{"type", "ByteLevel"}}, source));
      t->impl_->bpe = build_model(model, true, source, t->tokens_);
      t->special_.assign(t->tokens_.size(), false);
      return t;
    }

    const std::string source = "tokenizer " + file;
    const json j = parse_json(file, source);
    if (!j.is_object() || !j.contains("model"))
      throw UsageError(source + ": no \"model\" object (not a tokenizer.json?)");
    check_keys_we_ignore(j, source);
    std::unique_ptr<HfTokenizer> t(new HfTokenizer(file));
    t->impl_ = std::make_unique<Impl>(Normalizer(j.value("normalizer", json()), source),
                                      PreTokenizer(j.value("pre_tokenizer", json()), source),
                                      Decoder(j.value("decoder", json()), source));
    Impl& impl = *t->impl_;
    impl.bpe = build_model(j["model"], impl.pre.byte_level(), source, t->tokens_);

    load_added_tokens(j, source, impl, t->tokens_, t->added_);
    t->special_.assign(t->tokens_.size(), false);
    for (const auto& a : t->added_)
      if (a.special) t->special_[a.id] = true;

    load_post_processor(j, source, t->tokens_, impl.single);
    return t;
  } catch (const json::exception& e) {
    // A field of the wrong type or a missing required field.
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    throw UsageError("tokenizer " + file + ": malformed: " + what);
  }
}

const std::string& HfTokenizer::token(uint32_t id) const {
  static const std::string none;
  return id < tokens_.size() ? tokens_[id] : none;
}

std::optional<uint32_t> HfTokenizer::id_of(const std::string& token) const {
  for (const auto& a : added_)
    if (a.content == token) return a.id;
  for (uint32_t id = 0; id < tokens_.size(); ++id)
    if (tokens_[id] == token) return id;
  return std::nullopt;
}

void HfTokenizer::encode_segment(std::string_view text, bool at_start, std::vector<uint32_t>& out) {
  Impl& impl = *impl_;
  impl.storage.clear();
  impl.pre.apply(text, at_start, impl.words, impl.storage);
  for (std::string_view w : impl.words) impl.bpe->encode(w, out);
}

void HfTokenizer::encode(std::string_view text, std::vector<uint32_t>& out, bool add_special_tokens) {
  const std::size_t bad = utf8::invalid_at(text);
  if (bad != std::string_view::npos)
    throw UsageError("tokenizer " + file_ + ": the text is not valid UTF-8 (at byte " + std::to_string(bad) + ")");
  Impl& impl = *impl_;
  const bool templated = add_special_tokens && !impl.single.empty();
  std::vector<uint32_t>& ids = templated ? impl.body : out;
  if (templated) ids.clear();

  std::vector<Piece> pieces, inner;
  impl.split(impl.raw_added, added_, text, pieces);
  for (const Piece& p : pieces) {
    if (p.added >= 0) {
      ids.push_back(added_[static_cast<std::size_t>(p.added)].id);
      continue;
    }
    std::string_view segment = text.substr(p.begin, p.end - p.begin);
    const bool at_start = p.begin == 0;
    if (!impl.normalizer.empty()) {
      impl.normalizer.apply(segment, impl.normalized);
      segment = impl.normalized;
    }
    if (impl.normalized_added.empty()) {
      encode_segment(segment, at_start, ids);
      continue;
    }
    impl.split(impl.normalized_added, added_, segment, inner);
    for (const Piece& q : inner) {
      if (q.added >= 0) {
        ids.push_back(added_[static_cast<std::size_t>(q.added)].id);
      } else {
        encode_segment(segment.substr(q.begin, q.end - q.begin), at_start && q.begin == 0, ids);
      }
    }
  }
  if (!templated) return;
  for (const auto& item : impl.single) {
    if (item.is_sequence) {
      out.insert(out.end(), impl.body.begin(), impl.body.end());
    } else {
      out.insert(out.end(), item.ids.begin(), item.ids.end());
    }
  }
}

std::string HfTokenizer::decode(const uint32_t* ids, std::size_t count, bool skip_special_tokens) const {
  std::vector<std::string> spelled;
  spelled.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    const uint32_t id = ids[i];
    if (id >= tokens_.size() || tokens_[id].empty()) continue;
    if (skip_special_tokens && special_[id]) continue;
    spelled.push_back(tokens_[id]);
  }
  return impl_->decoder.apply(std::move(spelled));
}

}  // namespace scaletrain::data
