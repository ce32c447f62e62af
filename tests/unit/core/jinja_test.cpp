// Unit tests of the Jinja subset (src/scaletrain/template/): each feature
// chat templates use, with outputs taken from Python's jinja2 configured as
// transformers configures it (tests/templates/render.py printed every
// expected string below); the errors (line numbers, the refused feature
// named); the whitespace options; concurrent rendering; ChatTemplate's
// loading of tokenizer_config.json. chat_template_reference_test.cpp runs
// whole templates against the two reference renderers.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/template/chat_template.h"
#include "scaletrain/template/jinja.h"

namespace fs = std::filesystem;
using scaletrain::UsageError;
using scaletrain::tmpl::ChatTemplate;
using scaletrain::tmpl::Json;
using scaletrain::tmpl::RaisedError;
using scaletrain::tmpl::RenderOptions;
using scaletrain::tmpl::Template;
using scaletrain::tmpl::TemplateOptions;

namespace jinja_test {

constexpr int64_t kNow = 1700000000;  // 2023-11-14 22:13:20 UTC, a Tuesday

std::string render(const std::string& source, const Json& context = Json::object()) {
  RenderOptions options;
  options.now = kNow;
  return Template(source, "t").render(context, options);
}

struct Case {
  const char* name;
  const char* source;
  const char* context;   // JSON
  const char* expected;  // what Python's jinja2 renders
};

void check(const Case* cases, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    const Case& c = cases[i];
    try {
      EXPECT_EQ(render(c.source, Json::parse(c.context)), c.expected) << c.name << ": " << c.source;
    } catch (const std::exception& e) {
      ADD_FAILURE() << c.name << ": " << c.source << "\n  threw: " << e.what();
    }
  }
}

// The message of the UsageError that `fn` throws ("" when it throws none).
template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

std::string parse_error(const std::string& source) {
  return error_of([&] { Template(source, "tokenizer_config.json chat_template"); });
}

std::string render_error(const std::string& source, const Json& context = Json::object()) {
  return error_of([&] { Template(source, "chat.jinja").render(context); });
}

const Case kOutput[] = {
    {"literals", "{{ 'a' }}{{ \"b\" }}{{ 1 }}{{ -2 }}{{ 1.5 }}{{ 1e3 }}{{ true }}{{ False }}{{ none }}{{ None }}", "{}",
     "ab1-21.51000.0TrueFalseNoneNone"},
    {"string_escapes", "{{ 'tab\\tnl\\nq\\'dq\\\"bs\\\\ \\x41\\u00e9\\U0001F600 \\d' }}", "{}",
     "tab\tnl\nq'dq\"bs\\ Aé😀 \\d"},
    {"adjacent_strings", "{{ 'a' 'b' \"c\" }}", "{}", "abc"},
    {"python_str_of_values",
     "{{ [1, 'a', none, true, 2.50] }}|{{ {'k': 'v', 'n': [1, {}]} }}|{{ (1,) }}{{ (1, 'x') }}|{{ ['it\\'s', 'say "
     "\"x\"'] }}",
     "{}", "[1, 'a', None, True, 2.5]|{'k': 'v', 'n': [1, {}]}|(1,)(1, 'x')|[\"it's\", 'say \"x\"']"},
    {"float_repr",
     "{{ 0.1 + 0.2 }} {{ 1 / 3 }} {{ 10 / 2 }} {{ 1e16 }} {{ 1.5e-7 }} {{ 0.0001 }} {{ 123456.789 }} {{ -0.0 }}", "{}",
     "0.30000000000000004 0.3333333333333333 5.0 1e+16 1.5e-07 0.0001 123456.789 -0.0"},
    {"undefined_prints_empty", "[{{ missing }}][{{ d.missing }}][{{ missing|default('dflt') }}]", "{\"d\": {}}",
     "[][][dflt]"},
    {"context_values", "{{ s }} {{ n }} {{ f }} {{ b }} {{ nothing }} {{ l }} {{ d }}",
     "{\"s\": \"str\", \"n\": 3, \"f\": 0.5, \"b\": false, \"nothing\": null, \"l\": [1, \"two\"], \"d\": {\"z\": 1, "
     "\"a\": [true]}}",
     "str 3 0.5 False None [1, 'two'] {'z': 1, 'a': [True]}"},
    {"unicode_repr",
     "{{ ['é\u3000\u200b😀\x07"
     "'] }}",
     "{}", "['é\\u3000\\u200b😀\\x07']"},
};

const Case kWhitespace[] = {
    {"minus_strips_both_sides", "a  \n {%- if true -%} \n  b  \n {%- endif -%}\n  c", "{}", "abc"},
    {"expression_minus", "x   {{- 'y' -}}   z", "{}", "xyz"},
    {"comment_minus", "a \n{#- note -#}\n b", "{}", "ab"},
    {"trim_blocks_drops_one_newline", "{% if true %}\n\nx{% endif %}\n\ny", "{}", "\nx\ny"},
    {"lstrip_blocks_indented_tags", "a\n    {% if true %}\n    b\n    {% endif %}\nc", "{}", "a\n    b\nc"},
    {"lstrip_not_after_text", "a  {% if true %}b{% endif %}", "{}", "a  b"},
    {"lstrip_not_for_expressions", "\n    {{ 'x' }}", "{}", "\n    x"},
    {"plus_disables_lstrip_and_trim", "a\n    {%+ if true +%}\nb{% endif %}", "{}", "a\n    \nb"},
    {"comments_trim_and_lstrip", "a\n  {# c #}\nb", "{}", "a\nb"},
    {"trailing_newline_dropped", "x\n", "{}", "x"},
    {"only_one_trailing_newline", "x\n\n", "{}", "x\n"},
    {"crlf_is_newline", "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\n", "{}", "a\nb\n"},
    {"unicode_whitespace_stripped", "a {{- '\u3000' -}} \u3000\u00a0 b", "{}", "a\u3000b"},
    {"loop_layout", "{% for m in l %}\n  {{ m }}\n{% endfor %}\n", "{\"l\": [1, 2]}", "  1\n  2\n"},
};

