"""Drives headless Chromium over the DevTools protocol (aiohttp's websocket client, in the venv):
opens pages of the served docs site, waits until what is asked for is on the page, and saves a
screenshot. Used by scripts/docs_browser.sh.

  docs_browser.py CHROMIUM BASE_URL OUT_DIR
"""
import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import aiohttp

PAGES = [  # file name, path in the site, JavaScript that is true once the page shows what matters
    ("front-page", "", "document.querySelector('article h1') !== null"),
    ("lightning", "lightning/", "document.querySelectorAll('article table').length > 3"),
    ("plugin-model_checkpoint", "reference/plugins/callback-model_checkpoint/",
     "document.querySelector('article table') !== null"),
    ("search-ckpt_path", "?q=ckpt_path", "document.querySelectorAll('.md-search-result__item').length > 0"),
]


class Page:
    def __init__(self, ws):
        self.ws, self.next_id = ws, 0

    async def call(self, method, **params):
        self.next_id += 1
        await self.ws.send_str(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads((await self.ws.receive()).data)
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def eval(self, expression):
        r = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return r["result"].get("value")


async def run(chromium, base, out):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    profile = tempfile.mkdtemp(prefix="fulgur-chromium-")
    browser = subprocess.Popen([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                f"--remote-debugging-port={port}", f"--user-data-dir={profile}",
                                "--window-size=1280,1000", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    failed = []
    try:
        for _ in range(100):
            try:
                targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
                pages = [t for t in targets if t["type"] == "page"]
                if pages:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                await page.call("Page.enable")
                for name, path, ready in PAGES:
                    await page.call("Page.navigate", url=base + path)
                    ok = False
                    for _ in range(150):  # up to 15 s: the search index loads in a web worker
                        await asyncio.sleep(0.1)
                        if await page.eval(f"document.readyState === 'complete' && ({ready})"):
                            ok = True
                            break
                    await asyncio.sleep(0.5)  # let the fonts and highlighting settle
                    shot = await page.call("Page.captureScreenshot", format="png")
                    with open(os.path.join(out, name + ".png"), "wb") as f:
                        f.write(base64.b64decode(shot["data"]))
                    title = await page.eval("document.title")
                    detail = ""
                    if name.startswith("search"):
                        hits = await page.eval("[...document.querySelectorAll('.md-search-result__item h1, "
                                               ".md-search-result__item h2')].map(e => e.textContent)")
                        meta = await page.eval("document.querySelector('.md-search-result__meta')?.textContent")
                        detail = f"; {meta}: {hits}"
                    print(f"docs_browser: {name}.png  {'ok' if ok else 'NOT READY'}  title '{title}'{detail}")
                    if not ok:
                        failed.append(name)
    finally:
        browser.terminate()
        browser.wait()
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    sys.exit(asyncio.run(run(sys.argv[1], sys.argv[2], sys.argv[3])))
