// Starts `keel demo` (a simulated fleet and the gateway) for a test file: shared by the SDK test
// files so that each starts its own demo the same way.
import { spawn } from "node:child_process";
import { createServer } from "node:net";
import path from "node:path";
import { fileURLToPath } from "node:url";

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..");
const KEEL = process.env.KEEL_BIN ?? path.join(ROOT, "target", "debug", "keel");

function freePort() {
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.once("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
  });
}

/**
 * Starts the demo and waits until it answers `/keel/health`. `slot` picks a block of six
 * consecutive ports for the simulated fleet, so that test files run in parallel (and the
 * Python tests) do not collide. Returns `{ url, stop }`.
 */
export async function startDemo(slot = 0) {
  const port = await freePort();
  const simBase = 30000 + slot * 12000 + (process.pid % 2000) * 6;
  const demo = spawn(KEEL, ["demo", "--listen", `127.0.0.1:${port}`, "--sim-base-port", String(simBase)], {
    stdio: ["ignore", "pipe", "pipe"],
  });
  let output = "";
  demo.stdout.on("data", (d) => (output += d));
  demo.stderr.on("data", (d) => (output += d));
  const url = `http://127.0.0.1:${port}`;
  const deadline = Date.now() + 30_000;
  for (;;) {
    try {
      const r = await fetch(`${url}/keel/health`);
      if (r.ok) break;
    } catch {
      // not listening yet
    }
    if (demo.exitCode !== null || Date.now() > deadline) {
      demo.kill();
      throw new Error(`keel demo did not start:\n${output}`);
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  return { url, stop: () => demo.kill() };
}
