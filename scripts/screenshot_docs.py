"""Build the documentation site and take headless-Chromium screenshots of some of its pages.

    python scripts/screenshot_docs.py                      # home page and Hub VLM page -> docs/notes/screenshots/
    python scripts/screenshot_docs.py --pages index hub-vlms configuration --out /tmp/shots --height 3000

For looking at the rendered site (navigation, code blocks, tables) without a desktop. Needs the docs extra
(`pip install -e ".[docs]"`) and a Chromium binary (`apt-get install chromium`, or set CHROMIUM=/path). Not run
by the test suite or CI: no browser is installed there (the tests build the site with `mkdocs build --strict`).
The site is served on localhost while the screenshots are taken; the PNGs are saved as 256-colour images to
stay small.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def chromium() -> str:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome", "chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    sys.exit("no Chromium found: apt-get install chromium, or set CHROMIUM=/path/to/chrome")


def build(site: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT, env=env,
                   check=True)


def serve(site: Path) -> http.server.ThreadingHTTPServer:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def shoot(browser: str, url: str, out: Path, width: int, height: int) -> None:
    subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={width},{height}", f"--screenshot={out}", url],
                   check=True, capture_output=True, timeout=120)
    Image.open(out).convert("RGB").quantize(256).save(out, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", nargs="+", default=["index", "hub-vlms"],
                        help="page names (docs/NAME.md; index is the home page)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "notes" / "screenshots"))
    parser.add_argument("--width", type=int, default=1366)
    parser.add_argument("--height", type=int, default=1600)
    args = parser.parse_args()
    browser = chromium()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        build(site)
        server = serve(site)
        try:
            for page in args.pages:
                path = "" if page == "index" else f"{page}/"
                url = f"http://127.0.0.1:{server.server_address[1]}/{path}"
                png = out / f"{page}.png"
                shoot(browser, url, png, args.width, args.height)
                print(f"{url} -> {png} ({png.stat().st_size // 1024} KB)")
        finally:
            server.shutdown()


if __name__ == "__main__":
    main()
