# Sourced by the CPU-per-request scripts: writes keel.toml (one worker thread, access log off
# unless ACCESS_LOG names a destination: stdout, stderr or a file; KEEL_POOL: extra lines for
# the pool table, e.g. "assemble_non_streaming = false"; KEEL_VARIANT: extra lines for the
# variant, e.g. 'tokenizer = "o200k"'),
# pool `bench` on 127.0.0.1:19400) and sim.toml (one zero-latency keel-sim server on 19401) into
# the current directory. GAP_MS sets the server's gap between tokens (default 0: zero latency). With PROTOCOL=anthropic the variant speaks Anthropic's Messages API
# (clients then use `--endpoint messages` and the base URL without `/v1`).
zero_latency_configs() {
  local url=http://127.0.0.1:19401/v1
  [ "${PROTOCOL:-openai}" = anthropic ] && url=http://127.0.0.1:19401
  cat > keel.toml <<TOML
worker_threads = 1
listen = "127.0.0.1:19400"
[log]
access = "${ACCESS_LOG:-off}"
[[pools]]
name = "bench"
${KEEL_POOL:-}
[[pools.variants]]
name = "fast"
url = "$url"
protocol = "${PROTOCOL:-openai}"
upstream_model = "sim"
${KEEL_VARIANT:-}
TOML
  cat > sim.toml <<TOML
[[servers]]
name = "fast"
port = 19401
ttft_ms = 0.0
ttft_sigma = 0.0
prefill_us_per_token = 0.0
gap_ms = ${GAP_MS:-0.0}
gap_sigma = 0.0
capacity = 100000
TOML
}
