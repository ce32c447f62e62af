#pragma once
// Fine-tuning records: JSONL in, documents with a target mask out.
//
// `scaletrain prepare` reads JSON-lines files (plain, .gz or .zst, or a
// directory of them) where every line is one record of one kind:
//   text                  {"text": "..."}                 every token a target
//   prompt / completion   {"prompt": "...", "completion": "..."}
//                         targets: the completion and the EOS after it
//   messages              {"messages": [{"role": ..., "content": ...}, ...]}
//                         rendered with the model's chat template
//                         (template/chat_template.h); targets: the
//                         assistant turns (Note [Assistant spans])
// Each record becomes one document of a version 2 token file (Note [Token
// file records] in token_file.h). Field names can be changed (--field).
//
// Note [Assistant spans]
// Which characters of a rendered conversation an assistant turn's targets
// are is found by rendering, not by guessing token patterns. Templates
// differ in what they print around a turn (Llama 3's base template appends
// the assistant header whatever add_generation_prompt says; Qwen3's prints an
// empty thinking block only in the last turn), so the turn is located by its
// own content: the conversation is rendered again with a marker character
// (U+E000, which no template trims or escapes) put before the turn's content,
// and again with it after; where each differs first from the real rendering
// is where the content starts and ends, after whatever the template did to
// it (trim, for one). The targets are that content and, when the text right
// after it begins with a special token of the tokenizer (<|eot_id|>,
// <|im_end|>, </s>), that end-of-turn token too, so the model learns to
// stop. The header before the content, a thinking block the template makes
// from reasoning_content, and the next turn's header are not targets. A
// template that does not print a turn's content (or only part of it) is
// refused for that record with the turn named. The text is tokenized segment
// by segment (no special tokens added: the template writes them); the tests
// check on real templates that this gives the tokens of the whole text.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "scaletrain/data/token_file.h"
#include "scaletrain/data/tokenizer.h"

namespace scaletrain::tmpl {
struct ChatTemplate;
}

namespace scaletrain::data {

struct RecordOptions {
  std::string text_field = "text";
  std::string prompt_field = "prompt";
  std::string completion_field = "completion";
  std::string messages_field = "messages";
  // Text and prompt/completion records: the BOS token before each record.
  bool add_special_tokens = false;
  // A Jinja chat template file for messages ("" = tokenizer_config.json's).
  std::string chat_template;
  // The tokenizer's path (file or directory): its tokenizer_config.json gives
  // bos_token, eos_token and chat_template.
  std::string tokenizer;
};

// Expands directories into their *.jsonl, *.jsonl.gz and *.jsonl.zst files
// (sorted by name); files are kept in the order given. Throws UsageError for
// a missing path or a directory without such files.
std::vector<std::string> jsonl_inputs(const std::vector<std::string>& paths);
// Whether `path` names JSON lines (by its extension) or a directory.
bool is_jsonl_path(const std::string& path);
// The bytes of `path`, decompressed when it ends in .gz or .zst.
std::string read_input(const std::string& path);
// Calls fn(record, line) for each non-empty line of `path` (1-based line
// numbers). A line that is not a JSON object throws UsageError "PATH:LINE: ...".
void for_each_jsonl(const std::string& path, const std::function<void(const nlohmann::ordered_json&, int64_t)>& fn);

// Turns records into documents. Not thread-safe (the tokenizer is not).
class RecordEncoder {
 public:
  RecordEncoder(Tokenizer& tokenizer, RecordOptions options);
  ~RecordEncoder();
  RecordEncoder(const RecordEncoder&) = delete;
  RecordEncoder& operator=(const RecordEncoder&) = delete;

  // Appends `record` as one document to `out`. The first record sets
  // out.kind; a later record of another kind, a missing or non-string field,
  // a role the template refuses: UsageError "WHERE: ..." (WHERE is FILE:LINE).
  void add(const nlohmann::ordered_json& record, const std::string& where, TokenRecords& out);

  // The text a messages record renders to (for samples and tests).
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt) const;
  // Character spans [begin, end) of the assistant turns (Note [Assistant spans]).
  std::vector<std::pair<std::size_t, std::size_t>> assistant_spans(const nlohmann::ordered_json& messages,
                                                                   const std::string& where) const;

 private:
  RecordKind kind_of(const nlohmann::ordered_json& record, const std::string& where) const;
  const tmpl::ChatTemplate& chat(const std::string& where);
  // The length of the special token `text` has at `at` (0 if none).
  std::size_t end_of_turn(const std::string& text, std::size_t at) const;
  void encode_segments(const std::string& text, const std::vector<std::pair<std::size_t, std::size_t>>& spans,
                       std::vector<uint32_t>& ids, std::vector<uint8_t>& targets);

  Tokenizer& tokenizer_;
  RecordOptions options_;
  std::string bos_, eos_;          // from tokenizer_config.json ("" = none)
  int64_t eos_id_ = -1;            // eos_ as one id, or -1
  std::unique_ptr<tmpl::ChatTemplate> chat_;
};

}  // namespace scaletrain::data
