#pragma once
// A Jinja subset for Hugging Face chat templates, rendering byte-for-byte as
// Python's jinja2 does in transformers (trim_blocks and lstrip_blocks on,
// loop controls, raise_exception, strftime_now, its tojson). See
// docs/chat-templates.md for what is supported and what is refused.
//
//   scaletrain::tmpl::Template t(source, "tokenizer_config.json chat_template");
//   std::string prompt = t.render({{"messages", messages}, {"add_generation_prompt", true}});
//
// Errors: a syntax error or an unsupported tag, filter or test throws
// UsageError when the template is constructed, a failure while rendering
// (an undefined variable's attribute, a type error) when it renders; both
// read "<source_name> line N: <problem>". A template's own
// raise_exception(message) throws RaisedError.
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "scaletrain/util/error.h"

namespace scaletrain::tmpl {

// Object keys keep their order (Python dicts do, and tojson prints them so);
// a nlohmann::json converts implicitly, its keys then in sorted order.
using Json = nlohmann::ordered_json;

struct Stmt;

// The template called raise_exception(message): what() is
// "<source_name>: <message>".
class RaisedError : public UsageError {
 public:
  RaisedError(const std::string& source_name, const std::string& message, int line)
      : UsageError(source_name + ": " + message), message_(message), line_(line) {}
  const std::string& message() const { return message_; }  // the template's own words
  int line() const { return line_; }                       // where raise_exception was called

 private:
  std::string message_;
  int line_;
};

struct TemplateOptions {
  bool trim_blocks = true;    // as transformers (and @huggingface/jinja) render chat templates
  bool lstrip_blocks = true;  // likewise
};

struct RenderOptions {
  // What strftime_now() formats: Unix seconds, shown in UTC. Absent: the
  // local time at the call, as transformers does.
  std::optional<int64_t> now;
};

class Template {
 public:
  // Parses once; throws UsageError naming `source_name` and the line.
  Template(const std::string& source_text, const std::string& source_name, const TemplateOptions& options = {});
  // Renders with the context's keys as variables. Thread-safe: a Template is
  // immutable, each call has its own state.
  std::string render(const Json& context, const RenderOptions& options = {}) const;
  const std::string& source_name() const { return source_name_; }
  const std::string& source_text() const { return source_text_; }

 private:
  std::string source_name_, source_text_;
  std::shared_ptr<const std::vector<std::unique_ptr<Stmt>>> body_;
};

}  // namespace scaletrain::tmpl
