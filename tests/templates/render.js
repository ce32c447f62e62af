// Reference renderer: @huggingface/jinja, the chat-template renderer of
// transformers.js (pinned in scripts/install-deps.sh). It renders with
// trim_blocks and lstrip_blocks, as transformers does.
//
// Usage: node render.js NPM_DIR CASES.json
// CASES.json: {"cases": [{"id", "template", "context", "now" (optional unix
// seconds: strftime_now formats it in UTC)}]}
// Prints a JSON list [{"id", "output"} or {"id", "error"}].
"use strict";
const fs = require("fs");
const path = require("path");

const [npmDir, casesPath] = process.argv.slice(2);
const { Template, Environment } = require(path.join(npmDir, "node_modules", "@huggingface", "jinja"));

// Template.render declares its globals (strftime_now among them) and then the
// context's keys, refusing a name declared twice: let the context's
// strftime_now replace the global one.
const declare = Environment.prototype.set;
Environment.prototype.set = function (name, value) {
  if (name === "strftime_now" && this.variables.has(name)) this.variables.delete(name);
  return declare.call(this, name, value);
};

const MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
                "October", "November", "December"];
const DAYS = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];

// Python's strftime in the C locale, for the directives chat templates use, in UTC.
function strftime(date, format) {
  const pad2 = (n) => String(n).padStart(2, "0");
  const fields = {
    Y: () => String(date.getUTCFullYear()), m: () => pad2(date.getUTCMonth() + 1),
    d: () => pad2(date.getUTCDate()), H: () => pad2(date.getUTCHours()),
    M: () => pad2(date.getUTCMinutes()), S: () => pad2(date.getUTCSeconds()),
    B: () => MONTHS[date.getUTCMonth()], b: () => MONTHS[date.getUTCMonth()].slice(0, 3),
    A: () => DAYS[date.getUTCDay()], a: () => DAYS[date.getUTCDay()].slice(0, 3), "%": () => "%",
  };
  return format.replace(/%(.)/g, (all, c) => (fields[c] ? fields[c]() : all));
}

const cases = JSON.parse(fs.readFileSync(casesPath, "utf8")).cases;
const results = cases.map((c) => {
  try {
    const context = { ...c.context };
    if (c.now !== undefined && c.now !== null) {
      const when = new Date(c.now * 1000);
      context.strftime_now = (fmt) => strftime(when, fmt);
    }
    return { id: c.id, output: new Template(c.template).render(context) };
  } catch (e) {
    return { id: c.id, error: `${e.name}: ${e.message}` };
  }
});
process.stdout.write(JSON.stringify(results));
