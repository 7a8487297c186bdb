#!/usr/bin/env bash
# The Kubernetes manifests (deploy/k8s/) as the test command checks them:
#   1. every manifest validates against the pinned Kubernetes version's schemas, strictly
#      (kubernetes-validate from PyPI, whose schemas ship in the package: no network needed),
#      and a deliberately broken copy does not (so a validator that accepts anything fails here);
#   2. the manifests agree with each other and with keel.toml (tests/deploy/k8s_check.py);
#   3. `keel check` refuses the ConfigMap's keel.toml as shipped (its keys' secrets are published
#      in the Secret example) and accepts it with fresh keys, with the Secret's values as
#      environment.
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
# The example's keys are published beside it (deploy/k8s/secret.yaml): keel must refuse to
# start with them, naming each, so that nobody deploys the example as it is.
if env "${env_args[@]}" "$keel" check --config "$tmp/keel.toml" > "$tmp/check.out" 2>&1; then
  echo "FAIL: keel check accepted the example's published keys" >&2
  cat "$tmp/check.out" >&2
  exit 1
fi
refused=$(grep -c 'published in keel' "$tmp/check.out" || true)
if [ "$refused" != 3 ]; then
  echo "FAIL: expected the 3 example keys refused as published, got $refused:" >&2
  cat "$tmp/check.out" >&2
  exit 1
fi
echo "   the example's published keys are refused ($refused of 3)"
# With fresh keys in their place (as deploy/k8s/secret.yaml tells the operator to make), the
# ConfigMap is a complete, valid config.
cp "$tmp/keel.toml" "$tmp/fresh.toml"
for old in $(grep -o 'sha256:[0-9a-f]\{64\}' "$tmp/keel.toml"); do
  new=$("$keel" keys new --id fresh | grep -o 'sha256:[0-9a-f]\{64\}')
  sed -i "s/$old/$new/" "$tmp/fresh.toml"
done
env "${env_args[@]}" "$keel" check --config "$tmp/fresh.toml" 2>&1 | tee "$tmp/check.out"
# An example config should teach nothing keel warns about.
if grep -q 'warning' "$tmp/check.out"; then
  echo "FAIL: keel check warns about the ConfigMap's keel.toml" >&2
  exit 1
fi
