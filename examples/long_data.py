#!/usr/bin/env python3
"""One JSONL record per book of the King James Bible, for examples/long.yaml.

Reads the text of Debian's `bible` (package bible-kjv) on stdin and writes
{"text": ...} per book on stdout, the book's chapters in order. `prepare`
keeps one document per record, so `data.pack: documents` packs whole books
into each window and attention never crosses from one book into the next.

  bible "gen1:1-rev22:21" | python3 examples/long_data.py > data/kjv_books.jsonl
"""
import json
import re
import sys


def books(lines):
    """(book name, its text) in order: a chapter heading is a line "<Book> <n>"
    after a blank line, and a book begins at its chapter 1."""
    name, text, after_blank = None, [], True
    for line in lines:
        line = line.rstrip("\n")
        heading = re.match(r"^(\S.*) (\d+)$", line) if after_blank else None
        if heading and heading.group(2) == "1" and heading.group(1) != name:
            if name is not None:
                yield name, "\n".join(text).strip() + "\n"
            name, text = heading.group(1), []
        text.append(line)
        after_blank = not line.strip()
    if name is not None:
        yield name, "\n".join(text).strip() + "\n"


def main():
    count = 0
    for _, text in books(sys.stdin):
        sys.stdout.write(json.dumps({"text": text}) + "\n")
        count += 1
    print(f"long_data.py: {count} books", file=sys.stderr)


if __name__ == "__main__":
    main()
