#!/usr/bin/python3
"""Reference renderer: Python's Jinja2 configured the way Hugging Face
transformers configures it for chat templates (_compile_jinja_template in
transformers/utils/chat_template_utils.py): an ImmutableSandboxedEnvironment
with trim_blocks and lstrip_blocks, the loopcontrols extension, a
`{% generation %}` block that renders its body, a tojson filter that is
json.dumps(ensure_ascii=False, sort_keys=False), raise_exception and
strftime_now globals.

Usage: render.py CASES.json
CASES.json: {"cases": [{"id": str, "template": str, "context": {...},
                        "now": unix seconds (optional; strftime_now formats it in UTC)}]}
Prints a JSON list [{"id": ..., "output": str} or {"id": ..., "error": str}].
"""
import datetime
import json
import sys

import jinja2
from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class Generation(Extension):
    """{% generation %}...{% endgeneration %}: renders its body (transformers
    uses it to record which characters the assistant wrote)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def raise_exception(message):
    raise TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def environment(now):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    when = datetime.datetime.fromtimestamp(now, tz=datetime.timezone.utc) if now is not None else None
    env.globals["strftime_now"] = lambda fmt: (when or datetime.datetime.now()).strftime(fmt)
    return env


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    results = []
    compiled = {}  # (now, source) -> template: cases share their templates
    for case in cases:
        try:
            key = (case.get("now"), case["template"])
            if key not in compiled:
                compiled[key] = environment(case.get("now")).from_string(case["template"])
            template = compiled[key]
            results.append({"id": case["id"], "output": template.render(**case["context"])})
        except Exception as e:  # a template error is a result, like an output
            results.append({"id": case["id"], "error": f"{type(e).__name__}: {e}"})
    json.dump(results, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
