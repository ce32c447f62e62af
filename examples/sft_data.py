#!/usr/bin/env python3
"""Chat-format JSONL for examples/sft.yaml from the King James Bible.

Reads the text of Debian's `bible` (package bible-kjv) on stdin and writes
one conversation per verse on stdout: a system turn, the user asking for the
verse by its reference, the assistant quoting it; every third conversation
goes on to ask for the next verse (two assistant turns).

  bible "gen1:1-rev22:21" | python3 examples/sft_data.py > data/kjv_chat.jsonl
"""
import json
import re
import sys

SYSTEM = "You quote the King James Bible, verse by verse."


def verses(lines):
    """(book chapter, verse number, text) for every verse of `bible`'s output:
    a chapter heading follows a blank line, a verse starts indented with its
    number, and its text wraps onto unindented lines."""
    chapter, number, text, after_blank = None, None, [], True
    for line in lines:
        line = line.rstrip("\n")
        verse = re.match(r"^\s+(\d+) (.*)$", line)
        if (verse or (after_blank and line.strip())) and number is not None:
            yield chapter, number, " ".join(text)
            number = None
        if verse:
            number, text = verse.group(1), [verse.group(2).strip()]
        elif after_blank and line.strip():
            chapter = line.strip()
        elif line.strip() and number is not None:
            text.append(line.strip())
        after_blank = not line.strip()
    if number is not None:
        yield chapter, number, " ".join(text)


def main():
    all_verses = list(verses(sys.stdin))
    for i, (chapter, number, text) in enumerate(all_verses):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Quote %s:%s." % (chapter, number)},
                    {"role": "assistant", "content": text}]
        if i % 3 == 0 and i + 1 < len(all_verses) and all_verses[i + 1][0] == chapter:
            messages += [{"role": "user", "content": "And the next verse?"},
                         {"role": "assistant", "content": all_verses[i + 1][2]}]
        print(json.dumps({"messages": messages}, ensure_ascii=False))


if __name__ == "__main__":
    main()
