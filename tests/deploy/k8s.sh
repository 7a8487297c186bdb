#!/usr/bin/env bash
# The Kubernetes manifests (deploy/k8s/) as the test command checks them:
#   1. every manifest validates against the pinned Kubernetes version's schemas, strictly
#      (kubernetes-validate from PyPI, whose schemas ship in the package: no network needed),
#      and a deliberately broken copy does not (so a validator that accepts anything fails here);
#   2. the manifests agree with each other and with keel.toml (tests/deploy/k8s_check.py);
#   3. `keel check` accepts the ConfigMap's keel.toml, with the Secret's values as environment.
#
# usage: tests/deploy/k8s.sh KEEL_BINARY PYTHON   (PYTHON: a venv with kubernetes-validate, PyYAML)
set -euo pipefail
cd "$(dirname "$0")/../.."

keel="${1:?usage: $0 KEEL_BINARY PYTHON}"
python="${2:?usage: $0 KEEL_BINARY PYTHON}"
# The oldest Kubernetes the manifests need: the preStop `sleep` action is on by default from 1.30.
k8s_version=1.33.0
validate() { "$python" -m kubernetes_validate --strict --quiet -k "$k8s_version" "$@"; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "-- schemas: deploy/k8s/*.yaml against Kubernetes $k8s_version (unknown fields rejected)"
validate deploy/k8s/*.yaml
echo "   every manifest is valid"
sed 's/containerPort: 8080/containerPort: "eight-thousand-eighty"/' deploy/k8s/deployment.yaml > "$tmp/broken.yaml"
if validate "$tmp/broken.yaml" > "$tmp/broken.out" 2>&1; then
  echo "FAIL: the validator accepted a Deployment whose containerPort is a word" >&2
  exit 1
fi
echo "   control: a broken copy is rejected ($(grep -o 'containerPort[^,]*' "$tmp/broken.out" | head -1))"

echo "-- consistency between the manifests and keel.toml"
"$python" tests/deploy/k8s_check.py deploy/k8s "$tmp"

echo "-- keel check on the ConfigMap's keel.toml (environment: the Secret's values)"
env_args=()
while IFS= read -r line; do env_args+=("$line"); done < "$tmp/env"
env "${env_args[@]}" "$keel" check --config "$tmp/keel.toml" 2>&1 | tee "$tmp/check.out"
# An example config should teach nothing keel warns about.
if grep -q 'warning' "$tmp/check.out"; then
  echo "FAIL: keel check warns about the ConfigMap's keel.toml" >&2
  exit 1
fi