const Case kControl[] = {
    {"if_elif_else",
     "{% for x in [1, 2, 3] %}{% if x == 1 %}one{% elif x == 2 %}two{% else %}many{% endif %} {% endfor %}", "{}",
     "one two many "},
    {"for_else",
     "{% for x in [] %}x{% else %}empty{% endfor %}|{% for x in missing %}x{% else %}undefined is empty{% endfor %}",
     "{}", "empty|undefined is empty"},
    {"loop_variables",
     "{% for x in 'abc' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ "
     "loop.last }}{{ loop.length }} {% endfor %}",
     "{}", "1032TrueFalse3 2121FalseFalse3 3210FalseTrue3 "},
    {"previtem_nextitem",
     "{% for x in [1, 2, 3] %}{{ loop.previtem is defined }}:{{ loop.previtem }}<{{ x }}>{{ loop.nextitem }} {% endfor "
     "%}",
     "{}", "False:<1>2 True:1<2>3 True:2<3> "},
    {"loop_filter_counts_kept_items",
     "{% for x in range(10) if x is odd %}{{ x }}:{{ loop.index }}/{{ loop.length }} {% endfor %}", "{}",
     "1:1/5 3:2/5 5:3/5 7:4/5 9:5/5 "},
    {"tuple_unpacking",
     "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for (a, b) in [[1, 2], (3, 4)] %}{{ a + b }}{% endfor "
     "%}",
     "{\"d\": {\"b\": 1, \"a\": 2}}", "b=1;a=2;37"},
    {"nested_loops",
     "{% for i in range(2) %}{% for j in range(2) %}{{ loop.index }}{{ i }}{{ j }} {% endfor %}{{ loop.index }}|{% "
     "endfor %}",
     "{}", "100 201 1|110 211 2|"},
    {"break_continue",
     "{% for x in range(10) %}{% if x is even %}{% continue %}{% endif %}{{ x }}{% if x > 4 %}{% break %}{% endif %}{% "
     "endfor %}",
     "{}", "135"},
    {"loop_cycle", "{% for x in range(5) %}{{ loop.cycle('a', 'b', 'c') }}{% endfor %}", "{}", "abcab"},
    {"set_in_loop_does_not_leak", "{% set x = 'outer' %}{% for i in [1, 2] %}{% set x = i %}{{ x }}{% endfor %}{{ x }}",
     "{}", "12outer"},
    {"set_in_loop_is_per_iteration",
     "{% for i in range(3) %}{% if i == 0 %}{% set y = 'set' %}{% endif %}[{{ y }}]{% endfor %}", "{}", "[set][][]"},
    {"namespace_carries_state",
     "{% set ns = namespace(total=0, names=[]) %}{% for x in [1, 2, 3] %}{% set ns.total = ns.total + x %}{% set "
     "ns.names = ns.names + [x ~ ''] %}{% endfor %}{{ ns.total }} {{ ns.names|join(',') }} {{ ns.missing is defined }}",
     "{}", "6 1,2,3 False"},
    {"namespace_from_dict", "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}{{ ns['a'] }}", "{}", "121"},
    {"set_tuple", "{% set a, b = 1, 'two' %}{{ a }}{{ b }}", "{}", "1two"},
    {"block_set_with_filters", "{% set x | trim | upper %}  hello {{ 'world' }}  {% endset %}[{{ x }}]", "{}",
     "[HELLO WORLD]"},
    {"macro_defaults_and_keywords",
     "{% macro tag(name, attr='x', close=true) %}<{{ name }} {{ attr }}>{% if close %}</{{ name }}>{% endif %}{% "
     "endmacro %}{{ tag('a') }}{{ tag('b', 'y') }}{{ tag('c', close=false) }}{{ tag(attr='z', name='d') }}",
     "{}", "<a x></a><b y></b><c x><d z></d>"},
    {"macro_missing_argument_is_undefined",
     "{% macro m(a, b) %}[{{ a }}|{{ b }}|{{ b is defined }}]{% endmacro %}{{ m(1) }}", "{}", "[1||False]"},
    {"macro_sees_template_variables", "{% set g = 'global' %}{% macro m() %}{{ g }} {{ s }}{% endmacro %}{{ m() }}",
     "{\"s\": \"ctx\"}", "global ctx"},
    {"macro_recursion",
     "{% macro countdown(n) %}{{ n }}{% if n > 0 %},{{ countdown(n - 1) }}{% endif %}{% endmacro %}{{ countdown(3) }}",
     "{}", "3,2,1,0"},
    {"raw_block", "{% raw %}{{ not evaluated }} {% if %}{% endraw %}", "{}", "{{ not evaluated }} {% if %}"},
    {"with_block", "{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}[{{ a }}]", "{}", "3[]"},
    {"filter_block", "{% filter upper %}shout {{ 'this' }}{% endfilter %}", "{}", "SHOUT THIS"},
    {"generation_block", "{% generation %}assistant text{% endgeneration %}", "{}", "assistant text"},
    {"inline_if", "{{ 'yes' if true else 'no' }} {{ 'a' if false else 'b' if false else 'c' }} [{{ 'x' if false }}]",
     "{}", "yes c []"},
};

