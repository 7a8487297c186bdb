#!/usr/bin/env bash
# nginx as the classic round-robin baseline over a simulated fleet, with the retries people
# usually configure: bench/peers/nginx.sh DIR PORT BASE_URL... (http://host:port/v1)
# Writes DIR/nginx.conf and starts Debian's nginx (daemonised; pid in DIR/nginx.pid).
set -euo pipefail
mkdir -p "$1"
dir=$(cd "$1" && pwd)
port=$2
shift 2
command -v nginx >/dev/null || { echo "nginx not installed (apt-get install -y nginx)" >&2; exit 1; }
mkdir -p "$dir/logs"
{
  echo "user root;"
  echo "worker_processes 1;"
  echo "pid $dir/nginx.pid;"
  echo "error_log $dir/logs/error.log warn;"
  # Room for 5,000 live streams (two connections each): `--streams 5000` measures nginx holding
  # them, not its connection limit.
  echo "worker_rlimit_nofile 20000;"
  echo "events { worker_connections 16384; }"
  echo "http {"
  echo "  access_log off;"
  echo "  upstream fleet {"
  for u in "$@"; do
    hostport=${u#http://}
    echo "    server ${hostport%%/*} max_fails=0;"
  done
  echo "    keepalive 64;"
  echo "  }"
  echo "  server {"
  echo "    listen 127.0.0.1:$port;"
  echo "    location / {"
  echo "      proxy_pass http://fleet;"
  echo "      proxy_http_version 1.1;"
  echo "      proxy_set_header Connection \"\";"
  echo "      proxy_buffering off;"
  echo "      proxy_request_buffering off;"
  echo "      proxy_next_upstream error timeout http_429 http_502 http_503 non_idempotent;"
  echo "      proxy_next_upstream_tries 3;"
  echo "      proxy_connect_timeout 1s;"
  echo "      proxy_read_timeout 15s;"
  echo "      proxy_send_timeout 15s;"
  echo "    }"
  echo "  }"
  echo "}"
} > "$dir/nginx.conf"
nginx -c "$dir/nginx.conf" -p "$dir"
