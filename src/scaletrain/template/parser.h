#pragma once
// Tokens to the statement tree, with Jinja's grammar and operator
// precedence; unsupported tags, filters and tests are refused here, with the
// line, before anything renders.
#include <string>
#include <vector>

#include "scaletrain/template/ast.h"
#include "scaletrain/template/lexer.h"

namespace scaletrain::tmpl {

// Throws UsageError "<source_name> line N: <problem>".
Body parse(std::vector<Token> tokens, const std::string& source_name);

}  // namespace scaletrain::tmpl