const Case kExpressions[] = {
    {"arithmetic",
     "{{ 7 + 2 }} {{ 7 - 2 }} {{ 7 * 2 }} {{ 7 / 2 }} {{ 7 // 2 }} {{ 7 % 2 }} {{ 2 ** 10 }} {{ -7 // 2 }} {{ -7 % 3 "
     "}} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ 2 ** -1 }}",
     "{}", "9 5 14 3.5 3 1 1024 -4 2 3.0 0.5 0.5"},
    {"precedence",
     "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ -2 ** 2 }} {{ 2 * 3 ** 2 }} {{ 2 * 3 ~ 4 }} {{ 'a' ~ (1 + 2) }} {{ not 1 == "
     "2 }} {{ 1 or 0 and 0 }}",
     "{}", "7 9 4 18 64 a3 True 1"},
    {"filter_binds_tighter_than_plus", "{{ 'a' + '  b  ' | trim + 'c' }} {{ l | length - 1 }} {{ -3 | abs }}",
     "{\"l\": [1, 2, 3]}", "abc 2 3"},
    {"concat_and_repeat", "{{ 'a' ~ 1 ~ none ~ true ~ missing }} {{ 'ab' * 3 }} {{ [1] * 2 + [3] }}", "{}",
     "a1NoneTrue ababab [1, 1, 3]"},
    {"comparisons",
     "{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 == 1.0 }} {{ 'a' != 'b' }} {{ 'abc' < 'abd' }} {{ [1, 2] < [1, 3] }} {{ "
     "true == 1 }} {{ none == none }} {{ missing == none }}",
     "{}", "True False True True True True True True False"},
    {"membership", "{{ 'a' in 'cat' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }} {{ 'x' in missing }}",
     "{}", "True True True True False"},
    {"and_or_return_operands", "{{ 0 or 'x' }} {{ 'a' and 'b' }} {{ none or [] }} {{ '' and 1 }} {{ not none }}", "{}",
     "x b []  True"},
    {"is_tests",
     "{{ x is defined }} {{ x is not defined }} {{ none is none }} {{ 3 is not none }} {{ 4 is divisibleby 2 }} {{ 4 "
     "is divisibleby(3) }}",
     "{\"x\": 1}", "True False True True True False"},
    {"attribute_and_item",
     "{{ m.role }} {{ m['role'] }} {{ l[0] }} {{ l[-1] }} {{ l.1 }} {{ m.missing is undefined }} {{ l[9] is undefined "
     "}} {{ 'abc'[1] }}",
     "{\"m\": {\"role\": \"user\"}, \"l\": [\"a\", \"b\"]}", "user user a b b True True b"},
    {"dict_attribute_prefers_methods", "{{ d.items is defined }} {{ d['items'] }} {{ d.get('items') }}",
     "{\"d\": {\"items\": \"key\"}}", "True key key"},
    {"slices",
     "{{ l[1:] }} {{ l[:-1] }} {{ l[::-1] }} {{ l[::2] }} {{ l[-2:] }} {{ l[5:] }} {{ 'héllo😀'[::-1] }} {{ "
     "'abcdef'[1:5:2] }} {{ l[3:0:-1] }}",
     "{\"l\": [0, 1, 2, 3, 4]}", "[1, 2, 3, 4] [0, 1, 2, 3] [4, 3, 2, 1, 0] [0, 2, 4] [3, 4] [] 😀olléh bd [3, 2, 1]"},
    {"list_dict_tuple_literals",
     "{{ [] }} {{ {} }} {{ () }} {{ [1, [2, 3],] }} {{ {'a': 1, 'b': {'c': none},} }} {{ (1, 2)[1] }}", "{}",
     "[] {} () [1, [2, 3]] {'a': 1, 'b': {'c': None}} 2"},
    {"string_methods",
     "{{ '  x  '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ '  x '.lstrip() }}|{{ ' x  '.rstrip() }}|{{ "
     "'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a b c'.rsplit(' ', 1) }}|{{ "
     "'Hello'.startswith('He') }}{{ 'Hello'.endswith(('x', 'lo')) }}|{{ 'Hi'.upper() }}{{ 'Hi'.lower() }}|{{ 'hello "
     "world'.title() }}|{{ 'hELLO'.capitalize() }}|{{ 'aXbX'.replace('X', '-') }}|{{ 'hello'.find('l') }}{{ "
     "'hello'.count('l') }}|{{ ', '.join(['a', 'b']) }}|{{ 'a\\nb'.splitlines() }}|{{ '{} and {}'.format(1, 'x') }}",
     "{}",
     "x|hi|x | x|['a', 'b', '', 'c']|['a', 'b']|['a', 'b c']|['a b', 'c']|TrueTrue|HIhi|Hello World|Hello|a-b-|22|a, "
     "b|['a', 'b']|1 and x"},
    {"dict_methods",
     "{{ d.items()|list }} {{ d.keys()|list }} {{ d.values()|list }} {{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', "
     "0) }}",
     "{\"d\": {\"b\": 1, \"a\": 2}}", "[('b', 1), ('a', 2)] ['b', 'a'] [1, 2] 2 None 0"},
    {"qwen_style_reasoning_split",
     "{% set c = m.split('</think>')[-1].lstrip('\\n') %}{% set r = "
     "m.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}[{{ r }}][{{ c }}]",
     "{\"m\": \"<think>\\nplan\\n</think>\\n\\nanswer\"}", "[plan][answer]"},
    {"globals",
     "{{ range(3)|list }} {{ range(1, 7, 2)|list }} {{ range(3, 0, -1)|list }} {{ dict(a=1, b=2) }} {{ namespace is "
     "defined }}",
     "{}", "[0, 1, 2] [1, 3, 5] [3, 2, 1] {'a': 1, 'b': 2} True"},
    {"strftime_now", "{{ strftime_now('%d %b %Y') }}|{{ strftime_now('%Y-%m-%d %H:%M:%S %A %B') }}", "{}",
     "14 Nov 2023|2023-11-14 22:13:20 Tuesday November"},
    {"percent_format",
     "{{ '%s has %d items (%.2f%%)' % ('list', 3, 12.5) }} {{ '%s'|format('x') }} {{ '%05.1f|%-4s|%x'|format(3.14159, "
     "'ab', 255) }}",
     "{}", "list has 3 items (12.50%) x 003.1|ab  |ff"},
    {"percent_with_a_mapping_like_argument", "{{ 'no conversions' % [1] }}|{{ '%s' % [1] }}|{{ '%s' % missing }}", "{}",
     "no conversions|[1]|"},
};

