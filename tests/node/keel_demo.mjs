// `keel demo` (simulated fleet + gateway) as a process the SDK tests start and drive.
//
// startDemo() finds free ports, starts the demo and waits until the gateway answers. The demo
// it returns knows which simulated server backs each variant (read from the demo's own
// config), so a test can inject a fault into the server behind a variant and look up keel's
// decision record for a request.
import { spawn, execFileSync } from "node:child_process";
import { createServer } from "node:net";
import path from "node:path";
import { fileURLToPath } from "node:url";

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..");
const KEEL = process.env.KEEL_BIN ?? path.join(ROOT, "target", "debug", "keel");
const SIM_SERVERS = 6;

function canListen(port) {
  return new Promise((resolve) => {
    const srv = createServer();
    srv.once("error", () => resolve(false));
    srv.listen(port, "127.0.0.1", () => srv.close(() => resolve(true)));
  });
}

export function freePort() {
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.once("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
  });
}

async function blockFree(first) {
  for (let p = first; p < first + SIM_SERVERS; p++) if (!(await canListen(p))) return false;
  return true;
}

/** Variant name -> its simulated server's base URL, from `keel demo --print-config`. */
function variantServers(simBase) {
  const config = execFileSync(KEEL, ["demo", "--print-config", "--sim-base-port", String(simBase)], {
    encoding: "utf8",
  });
  const servers = {};
  for (const m of config.matchAll(/^name = "([^"]+)"\nurl = "(http:\/\/[^"/]+)[^"]*"/gm)) servers[m[1]] = m[2];
  return servers;
}

async function json(method, url, body) {
  const r = await fetch(url, {
    method,
    headers: { "content-type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!r.ok) throw new Error(`${method} ${url}: ${r.status} ${await r.text()}`);
  return r.json();
}

async function waitUntilUp(proc, url) {
  const deadline = Date.now() + 30_000;
  while (proc.exitCode === null && Date.now() < deadline) {
    try {
      if ((await fetch(`${url}/keel/health`)).ok) return true;
    } catch {
      // not listening yet
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  return false;
}

/**
 * Starts `keel demo` on a free gateway port and a block of free fleet ports within
 * `simRange` (another run may take a port between the probe and the start: then it tries again).
 */
// The ranges lie outside the kernel's ephemeral ports (32768-60999 by default): on a busy machine
// outgoing connections, and their TIME_WAIT, hold thousands of those.
export async function startDemo({ simRange = [2000, 10000], tries = 5 } = {}) {
  let output = "";
  for (let i = 0; i < tries; i++) {
    const port = await freePort();
    const simBase = simRange[0] + Math.floor(Math.random() * (simRange[1] - simRange[0] - SIM_SERVERS));
    if (!(await blockFree(simBase))) continue;
    // --faults: the server behind gpt-flaky and embed-flaky fails on purpose, so that every test
    // also shows the SDK never sees a failure keel can fail over.
    const args = ["demo", "--faults", "--listen", `127.0.0.1:${port}`, "--sim-base-port", String(simBase)];
    const proc = spawn(KEEL, args, {
      stdio: ["ignore", "pipe", "pipe"],
    });
    output = "";
    proc.stdout.on("data", (d) => (output += d));
    proc.stderr.on("data", (d) => (output += d));
    const url = `http://127.0.0.1:${port}`;
    if (await waitUntilUp(proc, url)) return new Demo(proc, url, variantServers(simBase));
    proc.kill();
  }
  throw new Error(`keel demo did not start:\n${output}`);
}

class Demo {
  constructor(proc, url, servers) {
    this.proc = proc;
    this.url = url;
    this.servers = servers;
  }

  /** Injects a fault into the simulated server behind `variant` (see keel-sim's faults). */
  addFault(variant, spec) {
    return json("POST", `${this.servers[variant]}/sim/faults`, spec);
  }

  async clearFaults() {
    for (const server of new Set(Object.values(this.servers))) await json("DELETE", `${server}/sim/faults`);
  }

  /** keel's decision record for one request: the plan and every attempt made. */
  async decision(requestId) {
    const found = (await json("GET", `${this.url}/keel/decisions`)).find((d) => d.request_id === requestId);
    if (!found) throw new Error(`no decision record for request ${requestId}`);
    return found;
  }

  stop() {
    this.proc.kill();
  }
}
