// ChatTemplate: loading a chat template from tokenizer_config.json or a
// file, and the context transformers renders it with.
#include "scaletrain/template/chat_template.h"

#include <fstream>
#include <sstream>

namespace scaletrain::tmpl {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(path + ": cannot read the file");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A special token: a string, an AddedToken object {"content": ...}, or absent/null.
std::string token_text(const Json& config, const char* key, const std::string& path) {
  if (!config.contains(key) || config[key].is_null()) return "";
  const Json& t = config[key];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_object() && t.contains("content") && t["content"].is_string()) return t["content"].get<std::string>();
  throw UsageError(path + ": " + key + " must be a string or an object with a \"content\" string");
}

}  // namespace

ChatTemplate ChatTemplate::from_tokenizer_config(const std::string& path, const std::string& name) {
  Json config;
  try {
    config = Json::parse(read_file(path));
  } catch (const Json::parse_error& e) {
    throw UsageError(path + ": not valid JSON (" + e.what() + ")");
  }
  if (!config.is_object() || !config.contains("chat_template") || config["chat_template"].is_null())
    throw UsageError(path + ": no chat_template (the tokenizer has no chat format; give a template file instead)");
  const Json& ct = config["chat_template"];
  std::string text, source = path + " chat_template";
  if (ct.is_string()) {
    if (!name.empty() && name != "default")
      throw UsageError(path + ": chat_template is a single template, there is no template named '" + name + "'");
    text = ct.get<std::string>();
  } else if (ct.is_array()) {
    const std::string want = name.empty() ? "default" : name;
    std::string names;
    for (const auto& entry : ct) {
      if (!entry.is_object() || !entry.contains("name") || !entry.contains("template") || !entry["name"].is_string() ||
          !entry["template"].is_string())
        throw UsageError(path + ": chat_template entries must be {\"name\": ..., \"template\": ...}");
      names += (names.empty() ? "" : ", ") + entry["name"].get<std::string>();
      if (entry["name"] == want) {
        text = entry["template"].get<std::string>();
        source += " '" + want + "'";
      }
    }
    if (text.empty()) throw UsageError(path + ": no chat template named '" + want + "' (it has: " + names + ")");
  } else {
    throw UsageError(path + ": chat_template must be a string or a list of {name, template}");
  }
  ChatTemplate t;
  t.bos_token = token_text(config, "bos_token", path);
  t.eos_token = token_text(config, "eos_token", path);
  t.compiled = std::make_shared<const Template>(text, source);
  return t;
}

ChatTemplate ChatTemplate::from_file(const std::string& template_path, std::string bos, std::string eos) {
  ChatTemplate t;
  t.bos_token = std::move(bos);
  t.eos_token = std::move(eos);
  t.compiled = std::make_shared<const Template>(read_file(template_path), template_path);
  return t;
}

Json ChatTemplate::context(const Json& messages, bool add_generation_prompt, const Json& tools,
                           const Json& extra) const {
  if (!messages.is_array()) throw UsageError("chat template: messages must be a JSON array");
  if (!tools.is_null() && !tools.is_array()) throw UsageError("chat template: tools must be a JSON array or null");
  if (!extra.is_object() && !extra.is_null()) throw UsageError("chat template: extra must be a JSON object");
  // What transformers passes: messages, tools, documents, add_generation_prompt,
  // then the special tokens that are set, then the caller's keyword arguments.
  Json ctx = Json::object();
  ctx["messages"] = messages;
  ctx["tools"] = tools;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = add_generation_prompt;
  if (!bos_token.empty()) ctx["bos_token"] = bos_token;
  if (!eos_token.empty()) ctx["eos_token"] = eos_token;
  if (extra.is_object())
    for (const auto& [k, v] : extra.items()) ctx[k] = v;
  return ctx;
}

std::string ChatTemplate::render(const Json& messages, bool add_generation_prompt, const Json& tools,
                                 const Json& extra) const {
  if (!compiled) throw UsageError("chat template: no template loaded");
  return compiled->render(context(messages, add_generation_prompt, tools, extra), options);
}

}  // namespace scaletrain::tmpl
