"""The live dashboard (`/keel/dashboard`) in a real headless Chromium: Debian's `chromium`
driven by Playwright for Python (never `playwright install`: browser downloads are not possible
here, so the Debian binary is used through `executable_path`).

`test_dashboard_follows_a_failing_variant` opens the page against `keel demo`, waits for live
data, checks that the variants, the route mix and the health colour are shown, then fails one
variant through keel-sim's fault API while sending traffic and waits for the page to show it.
`test_fifty_variants_stay_readable` serves a generated 50-variant config and checks the heat
map still fits the window. Screenshots go to bench/out/ (ignored; docs/src/dashboard.png is a copy).
"""
import contextlib
import json
import os
import random
import socket
import subprocess
import tempfile
import time
import urllib.request

import httpx
import pytest
# scripts/test.sh installs it (pip install playwright); the browser is Debian's.
from playwright import sync_api as playwright

from keel_demo import KEEL, ROOT, free_port, start_demo, _ports_free, _wait_until_up

CHROMIUM = "/usr/bin/chromium"
OUT = os.path.join(ROOT, "bench", "out")
# A page's wait for a change it should see within a few snapshots (one a second).
WAIT_MS = 30_000


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} missing: apt-get install -y chromium (scripts/test.sh does)")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        yield b
        b.close()


@pytest.fixture
def demo():
    d = start_demo()
    yield d
    d.stop()


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def _cell(page, variant: str, signal: str) -> str:
    return page.inner_text(f'tr[data-variant="{variant}"] td[data-signal="{signal}"]')


def _route_count(page, route: str) -> int:
    return int(page.get_attribute(f'.route[data-route="{route}"] b', "data-count"))


def _chat(client: httpx.Client, n: int, headers=None) -> None:
    for i in range(n):
        r = client.post(
            "/v1/chat/completions",
            headers=headers or {},
            json={"model": "demo-gpt", "messages": [{"role": "user", "content": f"hi {i}"}]},
        )
        assert r.status_code == 200, r.text


def test_dashboard_follows_a_failing_variant(browser, demo):
    client = httpx.Client(base_url=demo.url, timeout=30)
    _chat(client, 3)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(demo.url + "/keel/dashboard")
    # Live data: a snapshot that counts the requests above has arrived and been drawn.
    page.wait_for_function(
        """() => ["direct", "fallback"].map(r => document.querySelector(`.route[data-route="${r}"] b`))
                 .reduce((n, b) => n + (b ? Number(b.dataset.count) : 0), 0) >= 3""",
        timeout=WAIT_MS,
    )

    # Every variant of the demo's pools has its row in the heat map.
    shown = page.eval_on_selector_all("tr[data-variant]", "rows => rows.map(r => r.dataset.variant)")
    assert sorted(shown) == sorted(demo.servers), shown
    # The route mix lists every route.
    routes = page.eval_on_selector_all(".route", "els => els.map(e => e.dataset.route)")
    for r in ("direct", "fallback", "hedged", "migrated", "throttled", "cached", "rejected"):
        assert r in routes, routes
    # The health colour: the gateway's own (green/yellow/red) where /keel/health reports one.
    health = _get_json(demo.url + "/keel/health")
    badge = page.locator("#health")
    assert badge.is_visible()
    assert badge.get_attribute("data-colour") == health.get("colour", "unknown")
    assert badge.inner_text().strip() != ""

    before_state = _cell(page, "gpt-b", "state")
    before_errors = _cell(page, "gpt-b", "errors")
    before_fallbacks = _route_count(page, "fallback")

    # gpt-b's server answers every request 503; requests pinned to it fall back elsewhere.
    demo.add_fault("gpt-b", kind="error", status=503)
    _chat(client, 8, headers={"x-keel-force-variant": "gpt-b"})
    client.close()

    page.wait_for_function(
        """([state, errors, fallbacks]) => {
            const cell = s => document.querySelector(`tr[data-variant="gpt-b"] td[data-signal="${s}"]`);
            const count = document.querySelector('.route[data-route="fallback"] b');
            const changed = cell("state").textContent !== state || cell("errors").textContent !== errors;
            return changed && Number(count.dataset.count) > fallbacks;
        }""",
        arg=[before_state, before_errors, before_fallbacks],
        timeout=WAIT_MS,
    )
    after_errors = _cell(page, "gpt-b", "errors")
    assert after_errors.endswith("%") and float(after_errors[:-1]) > 0, after_errors
    assert _route_count(page, "fallback") > before_fallbacks
    # The latest decisions link to their records.
    link = page.locator("#decisions a").first
    assert link.get_attribute("href").startswith("/keel/decisions/")
    # The workload-analysis panel (/keel/analyze): demo-gpt fingerprints its requests.
    page.wait_for_selector('#analyze tr[data-pool="demo-gpt"]', timeout=WAIT_MS)
    assert int(page.inner_text('#analyze tr[data-pool="demo-gpt"] td:nth-child(3)')) >= 3
    assert page.locator('#analyze tr[data-pool="demo-gpt"]').is_visible()
    row = page.locator('#analyze tr[data-pool="demo-gpt"]').bounding_box()
    head = page.locator("#analyze thead").bounding_box()
    assert row["y"] >= head["y"] + head["height"] - 1, (row, head)

    os.makedirs(OUT, exist_ok=True)
    page.screenshot(path=os.path.join(OUT, "dashboard.png"), full_page=True)
    page.close()


