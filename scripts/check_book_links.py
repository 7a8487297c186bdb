#!/usr/bin/env python3
"""Checks the built book, and the links README and bench/RESULTS.md make.

usage: check_book_links.py BOOK_DIR

Every relative link and resource in the book's HTML (href, src) must name a file inside
BOOK_DIR, and a link's #fragment must be an id in the page it names. Every relative link in
README.md and bench/RESULTS.md must name a file of the repository; a link to
docs/src/X.md#frag must name an id of the built X.html, and a bare #frag a heading of the
file itself. Prints every broken link, then exits 1 if there was one.
"""

import html.parser
import os
import re
import sys
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKDOWN = ["README.md", "bench/RESULTS.md"]
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


class Page(html.parser.HTMLParser):
    """The ids a page defines and the links (href, src) it makes."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids, self.links, self.base = set(), [], None

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value)
            elif tag == "base" and name == "href":
                # The page is served at any path (404.html): its links are from the site's root.
                self.base = value
            elif name in ("href", "src"):
                self.links.append((tag, value))


def parse(path, cache={}):
    if path not in cache:
        page = Page()
        with open(path, encoding="utf-8") as f:
            page.feed(f.read())
        cache[path] = page
    return cache[path]


def check_target(base_file, link, root, problems, where):
    """Resolves `link` from `base_file` and checks it names a file under `root` (and an id)."""
    parsed = urllib.parse.urlsplit(link)
    path = urllib.parse.unquote(parsed.path)
    target = base_file if path == "" else os.path.normpath(
        os.path.join(os.path.dirname(base_file), path))
    if os.path.commonpath([target, root]) != root:
        problems.append(f"{where}: {link} leaves {root}")
        return None
    if os.path.isdir(target):
        if base_file.endswith(".md"):
            return target  # a folder, as a repository's page shows it
        target = os.path.join(target, "index.html")
    if not os.path.isfile(target):
        problems.append(f"{where}: {link} names no file")
        return None
    frag = urllib.parse.unquote(parsed.fragment)
    if frag and target.endswith(".html") and frag not in parse(target).ids:
        problems.append(f"{where}: {link}: no id {frag!r} in {os.path.relpath(target, root)}")
    return target


def check_book(book, problems):
    pages = 0
    for dirpath, _, files in os.walk(book):
        for name in files:
            if not name.endswith(".html"):
                continue
            path = os.path.join(dirpath, name)
            pages += 1
            page = parse(path)
            # A <base href="/"> page resolves its links (but its own #anchors) from the book's root.
            base = os.path.join(book, "index.html") if page.base == "/" else path
            for tag, link in page.links:
                if EXTERNAL.match(link) or link == "#":
                    continue
                start = path if link.startswith("#") else base
                check_target(start, link, book, problems, os.path.relpath(path, book))
    return pages


def github_slug(heading):
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def markdown_links(text):
    """Inline links and images outside code blocks and code spans."""
    out, fence = [], False
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        out += [(n, m) for m in re.findall(r"\]\(([^)\s]+)\)", line)]
    return out


def check_markdown(name, book, problems):
    readme = os.path.join(ROOT, name)
    text = open(readme, encoding="utf-8").read()
    headings = {github_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}
    src = os.path.join(ROOT, "docs", "src")
    count = 0
    for n, link in markdown_links(text):
        if EXTERNAL.match(link):
            continue
        count += 1
        where = f"{name}:{n}"
        parsed = urllib.parse.urlsplit(link)
        if not parsed.path:
            if parsed.fragment not in headings:
                problems.append(f"{where}: {link}: no such heading")
            continue
        target = check_target(readme, parsed.path, ROOT, problems, where)
        if target and parsed.fragment:
            if os.path.dirname(target) != src or not target.endswith(".md"):
                problems.append(f"{where}: {link}: a fragment only into docs/src/*.md")
                continue
            page = os.path.join(book, os.path.basename(target)[:-3] + ".html")
            check_target(page, "#" + parsed.fragment, book, problems, where)
    return count


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    book = os.path.abspath(sys.argv[1])
    problems = []
    pages = check_book(book, problems)
    links = sum(check_markdown(name, book, problems) for name in MARKDOWN)
    for p in problems:
        print("broken link: " + p)
    print(f"{pages} pages and {links} links of {', '.join(MARKDOWN)} checked, "
          f"{len(problems)} broken")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
