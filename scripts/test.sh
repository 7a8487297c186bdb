#!/usr/bin/env bash
# Runs every test: Rust unit and integration tests (keel-core, keel-sim, keel-gateway) and the
# official-SDK tests (Python openai + anthropic against `keel demo`). Installs what they need.
set -euo pipefail
cd "$(dirname "$0")/.."

# Tests talk to loopback only; never route it through a proxy from the environment.
export NO_PROXY="127.0.0.1,localhost,::1${NO_PROXY:+,$NO_PROXY}"
export no_proxy="$NO_PROXY"

echo "== python test dependencies"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check openai anthropic pytest

echo "== build"
cargo build --workspace --bins

echo "== rust tests"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast
else
  cargo test --workspace --no-fail-fast
fi

echo "== SDK tests"
KEEL_BIN="$PWD/target/debug/keel" .venv/bin/python -m pytest -q tests/python