const Case kFilters[] = {
    {"trim", "[{{ '  a b \\n'|trim }}][{{ 'xxaxx'|trim('x') }}][{{ '\u3000wide\u3000'|trim }}]", "{}",
     "[a b][a][wide]"},
    {"tojson_python_separators", "{{ d|tojson }}",
     "{\"d\": {\"b\": [1, 2.5, null, true], \"a\": {\"x\": \"é\\n\\\"q\\\"\\\\ \u2028\"}, \"e\": {}, \"l\": []}}",
     "{\"b\": [1, 2.5, null, true], \"a\": {\"x\": \"é\\n\\\"q\\\"\\\\ \u2028\"}, \"e\": {}, \"l\": []}"},
    {"tojson_indent", "{{ d|tojson(indent=2) }}\n{{ [[], {}, [1]]|tojson(indent=1) }}\n{{ d|tojson(indent='\\t') }}",
     "{\"d\": {\"b\": [1, {\"c\": null}], \"a\": \"x\"}}",
     "{\n  \"b\": [\n    1,\n    {\n      \"c\": null\n    }\n  ],\n  \"a\": \"x\"\n}\n[\n [],\n {},\n [\n  1\n "
     "]\n]\n{\n\t\"b\": [\n\t\t1,\n\t\t{\n\t\t\t\"c\": null\n\t\t}\n\t],\n\t\"a\": \"x\"\n}"},
    {"tojson_options",
     "{{ d|tojson(sort_keys=true) }} {{ d|tojson(separators=(',', ':')) }} {{ 'é😀'|tojson(ensure_ascii=true) }}",
     "{\"d\": {\"b\": 1, \"a\": [1, 2]}}", "{\"a\": [1, 2], \"b\": 1} {\"b\":1,\"a\":[1,2]} \"\\u00e9\\ud83d\\ude00\""},
    {"tojson_scalars",
     "{{ 'x'|tojson }} {{ 1|tojson }} {{ 1.0|tojson }} {{ none|tojson }} {{ true|tojson }} {{ (1, 2)|tojson }}", "{}",
     "\"x\" 1 1.0 null true [1, 2]"},
    {"length_first_last",
     "{{ l|length }} {{ l|count }} {{ 'héllo'|length }} {{ d|length }} {{ missing|length }} {{ l|first }} {{ l|last }} "
     "{{ 'abc'|first }} {{ []|first is undefined }}",
     "{\"l\": [3, 1, 2], \"d\": {\"a\": 1}}", "3 3 5 1 0 3 2 a True"},
    {"case_filters",
     "{{ 'hELLo wORLD'|lower }} {{ 'straße'|upper }} {{ 'hELLO'|capitalize }} {{ 'hello big-world (x)'|title }} {{ "
     "'élan'|upper }} {{ 'ﬁne straße'|title }} {{ 'İ'|lower|length }}",
     "{}", "hello world STRASSE Hello Hello Big-World (X) ÉLAN FIne Straße 2"},
    {"replace_join_string",
     "{{ 'aaa'|replace('a', 'b') }} {{ 'aaa'|replace('a', 'b', 2) }} {{ [1, 'a', none]|join('-') }} {{ [1, 2]|join }} "
     "{{ 5|string ~ '!' }} {{ m|join(', ', attribute='n') }}",
     "{\"m\": [{\"n\": \"x\"}, {\"n\": \"y\"}]}", "bbb bba 1-a-None 12 5! x, y"},
    {"default",
     "{{ missing|default('d') }} {{ missing|d('d2') }} {{ ''|default('d3') }} {{ ''|default('d4', true) }} {{ "
     "none|default('d5') }} {{ 0|d(1, boolean=true) }}",
     "{}", "d d2  d4 None 1"},
    {"numbers",
     "{{ 3.7|int }} {{ '42'|int }} {{ ' 7 '|int }} {{ '4.9'|int }} {{ 'x'|int }} {{ 'x'|int(5) }} {{ 'ff'|int(base=16) "
     "}} {{ '3'|float }} {{ 2|float }} {{ 'nope'|float }} {{ -3|abs }} {{ -2.5|abs }}",
     "{}", "3 42 7 4 0 5 255 3.0 2.0 0.0 3 2.5"},
    {"round",
     "{{ 2.5|round }} {{ 3.5|round }} {{ 2.675|round(2) }} {{ 7|round }} {{ 2.1|round(0, 'ceil') }} {{ "
     "2.9|round(method='floor') }} {{ -1.25|round(1) }}",
     "{}", "2.0 4.0 2.67 7 3.0 2.0 -1.2"},
    {"list_items_dictsort",
     "{{ 'ab'|list }} {{ d|list }} {{ d|items|list }} {{ d|dictsort }} {{ d|dictsort(by='value') }} {{ "
     "d|dictsort(reverse=true) }}",
     "{\"d\": {\"b\": 1, \"a\": 3, \"C\": 2}}",
     "['a', 'b'] ['b', 'a', 'C'] [('b', 1), ('a', 3), ('C', 2)] [('a', 3), ('b', 1), ('C', 2)] [('b', 1), ('C', 2), "
     "('a', 3)] [('C', 2), ('b', 1), ('a', 3)]"},
    {"sort_unique_reverse",
     "{{ l|sort }} {{ l|sort(reverse=true) }} {{ ['b', 'A', 'c']|sort }} {{ ['b', 'A', 'c']|sort(case_sensitive=true) "
     "}} {{ m|sort(attribute='k')|map(attribute='v')|join }} {{ ['a', 'A', 'b', 'a']|unique|list }} {{ l|reverse|list "
     "}} {{ 'abc'|reverse }}",
     "{\"l\": [3, 1, 2], \"m\": [{\"k\": 2, \"v\": \"x\"}, {\"k\": 1, \"v\": \"y\"}, {\"k\": 2, \"v\": \"z\"}]}",
     "[1, 2, 3] [3, 2, 1] ['A', 'b', 'c'] ['A', 'b', 'c'] yxz ['a', 'b'] [2, 1, 3] cba"},
    {"min_max_sum",
     "{{ l|min }} {{ l|max }} {{ l|sum }} {{ ['b', 'A']|min }} {{ m|max(attribute='k') }} {{ m|sum(attribute='k') }} "
     "{{ []|max is undefined }}",
     "{\"l\": [3, 1, 2], \"m\": [{\"k\": 2}, {\"k\": 5}]}", "1 3 6 A {'k': 5} 7 True"},
    {"select_reject_map",
     "{{ [1, 2, 3, 4]|select('odd')|list }} {{ [1, 2, 3, 4]|reject('even')|list }} {{ [0, 1, none, '', "
     "'a']|select|list }} {{ ['a', 'b']|map('upper')|list }} {{ m|map(attribute='r')|list }} {{ m|map(attribute='x', "
     "default='-')|list }} {{ m|map(attribute='p.q')|list }}",
     "{\"m\": [{\"r\": \"u\", \"p\": {\"q\": 1}}, {\"r\": \"a\", \"x\": 9, \"p\": {\"q\": 2}}]}",
     "[1, 3] [1, 3] [1, 'a'] ['A', 'B'] ['u', 'a'] ['-', 9] [1, 2]"},
    {"selectattr_rejectattr",
     "{{ m|selectattr('role', 'equalto', 'user')|map(attribute='c')|join }} {{ m|rejectattr('role', 'eq', "
     "'user')|map(attribute='c')|join }} {{ m|selectattr('tool')|map(attribute='c')|join }} {{ m|selectattr('tool', "
     "'defined')|list|length }} {{ m|rejectattr('tool', 'undefined')|list|length }}",
     "{\"m\": [{\"role\": \"user\", \"c\": \"1\"}, {\"role\": \"assistant\", \"c\": \"2\", \"tool\": true}, {\"role\": "
     "\"user\", \"c\": \"3\", \"tool\": false}]}",
     "13 2 2 2 2"},
    {"indent",
     "{{ 'a\\nb\\n\\nc'|indent }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent(width='> ', blank=true) }}", "{}",
     "a\n    b\n\n    c|  a\n  b|a\n> \n> b"},
    {"escape_safe_center_batch",
     "{{ '<a href=\"x\">&\\'</a>'|e }} {{ 'x'|escape }} {{ '<b>'|safe }} [{{ 'abc'|center(9) }}] {{ [1, 2, 3, 4, "
     "5]|batch(2)|list }} {{ [1, 2, 3]|batch(2, 0)|list }} {{ d|attr('get') is defined }}",
     "{\"d\": {}}",
     "&lt;a href=&#34;x&#34;&gt;&amp;&#39;&lt;/a&gt; x <b> [   abc   ] [[1, 2], [3, 4], [5]] [[1, 2], [3, 0]] True"},
    {"falsy_input_selects_nothing",
     "{{ none|select|list }} {{ false|map('string')|list }} {{ 0|rejectattr('x')|list }}", "{}", "[] [] []"},
};

