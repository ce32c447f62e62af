// Fine-tuning records to documents with a target mask (records.h).
#include "scaletrain/data/records.h"

#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <utility>

#include "scaletrain/util/error.h"
#include "scaletrain/util/json.h"

#include "scaletrain/template/chat_template.h"

namespace scaletrain::data {
namespace fs = std::filesystem;
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool jsonl_name(const std::string& name) {
  return ends_with(name, ".jsonl") || ends_with(name, ".jsonl.gz") || ends_with(name, ".jsonl.zst");
}

std::string read_plain(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("prepare: input " + path + ": cannot open");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string read_gzip(const std::string& path) {
  // zlib reads a file without the gzip magic as plain text: a .gz that is not
  // gzip is a mistake to name, not a text to train on.
  char head[2] = {0, 0};
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("prepare: input " + path + ": cannot open");
  in.read(head, 2);
  if (head[0] != '\x1f' || head[1] != '\x8b')
    throw UsageError("prepare: input " + path + ": not a gzip file (no gzip magic bytes)");
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) throw UsageError("prepare: input " + path + ": cannot open");
  std::string out;
  char buf[1 << 16];
  int n = 0;
  while ((n = gzread(f, buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  // A stream cut short reads as an end of file with Z_BUF_ERROR set, not as -1.
  int err = Z_OK;
  const std::string why = gzerror(f, &err);
  gzclose(f);
  if (n < 0 || err != Z_OK) throw UsageError("prepare: input " + path + ": not a valid gzip stream (" + why + ")");
  return out;
}

std::string read_zstd(const std::string& path) {
  const std::string packed = read_plain(path);
  std::unique_ptr<ZSTD_DCtx, decltype(&ZSTD_freeDCtx)> ctx(ZSTD_createDCtx(), ZSTD_freeDCtx);
  ZSTD_inBuffer in{packed.data(), packed.size(), 0};
  std::string out, chunk(ZSTD_DStreamOutSize(), '\0');
  std::size_t last = 1;
  while (in.pos < in.size) {
    ZSTD_outBuffer o{chunk.data(), chunk.size(), 0};
    last = ZSTD_decompressStream(ctx.get(), &o, &in);
    if (ZSTD_isError(last))
      throw UsageError("prepare: input " + path + ": not a valid zstd stream (" + ZSTD_getErrorName(last) + ")");
    out.append(chunk.data(), o.pos);
  }
  if (last != 0) throw UsageError("prepare: input " + path + ": zstd stream is cut short");
  return out;
}

// A string field of a record, or a one-line error naming it.
const std::string& string_field(const nlohmann::ordered_json& record, const std::string& name,
                                const std::string& where) {
  const auto it = record.find(name);
  if (it == record.end()) throw UsageError(where + ": the record has no \"" + name + "\" field");
  if (!it->is_string()) throw UsageError(where + ": field \"" + name + "\" is not a string");
  return it->get_ref<const std::string&>();
}

// bos_token / eos_token of a tokenizer_config.json: a string, or an added
// token object {"content": ...}; "" when absent or null.
std::string token_text(const nlohmann::json& config, const char* key) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    return (*it)["content"].get<std::string>();
  return "";
}

std::string tokenizer_config_path(const std::string& tokenizer) {
  if (tokenizer.empty()) return "";
  const fs::path p(tokenizer);
  const fs::path dir = fs::is_directory(p) ? p : p.parent_path();
  const fs::path config = dir / "tokenizer_config.json";
  return fs::exists(config) ? config.string() : "";
}

}  // namespace

bool is_jsonl_path(const std::string& path) { return jsonl_name(path) || fs::is_directory(path); }

std::vector<std::string> jsonl_inputs(const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  for (const auto& p : paths) {
    std::error_code ec;
    if (!fs::exists(p, ec)) throw UsageError("prepare: input " + p + ": no such file or directory");
    if (!fs::is_directory(p)) {
      out.push_back(p);
      continue;
    }
    std::vector<std::string> found;
    for (const auto& e : fs::directory_iterator(p))
      if (e.is_regular_file() && jsonl_name(e.path().filename().string())) found.push_back(e.path().string());
    if (found.empty()) throw UsageError("prepare: input " + p + ": no *.jsonl, *.jsonl.gz or *.jsonl.zst files");
    std::sort(found.begin(), found.end());
    out.insert(out.end(), found.begin(), found.end());
  }
  return out;
}

std::string read_input(const std::string& path) {
  if (ends_with(path, ".gz")) return read_gzip(path);
  if (ends_with(path, ".zst")) return read_zstd(path);
  return read_plain(path);
}

void for_each_jsonl(const std::string& path, const std::function<void(const nlohmann::ordered_json&, int64_t)>& fn) {
  const std::string text = read_input(path);
  std::size_t at = 0;
  for (int64_t line = 1; at < text.size(); ++line) {
    std::size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    std::string row = text.substr(at, end - at);
    at = end + 1;
    if (!row.empty() && row.back() == '\r') row.pop_back();
    if (row.find_first_not_of(" \t") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line);
    nlohmann::ordered_json record = util::parse_json_as<nlohmann::ordered_json>(row, where);
    if (!record.is_object()) throw UsageError(where + ": a record must be a JSON object");
    fn(record, line);
  }
}

RecordEncoder::RecordEncoder(Tokenizer& tokenizer, RecordOptions options)
    : tokenizer_(tokenizer), options_(std::move(options)) {
  const std::string config = tokenizer_config_path(options_.tokenizer);
  if (!config.empty()) {
    const nlohmann::json j = util::read_json_file(config, "tokenizer config " + config);
    bos_ = token_text(j, "bos_token");
    eos_ = token_text(j, "eos_token");
  }
  if (!eos_.empty()) {
    const std::vector<uint32_t> ids = tokenizer_.encode(eos_);
    if (ids.size() == 1) eos_id_ = ids[0];
  }
}

RecordEncoder::~RecordEncoder() = default;

RecordKind RecordEncoder::kind_of(const nlohmann::ordered_json& record, const std::string& where) const {
  if (record.contains(options_.messages_field)) return RecordKind::Messages;
  if (record.contains(options_.prompt_field) || record.contains(options_.completion_field))
    return RecordKind::PromptCompletion;
  if (record.contains(options_.text_field)) return RecordKind::Text;
  throw UsageError(where + ": the record has none of the fields \"" + options_.text_field + "\", \"" +
                   options_.prompt_field + "\" + \"" + options_.completion_field + "\", \"" + options_.messages_field +
                   "\" (choose others with --field)");
}

const tmpl::ChatTemplate& RecordEncoder::chat(const std::string& where) {
  if (chat_) return *chat_;
  if (!options_.chat_template.empty()) {
    chat_ = std::make_unique<tmpl::ChatTemplate>(tmpl::ChatTemplate::from_file(options_.chat_template, bos_, eos_));
    return *chat_;
  }
  const std::string config = tokenizer_config_path(options_.tokenizer);
  if (config.empty())
    throw UsageError(where +
                     ": messages need a chat template: --chat-template FILE, or a --tokenizer directory "
                     "whose tokenizer_config.json has one");
  chat_ = std::make_unique<tmpl::ChatTemplate>(tmpl::ChatTemplate::from_tokenizer_config(config));
  return *chat_;
}

std::string RecordEncoder::render(const nlohmann::ordered_json& messages, bool add_generation_prompt) const {
  if (!chat_) throw std::logic_error("RecordEncoder::render before a chat template was loaded");
  return chat_->render(messages, add_generation_prompt);
}

// Where `a` and `b` first differ.
static std::size_t common_prefix(const std::string& a, const std::string& b) {
  std::size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

std::vector<std::pair<std::size_t, std::size_t>> RecordEncoder::assistant_spans(const nlohmann::ordered_json& messages,
                                                                                const std::string& where) const {
  static const std::string kMarker = "\xEE\x80\x80";  // U+E000, private use
  const std::string whole = render(messages, false);
  auto marked = [&](std::size_t i, bool before) {
    nlohmann::ordered_json copy = messages;
    std::string& content = copy[i]["content"].get_ref<std::string&>();
    content = before ? kMarker + content : content + kMarker;
    return render(copy, false);
  };
  std::vector<std::pair<std::size_t, std::size_t>> spans;
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const auto& m = messages[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || m["role"] != "assistant") continue;
    const std::string turn = "message " + std::to_string(i) + " (assistant)";
    if (!m.contains("content") || !m["content"].is_string())
      throw UsageError(where + ": " + turn + ": its content must be a string");
    const std::string first = marked(i, true), last = marked(i, false);
    if (first == whole || last == whole)
      throw UsageError(where + ": " + turn +
                       ": the chat template does not print all of its content, so its targets "
                       "cannot be found (Note [Assistant spans])");
    const std::size_t begin = common_prefix(whole, first);
    std::size_t end = common_prefix(whole, last);
    if (end < begin || (!spans.empty() && begin < spans.back().second))
      throw UsageError(where + ": " + turn + ": the chat template prints its content out of order");
    end += end_of_turn(whole, end);
    spans.emplace_back(begin, end);
  }
  return spans;
}

std::size_t RecordEncoder::end_of_turn(const std::string& text, std::size_t at) const {
  if (at >= text.size()) return 0;
  const std::vector<uint32_t> ids = tokenizer_.encode(std::string_view(text).substr(at, 64), false);
  if (ids.empty()) return 0;
  const std::string shown = tokenizer_.decode({ids[0]}, false);
  const bool special = tokenizer_.decode({ids[0]}, true).empty() && !shown.empty();
  return special && text.compare(at, shown.size(), shown) == 0 ? shown.size() : 0;
}

void RecordEncoder::encode_segments(const std::string& text,
                                    const std::vector<std::pair<std::size_t, std::size_t>>& spans,
                                    std::vector<uint32_t>& ids, std::vector<uint8_t>& targets) {
  std::size_t at = 0;
  auto piece = [&](std::size_t begin, std::size_t end, uint8_t target) {
    if (end <= begin) return;
    tokenizer_.encode_append(std::string_view(text).substr(begin, end - begin), ids, false);
    targets.resize(ids.size(), target);
  };
  for (const auto& [begin, end] : spans) {
    piece(at, begin, 0);
    piece(begin, end, 1);
    at = end;
  }
  piece(at, text.size(), 0);
}

void RecordEncoder::add(const nlohmann::ordered_json& record, const std::string& where, TokenRecords& out) {
  const RecordKind kind = kind_of(record, where);
  if (out.documents() == 0) out.kind = kind;
  if (kind != out.kind)
    throw UsageError(where + ": a " + record_kind_name(kind) + " record among " + record_kind_name(out.kind) +
                     " records (one kind per dataset)");
  std::vector<uint32_t> ids;
  std::vector<uint8_t> targets;
  try {
    if (kind == RecordKind::Messages) {
      const auto& messages = record.at(options_.messages_field);
      if (!messages.is_array() || messages.empty())
        throw UsageError(where + ": \"" + options_.messages_field + "\" must be a non-empty list of messages");
      chat(where);
      const std::string text = render(messages, false);
      encode_segments(text, assistant_spans(messages, where), ids, targets);
    } else {
      if (options_.add_special_tokens && !bos_.empty()) encode_segments(bos_, {}, ids, targets);
      if (kind == RecordKind::Text) {
        const std::string& text = string_field(record, options_.text_field, where);
        encode_segments(text, {{0, text.size()}}, ids, targets);
      } else {
        encode_segments(string_field(record, options_.prompt_field, where), {}, ids, targets);
        const std::string& completion = string_field(record, options_.completion_field, where);
        encode_segments(completion, {{0, completion.size()}}, ids, targets);
        if (eos_id_ >= 0) {
          ids.push_back(static_cast<uint32_t>(eos_id_));
          targets.push_back(1);
        }
      }
    }
  } catch (const tmpl::RaisedError& e) {
    throw UsageError(where + ": the chat template refused the record: " + e.message());
  } catch (const UsageError& e) {
    const std::string what = e.what();
    if (what.compare(0, where.size(), where) == 0) throw;
    throw UsageError(where + ": " + what);
  }
  out.add(ids, targets);
}

}  // namespace scaletrain::data
