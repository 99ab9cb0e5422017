"""Draw a saved gauge state (scripts/gpu_gauge_state.py) in headless Chromium with the shipped bundle.

    python scripts/render_gauge.py STATE.json OUT.png
"""

from __future__ import annotations

import json
import sys

PAGE = """<!doctype html><html><head><meta charset="utf-8"></head>
<body style="margin:0;width:380px;font-family:sans-serif"><div id="el"></div><script type="module">
import gauge from "./gauge.js";
window.mount = (state) => {
  const model = {get: (k) => state[k], on() {}, off() {}, send() {}};
  gauge.render({model, el: document.getElementById("el")});
};
</script></body></html>"""
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def main(state_path: str, png: str) -> None:
    from playwright.sync_api import sync_playwright

    from nbmem.ui.frontend import bundle

    state = json.load(open(state_path))
    files = {"index.html": PAGE, "gauge.js": bundle()}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 400, "height": 1400})
        page.route("http://nbmem.test/**", lambda route: route.fulfill(
            body=files[route.request.url.rsplit("/", 1)[-1]],
            content_type="text/html" if route.request.url.endswith(".html") else "text/javascript"))
        page.goto("http://nbmem.test/index.html")
        page.wait_for_function("() => typeof window.mount === 'function'")
        page.evaluate("s => window.mount(s)", state)
        page.locator(".nbmem-gauge").screenshot(path=png)
        browser.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