def _fifty_variant_config(port: int, sim_base: int, servers: int) -> str:
    lines = [f'listen = "127.0.0.1:{port}"']
    for p in range(3):
        lines += ["", "[[pools]]", f'name = "pool-{p}"']
        if p == 2:
            # A canary on the last pool: its state shows in the pool's header row.
            lines += ["[pools.canary]", 'candidates = ["pool2-variant-15"]', "steps = [5, 100]"]
        for v in range(17 if p < 2 else 16):
            server = sim_base + (p * 17 + v) % servers
            lines += [
                "",
                "[[pools.variants]]",
                f'name = "pool{p}-variant-{v:02}"',
                f'url = "http://127.0.0.1:{server}/v1"',
                'protocol = "openai"',
                'upstream_model = "sim"',
            ]
    return "\n".join(lines) + "\n"


def _start_sim(config, servers, env, log, tries=10):
    """`keel sim` on `servers` consecutive free ports, up (every port accepts) before it returns.
    A port of the block can be taken between the probe and the start; the simulator then exits
    ("Address already in use") and another block is tried. Once in CI the simulator did not
    start, and keel waited out the fleet's restart grace while the client timed out."""
    for _ in range(tries):
        # Below the kernel's ephemeral ports, which a busy machine's connections may fill.
        base = random.randrange(10000, 20000 - servers)
        if not _ports_free(base, servers):
            continue
        sim = subprocess.Popen([KEEL, "sim", "--config", str(config), "--base-port", str(base)],
                               stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 30
        while sim.poll() is None and time.time() < deadline:
            if all(_accepts(p) for p in range(base, base + servers)):
                return sim, base
            time.sleep(0.1)
        sim.terminate()
        sim.wait(timeout=30)
    raise AssertionError("keel sim did not start on a free block of ports")


def _accepts(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _served(tmp_path, sim_toml: str, servers: int, keel_config):
    """`keel sim` with `sim_toml` on a free block of `servers` ports, and `keel serve` with
    `keel_config(port, sim_base)` on a free port beside it; yields keel's URL. On a failure,
    what keel and the simulator said (warnings and errors) is printed: a request that took the
    client's whole timeout, once in CI, left nothing else to go on."""
    (tmp_path / "sim.toml").write_text(sim_toml)
    env = dict(os.environ, KEEL_LOG="warn")
    log = tempfile.TemporaryFile()
    sim, sim_base = _start_sim(tmp_path / "sim.toml", servers, env, log)
    # The simulator holds the ports from sim_base up: keel's must not be one of them.
    port = free_port()
    while sim_base <= port < sim_base + servers:
        port = free_port()
    (tmp_path / "keel.toml").write_text(keel_config(port, sim_base))
    keel = subprocess.Popen([KEEL, "serve", "--config", str(tmp_path / "keel.toml")],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        assert _wait_until_up(keel, url), "keel serve did not start"
        yield url
    except BaseException:
        log.seek(0)
        print(log.read()[-20_000:].decode(errors="replace"))
        raise
    finally:
        for p in (keel, sim):
            p.terminate()
            p.wait(timeout=30)


def test_fifty_variants_stay_readable(browser, tmp_path):
    servers = 5
    # Five fast simulated servers behind fifty variants (ten each) in three pools.
    sim_toml = '[[servers]]\nname = "s"\nreplicas = %d\nttft_ms = 5\ngap_ms = 1\ncapacity = 64\n' % servers
    config = lambda port, sim_base: _fifty_variant_config(port, sim_base, servers)
    with _served(tmp_path, sim_toml, servers, config) as url:
        with httpx.Client(base_url=url, timeout=30) as client:
            for i in range(30):
                client.post("/v1/chat/completions",
                            json={"model": f"pool-{i % 3}", "messages": [{"role": "user", "content": "x"}]})
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(url + "/keel/dashboard")
        page.wait_for_function("document.querySelectorAll('tr[data-variant]').length === 50", timeout=WAIT_MS)
        # Readable: no horizontal scrolling at 1400 px, one line per variant, names in full.
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        heights = page.eval_on_selector_all("tr[data-variant]", "rows => rows.map(r => r.getBoundingClientRect().height)")
        assert max(heights) < 30, heights
        names = page.eval_on_selector_all("tr[data-variant] td:first-child", "tds => tds.map(t => t.textContent)")
        assert len(set(names)) == 50 and all(n.startswith("pool") for n in names)
        # The canary pool's header says where its canary stands; the others say nothing of one.
        head = page.locator('tr[data-pool-row="pool-2"]')
        assert head.get_attribute("data-canary") == "rolling"
        assert "canary rolling at 5%" in head.inner_text()
        assert page.locator('tr[data-pool-row="pool-0"]').get_attribute("data-canary") is None
        os.makedirs(OUT, exist_ok=True)
        page.screenshot(path=os.path.join(OUT, "dashboard-50.png"), full_page=True)
        page.close()


def test_with_keys_the_dashboard_asks_for_a_key_and_keeps_it_out_of_urls(browser, tmp_path):
    """With keys configured, the page shows no data until it is given the admin key (or an ops
    key); a tenant's key is refused; the key never appears in a URL the page requests."""
    import hashlib

    def sha(k):
        return "sha256:" + hashlib.sha256(k.encode()).hexdigest()

    admin, tenant = "sk-keel-browser-admin-0123456789abcdef", "sk-keel-browser-tenant-0123456789abcd"

    def config(port, sim_base):
        return (
            f'listen = "127.0.0.1:{port}"\n[admin]\nkey_hash = "{sha(admin)}"\n'
            f'[[keys]]\nid = "tenant"\nhash = "{sha(tenant)}"\n'
            f'[[pools]]\nname = "p"\n[[pools.variants]]\nname = "v"\nurl = "http://127.0.0.1:{sim_base}/v1"\n'
            'protocol = "openai"\nupstream_model = "sim"\n'
        )

    sim_toml = '[[servers]]\nname = "s"\nreplicas = 1\nttft_ms = 5\ngap_ms = 1\n'
    with _served(tmp_path, sim_toml, 1, config) as url:
        with httpx.Client(base_url=url, timeout=30) as client:
            r = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {tenant}"},
                            json={"model": "p", "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 200, r.text
            assert client.get("/keel/events").status_code == 401
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        requested = []
        page.on("request", lambda req: requested.append(req.url))
        page.goto(url + "/keel/dashboard")
        page.wait_for_selector("#login:not([hidden])", timeout=WAIT_MS)
        assert page.locator("tr[data-variant]").count() == 0
        # A tenant's key may not read the operations plane.
        page.fill("#login-key", tenant)
        page.click("#login button")
        page.wait_for_function(
            "document.getElementById('login-error').textContent.includes('may not')", timeout=WAIT_MS)
        assert page.locator("tr[data-variant]").count() == 0
        # The admin key shows the fleet.
        page.fill("#login-key", admin)
        page.click("#login button")
        page.wait_for_function("document.querySelectorAll('tr[data-variant]').length === 1", timeout=WAIT_MS)
        assert page.locator("#login").is_hidden()
        assert not any(admin in u or tenant in u for u in requested), requested
        page.close()