const Case kTests[] = {
    {"type_tests",
     "{{ 1 is number }}{{ 1.5 is number }}{{ true is number }}{{ 1 is integer }}{{ 1.0 is integer }}{{ 1.0 is float "
     "}}{{ 'x' is string }}{{ 1 is string }}{{ d is mapping }}{{ l is mapping }}",
     "{\"d\": {}, \"l\": []}", "TrueTrueTrueTrueFalseTrueTrueFalseTrueFalse"},
    {"container_tests",
     "{{ l is iterable }}{{ 'x' is iterable }}{{ d is iterable }}{{ 3 is iterable }}{{ missing is iterable }}{{ l is "
     "sequence }}{{ 3 is sequence }}{{ range is callable }}{{ 'x' is callable }}",
     "{\"d\": {}, \"l\": []}", "TrueTrueTrueFalseTrueTrueFalseTrueFalse"},
    {"value_tests",
     "{{ none is none }}{{ 0 is none }}{{ true is boolean }}{{ 1 is boolean }}{{ false is false }}{{ 0 is false }}{{ "
     "true is true }}{{ missing is undefined }}{{ 3 is defined }}",
     "{}", "TrueFalseTrueFalseTrueFalseTrueTrueTrue"},
    {"number_tests", "{{ 3 is odd }}{{ 3 is even }}{{ 0 is even }}{{ 9 is divisibleby 3 }}{{ 9 is divisibleby(4) }}",
     "{}", "TrueFalseTrueTrueFalse"},
    {"comparison_tests",
     "{{ 3 is eq 3 }}{{ 3 is equalto 4 }}{{ [1, 2, 3]|select('==', 2)|list }}{{ [1, 2, 3]|reject('>', 1)|list }}{{ 3 "
     "is ne 4 }}{{ 3 is lt 4 }}{{ 3 is le 3 }}{{ 3 is gt 4 }}{{ 3 is ge 3 }}{{ 3 is greaterthan 2 }}{{ 3 is lessthan 2 "
     "}}{{ 'a' is in 'cat' }}{{ 4 is in [1] }}",
     "{}", "TrueFalse[2][1]TrueTrueTrueFalseTrueTrueFalseTrueFalse"},
    {"string_tests",
     "{{ 'abc' is lower }}{{ 'aBc' is lower }}{{ 'ABC' is upper }}{{ '1' is upper }}{{ none is sameas none }}{{ true "
     "is sameas true }}{{ 1 is sameas true }}",
     "{}", "TrueFalseTrueFalseTrueTrueFalse"},
};

