wrk.method = "POST"
wrk.body = '{"model":"bench","messages":[{"role":"user","content":"say hi"}],"max_tokens":64,"stream":true,"stream_options":{"include_usage":true}}'
wrk.headers["Content-Type"] = "application/json"
