// Our chat-template renderer against two independent renderers, byte for
// byte: Python's jinja2 configured as transformers configures it
// (tests/templates/render.py, the primary reference) and @huggingface/jinja,
// transformers.js's renderer (tests/templates/render.js, pinned in
// scripts/install-deps.sh). Every template below renders every conversation
// of tests/templates/conversations.json, with and without the generation
// prompt; a template's raise_exception must reach the caller with its
// message, and both references must refuse the same conversation.
//
// The templates: the real ones shipped in the pinned npm packages (Llama 3,
// Qwen3 with tools and reasoning), and hand-written ones under
// tests/templates/ for the rest of the language (Mistral-style with
// raise_exception, ChatML, macros/namespace/loops, and Python-only features).
//
// A missing reference (node, the npm package, python3-jinja2) fails the test
// with the command that installs it: a reference that is not there is not a pass.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "reference_util.h"
#include "scaletrain/template/chat_template.h"

namespace fs = std::filesystem;
using scaletrain::UsageError;
using scaletrain::tmpl::ChatTemplate;
using scaletrain::tmpl::Json;
using scaletrain::tmpl::RaisedError;

using scaletrain::test::capture;
using scaletrain::test::npm_dir;

namespace chat_template_reference_test {

const fs::path kSource = SCALETRAIN_SOURCE_DIR;
const fs::path kTemplates = kSource / "tests" / "templates";
constexpr int64_t kNow = 1700000000;  // strftime_now's clock in every renderer: 14 November 2023, UTC


struct TemplateUnderTest {
  std::string name;
  std::function<ChatTemplate()> load;
};

std::vector<TemplateUnderTest> templates() {
  const fs::path models = npm_dir() / "node_modules" / "@lenml";
  auto file = [](const char* f, const char* bos, const char* eos) {
    return [=] { return ChatTemplate::from_file((kTemplates / f).string(), bos, eos); };
  };
  return {
      {"llama3",
       [=] {
         return ChatTemplate::from_tokenizer_config(
             (models / "tokenizer-llama3/models/tokenizer_config.json").string());
       }},
      {"qwen3",
       [=] {
         return ChatTemplate::from_tokenizer_config((models / "tokenizer-qwen3/models/tokenizer_config.json").string());
       }},
      {"mistral", file("mistral.jinja", "<s>", "</s>")},
      {"chatml", file("chatml.jinja", "", "<|im_end|>")},
      {"features", file("features.jinja", "<s>", "</s>")},
      {"python_only", file("python_only.jinja", "<s>", "</s>")},
  };
}

// Where @huggingface/jinja 0.5.11 renders differently from Python's jinja2
// (case id prefix -> why). The test checks these still differ, so the list
// stays true; everything else must match both references.
const std::map<std::string, std::string> kJsDiffers = {
    {"features/unicode/", "|length counts UTF-16 code units there (an emoji counts 2), code points in Python"},
    {"python_only/",
     "no {% raw %}, {% with %}, {% filter %}, %-formatting, |batch, |sum, map('filter'); prints "
     "True/None/lists unlike Python"},
};

std::string js_difference(const std::string& id) {
  for (const auto& [prefix, why] : kJsDiffers)
    if (id.rfind(prefix, 0) == 0) return why;
  return "";
}


std::string quoted(const std::string& s) { return Json(s).dump(-1, ' ', false, Json::error_handler_t::replace); }

// "" when equal, else where they first differ and the text around it.
std::string first_difference(const std::string& ours, const std::string& want) {
  std::size_t i = 0;
  while (i < ours.size() && i < want.size() && ours[i] == want[i]) ++i;
  if (i == ours.size() && i == want.size()) return "";
  const std::size_t from = i >= 40 ? i - 40 : 0;
  return "first differing byte at offset " + std::to_string(i) + " (ours " + std::to_string(ours.size()) +
         " bytes, reference " + std::to_string(want.size()) + ")\n    ours:      ..." + quoted(ours.substr(from, 80)) +
         "\n    reference: ..." + quoted(want.substr(from, 80));
}

struct Result {
  bool error = false;
  std::string text;  // the output, or the error message
};

struct Case {
  std::string id;
  Result ours, python, js;
};

std::map<std::string, Result> run_reference(const std::string& cmd, const std::string& what) {
  int code = 0;
  const std::string out = capture(cmd, code);
  if (code != 0) throw std::runtime_error(cmd + " failed (" + what + ")");
  std::map<std::string, Result> results;
  for (const auto& r : Json::parse(out)) {
    const bool error = r.contains("error");
    results[r["id"].get<std::string>()] = {error, r[error ? "error" : "output"].get<std::string>()};
  }
  return results;
}

// Every conversation through one template, with and without the generation
// prompt: rendered by us, then by both references from the same context.
std::vector<Case> render_all(const std::string& name) {
  const fs::path jinja_js = npm_dir() / "node_modules" / "@huggingface" / "jinja" / "package.json";
  if (!fs::exists(jinja_js))
    throw std::runtime_error("npm package @huggingface/jinja is missing under " + npm_dir().string() +
                             ": run scripts/install-deps.sh (it installs the reference renderers)");
  const auto all = templates();
  const auto t = std::find_if(all.begin(), all.end(), [&](const TemplateUnderTest& u) { return u.name == name; });
  ChatTemplate chat = t->load();
  chat.options.now = kNow;
  std::ifstream in(kTemplates / "conversations.json");
  const Json conversations = Json::parse(in)["conversations"];
  std::vector<Case> cases;
  Json requests = Json::array();
  for (const auto& conv : conversations) {
    for (const bool gen : {true, false}) {
      Case c;
      c.id = name + "/" + conv["name"].get<std::string>() + "/" + (gen ? "gen" : "nogen");
      const Json tools = conv.value("tools", Json(nullptr));
      const Json extra = conv.value("extra", Json::object());
      try {
        c.ours = {false, chat.render(conv["messages"], gen, tools, extra)};
      } catch (const RaisedError& e) {
        c.ours = {true, e.message()};
      } catch (const UsageError& e) {
        c.ours = {true, std::string("(not raise_exception) ") + e.what()};
      }
      requests.push_back({{"id", c.id},
                          {"template", chat.compiled->source_text()},
                          {"context", chat.context(conv["messages"], gen, tools, extra)},
                          {"now", kNow}});
      cases.push_back(std::move(c));
    }
  }
  const fs::path file =
      fs::path(::testing::TempDir()) / ("chat_template_" + name + "_" + std::to_string(::getpid()) + ".json");
  std::ofstream(file) << Json{{"cases", requests}}.dump();
  const auto python = run_reference("/usr/bin/python3 " + (kTemplates / "render.py").string() + " " + file.string(),
                                    "is python3-jinja2 installed? run scripts/install-deps.sh");
  const auto js =
      run_reference("node " + (kTemplates / "render.js").string() + " " + npm_dir().string() + " " + file.string(),
                    "is node installed? run scripts/install-deps.sh");
  fs::remove(file);
  for (auto& c : cases) {
    c.python = python.at(c.id);
    c.js = js.at(c.id);
  }
  return cases;
}

// What a reference's error says when raise_exception made it: "TemplateError: m" (Python), "Error: m" (JS).
std::string raised_message(const std::string& error, const char* prefix) {
  return error.rfind(prefix, 0) == 0 ? error.substr(std::strlen(prefix)) : "";
}

void check_template(const std::string& name) {
  std::vector<Case> cases;
  try {
    cases = render_all(name);
  } catch (const std::exception& e) {
    FAIL() << e.what();
  }
  int checked = 0, js_checked = 0;
  for (const auto& c : cases) {
    ++checked;
    if (c.python.error) {
      // The references refused the conversation: so must we, with the template's own message.
      EXPECT_TRUE(c.ours.error) << c.id << ": Python's jinja2 raised \"" << c.python.text << "\", we rendered "
                                << quoted(c.ours.text);
      const std::string message = raised_message(c.python.text, "TemplateError: ");
      if (!message.empty()) EXPECT_EQ(c.ours.text, message) << c.id << ": raise_exception's message";
    } else {
      EXPECT_FALSE(c.ours.error) << c.id << ": we failed with \"" << c.ours.text << "\"";
      if (!c.ours.error) {
        const std::string diff = first_difference(c.ours.text, c.python.text);
        EXPECT_TRUE(diff.empty()) << c.id << " differs from Python's jinja2: " << diff;
      }
    }
    const std::string why = js_difference(c.id);
    if (!why.empty()) {  // a known difference of the JS renderer: it must still be one
      EXPECT_TRUE(c.js.error != c.python.error || c.js.text != c.python.text)
          << c.id << " is listed as rendering differently in @huggingface/jinja (" << why << ") but no longer does";
      continue;
    }
    ++js_checked;
    if (c.python.error) {
      EXPECT_TRUE(c.js.error) << c.id << ": @huggingface/jinja rendered what Python refused";
      const std::string message = raised_message(c.python.text, "TemplateError: ");
      if (!message.empty()) EXPECT_EQ(raised_message(c.js.text, "Error: "), message) << c.id;
    } else {
      ASSERT_FALSE(c.js.error) << c.id << ": @huggingface/jinja failed: " << c.js.text;
      const std::string diff = first_difference(c.ours.text, c.js.text);
      EXPECT_TRUE(diff.empty()) << c.id << " differs from @huggingface/jinja: " << diff;
    }
  }
  EXPECT_GE(checked, 30) << "too few cases for " << name;
  ::testing::Test::RecordProperty("cases", checked);
  ::testing::Test::RecordProperty("cases_against_js", js_checked);
}

TEST(ChatTemplateReference, Llama3) { check_template("llama3"); }
TEST(ChatTemplateReference, Qwen3ToolsAndReasoning) { check_template("qwen3"); }
TEST(ChatTemplateReference, MistralStyleWithRaiseException) { check_template("mistral"); }
TEST(ChatTemplateReference, ChatML) { check_template("chatml"); }
TEST(ChatTemplateReference, MacrosNamespacesLoops) { check_template("features"); }
TEST(ChatTemplateReference, PythonOnlyFeatures) { check_template("python_only"); }

// The conversation the Mistral-style template refuses: our error is a
// RaisedError carrying the template's message and naming the file, and both
// references refuse it too.
TEST(ChatTemplateReference, MistralRefusesRolesThatDoNotAlternate) {
  std::vector<Case> cases;
  try {
    cases = render_all("mistral");
  } catch (const std::exception& e) {
    FAIL() << e.what();
  }
  const std::string want = "Conversation roles must alternate user/assistant/user/assistant/...";
  for (const char* id : {"mistral/roles_not_alternating/gen", "mistral/roles_not_alternating/nogen"}) {
    const auto it = std::find_if(cases.begin(), cases.end(), [&](const Case& c) { return c.id == id; });
    ASSERT_NE(it, cases.end()) << id;
    EXPECT_TRUE(it->ours.error);
    EXPECT_EQ(it->ours.text, want);
    EXPECT_EQ(it->python.text, "TemplateError: " + want);
    EXPECT_EQ(it->js.text, "Error: " + want);
  }
  std::ifstream in(kTemplates / "conversations.json");
  const Json conversations = Json::parse(in)["conversations"];
  const auto conv = std::find_if(conversations.begin(), conversations.end(),
                                 [](const Json& c) { return c["name"] == "roles_not_alternating"; });
  ASSERT_NE(conv, conversations.end());
  const ChatTemplate chat = ChatTemplate::from_file((kTemplates / "mistral.jinja").string(), "<s>", "</s>");
  try {
    chat.render((*conv)["messages"], true);
    FAIL() << "rendered a conversation whose roles do not alternate";
  } catch (const RaisedError& e) {
    EXPECT_EQ(e.message(), want);
    EXPECT_EQ(std::string(e.what()), (kTemplates / "mistral.jinja").string() + ": " + want);
    EXPECT_EQ(e.line(), 14);  // the raise_exception call in mistral.jinja
  }
}

}  // namespace chat_template_reference_test