TEST(JinjaOutput, LiteralsAndPythonFormatting) { check(kOutput, std::size(kOutput)); }
TEST(JinjaWhitespace, TrimBlocksLstripBlocksAndMinusSigns) { check(kWhitespace, std::size(kWhitespace)); }
TEST(JinjaControl, IfForLoopSetNamespaceMacroRawWith) { check(kControl, std::size(kControl)); }
TEST(JinjaExpressions, OperatorsSlicesMethodsGlobals) { check(kExpressions, std::size(kExpressions)); }
TEST(JinjaFilters, AsJinjaAndTransformersDefineThem) { check(kFilters, std::size(kFilters)); }
TEST(JinjaTests, IsTests) { check(kTests, std::size(kTests)); }

// trim_blocks and lstrip_blocks are transformers' settings; turned off, the
// template renders as plain Jinja would (outputs from jinja2.Environment).
TEST(JinjaWhitespace, OptionsOff) {
  const std::string src = "  {% if true %}\nx\n  {% endif %}\n{# c #}\ny";
  auto with = [&](bool trim, bool lstrip) {
    TemplateOptions o;
    o.trim_blocks = trim;
    o.lstrip_blocks = lstrip;
    return Template(src, "t", o).render(Json::object());
  };
  EXPECT_EQ(with(false, false), "  \nx\n  \n\ny");
  EXPECT_EQ(with(true, false), "  x\n  y");
  EXPECT_EQ(with(false, true), "\nx\n\n\ny");
  EXPECT_EQ(with(true, true), "x\ny");
}

