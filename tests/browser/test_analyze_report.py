"""`keel analyze`'s report.html in a real headless Chromium (Debian's, through Playwright, as the
dashboard test does): the report of `keel bench analyze`'s first run (three workloads through
keel) must render its heat map and per-pool charts with no console error and no network request
(it is one self-contained file); so must the report of a synthetic day-long log (three pools by
24 hours), whose screenshot goes to bench/out/analyze-report.png (docs/src/analyze-report.png is a
copy).
"""
import os
import subprocess
import tempfile

from playwright import sync_api as playwright

from keel_demo import KEEL, ROOT

CHROMIUM = "/usr/bin/chromium"
OUT = os.path.join(ROOT, "bench", "out")


def test_the_report_renders_offline_without_errors():
    assert os.path.exists(CHROMIUM), f"{CHROMIUM} missing: apt-get install -y chromium"
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run(
            [KEEL, "bench", "analyze", "--requests", "150", "--log-mb", "3", "--out", out],
            capture_output=True, text=True, timeout=120,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        report = os.path.join(out, "truth", "report.html")
        url = "file://" + report
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
            )
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors, requests = [], []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(url)
            page.wait_for_load_state("load")
            # One heat-map row per pool, a cell for the run's hour(s) in each.
            cells = page.locator("#heatmap rect.cell")
            assert cells.count() >= 3, page.content()[:2000]
            box = page.locator("#heatmap").bounding_box()
            assert box and box["width"] > 100 and box["height"] > 60, box
            for pool in ["templated", "chat", "mixed"]:
                assert page.locator(f"h2#pool-{pool}").count() == 1, pool
            assert page.locator("svg.hours").count() == 3
            assert "enable `[pools.cache]`" in page.inner_text("ol.recs")
            assert errors == [], errors
            assert requests == [url], requests
            # The synthetic day-long log's report: a full heat map, for the screenshot.
            day = "file://" + os.path.join(out, "throughput", "report.html")
            requests.clear()
            page.goto(day)
            page.wait_for_load_state("load")
            assert page.locator("#heatmap rect.cell").count() >= 3 * 24
            assert errors == [], errors
            assert requests == [day], requests
            os.makedirs(OUT, exist_ok=True)
            page.screenshot(path=os.path.join(OUT, "analyze-report.png"), full_page=True)
            browser.close()
