#pragma once
// A model's chat template, as transformers' apply_chat_template renders it:
// the Jinja template from tokenizer_config.json (or a file), the special
// tokens it refers to, and the context transformers gives it (messages,
// tools, documents, add_generation_prompt, the special tokens, extra keys).
#include <memory>
#include <string>

#include "scaletrain/template/jinja.h"

namespace scaletrain::tmpl {

struct ChatTemplate {
  // From tokenizer_config.json: "chat_template" as a string, or a list of
  // {"name", "template"} (the one called `name`, "default" when name is empty).
  // bos_token / eos_token as strings or AddedToken objects {"content": ...}.
  // Throws UsageError naming the file when there is no (such) chat template.
  static ChatTemplate from_tokenizer_config(const std::string& path, const std::string& name = "");
  // A template file (a .jinja file as newer Hub repositories ship it).
  static ChatTemplate from_file(const std::string& template_path, std::string bos, std::string eos);

  // messages: a JSON array of {role, content, ...}; tools: a JSON array or
  // null; extra: an object whose keys join the context (and win over ours),
  // such as enable_thinking or date_string.
  std::string render(const Json& messages, bool add_generation_prompt, const Json& tools = nullptr,
                     const Json& extra = Json::object()) const;
  // The variables render() gives the template.
  Json context(const Json& messages, bool add_generation_prompt, const Json& tools = nullptr,
               const Json& extra = Json::object()) const;

  std::string bos_token, eos_token;  // empty: not defined in the template
  std::shared_ptr<const Template> compiled;
  RenderOptions options;  // strftime_now's clock (tests fix it)
};

}  // namespace scaletrain::tmpl