TEST(JinjaErrors, SyntaxErrorsNameTheSourceAndLine) {
  EXPECT_EQ(parse_error("line one\n{% extends 'base.html' %}"),
            "tokenizer_config.json chat_template line 2: unsupported tag 'extends'");
  for (const char* tag : {"include", "import", "from", "block", "call", "do", "autoescape"})
    EXPECT_EQ(parse_error(std::string("{% ") + tag + " x %}"),
              std::string("tokenizer_config.json chat_template line 1: unsupported tag '") + tag + "'");
  EXPECT_EQ(parse_error("\n\n{% frobnicate %}"),
            "tokenizer_config.json chat_template line 3: unknown tag 'frobnicate'");
  EXPECT_EQ(parse_error("a\nb\n{{ x | nosuchfilter }}"),
            "tokenizer_config.json chat_template line 3: unsupported filter 'nosuchfilter'");
  EXPECT_EQ(parse_error("{% if x is\n nosuchtest %}{% endif %}"),
            "tokenizer_config.json chat_template line 1: unsupported test 'nosuchtest'");
  EXPECT_EQ(parse_error("{% for x in l recursive %}{% endfor %}"),
            "tokenizer_config.json chat_template line 1: unsupported loop modifier 'recursive'");
  EXPECT_EQ(parse_error("{{ f(*args) }}"),
            "tokenizer_config.json chat_template line 1: unsupported argument unpacking '*'");
  EXPECT_EQ(
      parse_error("{% if true %}\nno end"),
      "tokenizer_config.json chat_template line 2: unexpected end of template, expected 'elif' or 'else' or 'endif'");
  EXPECT_EQ(parse_error("{% for x in l %}\n{% endif %}"),
            "tokenizer_config.json chat_template line 2: unexpected tag 'endif'");
  EXPECT_EQ(parse_error("{{ 1 + }}"), "tokenizer_config.json chat_template line 1: unexpected end of print statement");
  EXPECT_EQ(parse_error("{{ 'abc }}"), "tokenizer_config.json chat_template line 1: unterminated string literal");
  EXPECT_EQ(parse_error("a\n{# never closed"),
            "tokenizer_config.json chat_template line 2: missing end of comment tag");
  EXPECT_EQ(parse_error("{% break %}"), "tokenizer_config.json chat_template line 1: 'break' outside of a for loop");
  EXPECT_EQ(parse_error("{{ x ) }}"), "tokenizer_config.json chat_template line 1: unexpected ')'");
  EXPECT_EQ(parse_error("{% macro m(a=1, b) %}{% endmacro %}"),
            "tokenizer_config.json chat_template line 1: non-default argument follows default argument");
}

TEST(JinjaErrors, RenderErrorsNameTheLine) {
  EXPECT_EQ(render_error("ok\n{{ foo.bar }}"), "chat.jinja line 2: 'foo' is undefined");
  EXPECT_EQ(render_error("{{ d.x.y }}", {{"d", Json::object()}}),
            "chat.jinja line 1: 'dict object' has no attribute 'x'");
  EXPECT_EQ(render_error("\n\n{{ 'a' + 1 }}"), "chat.jinja line 3: can only concatenate str (not \"int\") to str");
  EXPECT_EQ(render_error("{% for m in messages %}{% endfor %}", {{"messages", nullptr}}),
            "chat.jinja line 1: 'NoneType' object is not iterable");
  EXPECT_EQ(render_error("{{ none() }}"), "chat.jinja line 1: 'NoneType' object is not callable");
  EXPECT_EQ(render_error("{{ 3 > 'a' }}"), "chat.jinja line 1: '>' not supported between instances of 'int' and 'str'");
  EXPECT_EQ(render_error("{{ 1 // 0 }}"), "chat.jinja line 1: integer division or modulo by zero");
  EXPECT_EQ(render_error("{% set a, b = [1] %}"), "chat.jinja line 1: not enough values to unpack (expected 2, got 1)");
  EXPECT_EQ(render_error("{% set x = 1 %}{% set x.y = 2 %}"),
            "chat.jinja line 1: cannot assign attribute on non-namespace object");
  EXPECT_EQ(render_error("{{ l|tojson }}", {{"l", Json::array()}}), "");
  EXPECT_EQ(render_error("{{ missing|tojson }}"),
            "chat.jinja line 1: Object of type Undefined is not JSON serializable");
  EXPECT_EQ(render_error("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}"),
            "chat.jinja line 1: macro 'm' takes not more than 1 argument(s)");
  EXPECT_EQ(render_error("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}"),
            "chat.jinja line 1: maximum macro recursion depth exceeded");
  EXPECT_EQ(render_error("x", Json::array()), "chat.jinja: the context must be a JSON object");
  EXPECT_EQ(render_error("{{ 5|indent }}"), "chat.jinja line 1: unsupported operand type(s) for +=: 'int' and 'str'");
  EXPECT_EQ(render_error("{{ [1] in {} }}"), "chat.jinja line 1: unhashable type: 'list'");
  EXPECT_EQ(render_error("{{ missing|int }}"), "chat.jinja line 1: 'missing' is undefined");
}

TEST(JinjaErrors, RaiseExceptionCarriesTheTemplatesMessage) {
  const Template t(
      "{% for m in messages %}\n{% if m.role == 'tool' %}\n{{ raise_exception('Tool role \"' ~ m.role ~ "
      "'\" is not supported') }}\n{% endif %}{% endfor %}",
      "models/x/tokenizer_config.json chat_template");
  const Json ok = {{"messages", Json::array({{{"role", "user"}}})}};
  EXPECT_EQ(t.render(ok), "");
  const Json bad = {{"messages", Json::array({{{"role", "tool"}}})}};
  try {
    t.render(bad);
    FAIL() << "raise_exception did not throw";
  } catch (const RaisedError& e) {
    EXPECT_EQ(e.message(), "Tool role \"tool\" is not supported");
    EXPECT_EQ(std::string(e.what()),
              "models/x/tokenizer_config.json chat_template: Tool role \"tool\" is not supported");
    EXPECT_EQ(e.line(), 3);
  }
  EXPECT_THROW(t.render(bad), UsageError);  // callers that only know UsageError still catch it
}

