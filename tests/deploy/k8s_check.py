#!/usr/bin/env python3
"""Checks that deploy/k8s/ hangs together, beyond what a schema can see, and extracts what the
keel binary needs to check and serve the ConfigMap's config.

usage: k8s_check.py K8S_DIR OUT_DIR
  writes OUT_DIR/keel.toml (the ConfigMap's) and OUT_DIR/env (NAME=VALUE lines from the Secret
  keel itself reads), then checks, naming every failure:
  - the probes use keel's readiness and liveness endpoints on the port keel listens on;
  - terminationGracePeriodSeconds covers the preStop sleep, drain_ms and a margin;
  - every ${VAR} in keel.toml comes from the Secret the Deployment injects;
  - [redis] points at the Redis Service and its port;
  - every virtual key (and the admin key) in the keys Secret hashes to its entry in keel.toml;
  - the Service, PodDisruptionBudget and HPA select or target the keel Deployment;
  - worker_threads matches the CPU the Deployment requests.
Exit 1 on any failure.
"""

import glob
import hashlib
import os
import re
import sys
import tomllib
from urllib.parse import urlsplit

import yaml

# Seconds between the end of keel's drain and SIGKILL: the process must exit in it.
MARGIN_S = 5

failures = []


def check(ok, what):
    print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        failures.append(what)


def load(k8s_dir):
    """{(kind, name): resource} over every document of every manifest."""
    found = {}
    for path in sorted(glob.glob(os.path.join(k8s_dir, "*.yaml"))):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def need(res, kind, name):
    if (kind, name) not in res:
        sys.exit(f"k8s_check: no {kind} named {name} in the manifests")
    return res[(kind, name)]


def secret_data(secret):
    # The manifests write stringData (plain text); data would be base64.
    return secret.get("stringData", {})


def main():
    k8s_dir, out = sys.argv[1], sys.argv[2]
    res = load(k8s_dir)
    cm = need(res, "ConfigMap", "keel-config")
    deploy = need(res, "Deployment", "keel")
    text = cm["data"]["keel.toml"]
    cfg = tomllib.loads(text)
    pod = deploy["spec"]["template"]["spec"]
    (keel,) = [c for c in pod["containers"] if c["name"] == "keel"]

    env_secrets = [e["secretRef"]["name"] for e in keel.get("envFrom", []) if "secretRef" in e]
    check(len(env_secrets) == 1, f"the keel container takes its environment from one Secret ({env_secrets})")
    env = secret_data(need(res, "Secret", env_secrets[0])) if env_secrets else {}
    with open(os.path.join(out, "keel.toml"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "env"), "w") as f:
        f.writelines(f"{k}={v}\n" for k, v in env.items())

    print("deployment")
    listen_port = int(cfg.get("listen", "127.0.0.1:8080").rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in keel["ports"]}
    check(ports.get("http") == listen_port, f"containerPort http ({ports.get('http')}) is keel's listen port ({listen_port})")
    check(cfg.get("listen", "").startswith("0.0.0.0:"), "keel listens on every interface of the pod")
    for probe, path in (("readinessProbe", "/keel/ready"), ("livenessProbe", "/keel/live")):
        got = keel.get(probe, {}).get("httpGet", {})
        check(got.get("path") == path and got.get("port") == "http", f"{probe} is GET {path} on port http (got {got})")
    drain_s = cfg.get("drain_ms", 30000) / 1000
    pre_stop = keel.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    grace = pod.get("terminationGracePeriodSeconds", 30)
    check(grace >= pre_stop + drain_s + MARGIN_S,
          f"terminationGracePeriodSeconds {grace} ≥ preStop sleep {pre_stop} + drain_ms {drain_s:g} s + {MARGIN_S} s")
    mounts = {m["name"]: m["mountPath"] for m in keel.get("volumeMounts", [])}
    config_volumes = [v["name"] for v in pod.get("volumes", []) if v.get("configMap", {}).get("name") == "keel-config"]
    check(len(config_volumes) == 1 and mounts.get(config_volumes[0]) == "/etc/keel",
          "the ConfigMap is mounted at /etc/keel (the image's --config /etc/keel/keel.toml)")
    cpu = keel["resources"]["requests"]["cpu"]
    check(str(cfg.get("worker_threads")) == str(cpu), f"worker_threads ({cfg.get('worker_threads')}) = requested cores ({cpu})")

    print("secrets")
    used = sorted(set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", text)))
    for var in used:
        check(var in env, f"${{{var}}} in keel.toml is in Secret {env_secrets[0] if env_secrets else '?'}")
    keys = secret_data(need(res, "Secret", "keel-virtual-keys"))
    wanted = {k["id"]: k["hash"] for k in cfg.get("keys", [])}
    if "admin" in cfg:
        wanted["admin"] = cfg["admin"]["key_hash"]
    for key_id, hashed in wanted.items():
        plain = keys.get(key_id)
        got = "sha256:" + hashlib.sha256(plain.encode()).hexdigest() if plain else None
        check(got == hashed, f"virtual key {key_id!r} in Secret keel-virtual-keys hashes to its entry in keel.toml")

    print("redis")
    redis_url = urlsplit(cfg["redis"]["url"])
    svc = need(res, "Service", redis_url.hostname)
    check(any(p["port"] == (redis_url.port or 6379) for p in svc["spec"]["ports"]),
          f"[redis] url's port is Service {redis_url.hostname}'s port")
    redis = need(res, "Deployment", "keel-redis")
    check(svc["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items(),
          "Service keel-redis selects the Redis pods")
    redis_env = redis["spec"]["template"]["spec"]["containers"][0].get("env", [])
    refs = [e["valueFrom"]["secretKeyRef"] for e in redis_env if "valueFrom" in e]
    check(any(r["name"] in env_secrets and r["key"] in env for r in refs),
          "Redis takes its password from the Secret keel reads it from")

    print("service, disruption budget, autoscaler")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        obj = need(res, kind, "keel")
        selector = obj["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        check(selector.items() <= labels.items(), f"{kind} keel selects the keel pods")
    hpa = need(res, "HorizontalPodAutoscaler", "keel")
    target = hpa["spec"]["scaleTargetRef"]
    check((target["kind"], target["name"]) == ("Deployment", "keel"), "the HPA scales Deployment keel")
    check(hpa["spec"]["minReplicas"] >= 2, "the HPA keeps at least two replicas (the PDB can let one go)")

    if failures:
        sys.exit(f"k8s_check: {len(failures)} failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