// One parsed Template renders on many threads at once.
TEST(JinjaTemplate, ConcurrentRendersAgree) {
  const Template t(
      "{% set ns = namespace(n=0) %}{% macro m(x) %}<{{ x }}>{% endmacro %}"
      "{% for i in range(k) %}{% set ns.n = ns.n + i %}{{ m(i) }}{% endfor %}={{ ns.n }}",
      "t");
  std::vector<std::string> want(8);
  for (int k = 0; k < 8; ++k) want[k] = t.render({{"k", 20 + k}});
  std::vector<std::thread> threads;
  std::vector<int> mismatches(8, 0);
  for (int k = 0; k < 8; ++k)
    threads.emplace_back([&, k] {
      for (int rep = 0; rep < 200; ++rep)
        if (t.render({{"k", 20 + k}}) != want[k]) ++mismatches[k];
    });
  for (auto& th : threads) th.join();
  for (int k = 0; k < 8; ++k) EXPECT_EQ(mismatches[k], 0) << "thread " << k;
  EXPECT_EQ(want[0].substr(want[0].size() - 4), "=190");
}

// A nlohmann::json context converts (its keys sorted); an ordered one keeps the order tojson prints.
TEST(JinjaTemplate, KeyOrderFollowsTheContext) {
  const Template t("{{ d|tojson }}", "t");
  EXPECT_EQ(t.render(Json::parse(R"({"d": {"z": 1, "a": 2}})")), R"({"z": 1, "a": 2})");
  EXPECT_EQ(t.render(nlohmann::json::parse(R"({"d": {"z": 1, "a": 2}})")), R"({"a": 2, "z": 1})");
}

class ChatTemplateConfig : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("chat_template_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
    return (dir_ / name).string();
  }
  fs::path dir_;
};

TEST_F(ChatTemplateConfig, StringTemplateAndAddedTokenObjects) {
  const std::string path = write("tokenizer_config.json", R"({
    "bos_token": {"content": "<s>", "lstrip": false, "__type": "AddedToken"},
    "eos_token": "</s>",
    "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}{{ documents is none }}{{ tools is none }}"
  })");
  const ChatTemplate chat = ChatTemplate::from_tokenizer_config(path);
  EXPECT_EQ(chat.bos_token, "<s>");
  EXPECT_EQ(chat.eos_token, "</s>");
  EXPECT_EQ(chat.compiled->source_name(), path + " chat_template");
  const Json messages = Json::parse(R"([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])");
  EXPECT_EQ(chat.render(messages, true), "<s>[user] hi</s>[assistant] yo</s>[assistant]TrueTrue");
  EXPECT_EQ(chat.render(messages, false, Json::array({{{"type", "function"}}})),
            "<s>[user] hi</s>[assistant] yo</s>TrueFalse");
  const Json ctx = chat.context(messages, true, nullptr, {{"enable_thinking", false}, {"eos_token", "<eot>"}});
  EXPECT_EQ(ctx["eos_token"], "<eot>");  // extra keys win, as transformers' kwargs do
  EXPECT_EQ(ctx["enable_thinking"], false);
  EXPECT_TRUE(ctx["documents"].is_null());
}

TEST_F(ChatTemplateConfig, NamedTemplatesPickDefaultOrTheOneAsked) {
  const std::string path = write("tokenizer_config.json", R"({
    "bos_token": null, "eos_token": "<|end|>",
    "chat_template": [{"name": "tool_use", "template": "tools:{{ tools|length }}"},
                      {"name": "default", "template": "default{{ bos_token is defined }}"}]
  })");
  EXPECT_EQ(ChatTemplate::from_tokenizer_config(path).render(Json::array(), false), "defaultFalse");
  EXPECT_EQ(ChatTemplate::from_tokenizer_config(path, "tool_use").render(Json::array(), false, Json::array({1, 2})),
            "tools:2");
  EXPECT_EQ(error_of([&] { ChatTemplate::from_tokenizer_config(path, "rag"); }),
            path + ": no chat template named 'rag' (it has: tool_use, default)");
}

TEST_F(ChatTemplateConfig, MissingTemplateNamesTheFile) {
  const std::string path = write("tokenizer_config.json", R"({"eos_token": "</s>"})");
  EXPECT_EQ(error_of([&] { ChatTemplate::from_tokenizer_config(path); }),
            path + ": no chat_template (the tokenizer has no chat format; give a template file instead)");
  EXPECT_EQ(error_of([&] { ChatTemplate::from_tokenizer_config((dir_ / "absent.json").string()); }),
            (dir_ / "absent.json").string() + ": cannot read the file");
  const std::string broken = write("broken.json", R"({"chat_template": "{% if %}"})");
  EXPECT_EQ(error_of([&] { ChatTemplate::from_tokenizer_config(broken); }),
            broken + " chat_template line 1: expected an expression, got end of statement block");
}

TEST_F(ChatTemplateConfig, TemplateFile) {
  const std::string path = write("chat.jinja", "{% for m in messages %}\n  {{ m.content }}\n{% endfor %}\n");
  const ChatTemplate chat = ChatTemplate::from_file(path, "<s>", "</s>");
  EXPECT_EQ(chat.render(Json::parse(R"([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])"), true),
            "  a\n  b\n");
}

}  // namespace jinja_test
