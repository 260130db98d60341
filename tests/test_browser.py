"""A real browser over the course: JupyterLab started as `make lab` starts it, and the static book.

Chromium comes from Debian's `chromium` package (`apt-get install -y chromium`; .ci/run installs it
in CI), driven by Playwright for Python through `executable_path`: Playwright's own browser
download is never used. Without Chromium the module prints the install command and skips (in CI,
where it must run, it fails instead).

- Lab: chapters 06 and 07 are opened in JupyterLab, and only the cells their widget panel needs are
  run there (found by which names each cell defines and uses: not the whole chapter). A slider is
  moved with the keyboard, and what the panel shows is checked against the package, computed here,
  before and after.
- Book: scripts/build_book.py builds the book with chapter 00 executed (about 30 s; every other page
  renders without outputs: executing every chapter takes 10 to 15 minutes, `make book` does that).
  Every table-of-contents link must answer 200 and exist on disk, every image must load, math must
  be typeset, and no page may load anything from the network.
Screenshots go to the test's temporary folder. Cost on this two-core CPU, shared with other work:
83 to 96 s at a load average of about 4 (Lab panels about 45 s, the book about 23 s to build and 20 s
to check its 17 pages), 212 s at a load average of 9.5.
"""

from __future__ import annotations

import ast
import functools
import http.server
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from IPython.core.inputtransformer2 import TransformerManager

from minigen.course.book import load_book
from minigen.course.widgets import _quant_numbers, window_numbers

sync_api = pytest.importorskip(
    "playwright.sync_api",
    reason="Playwright is missing: PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 pip install playwright (never `playwright install`)")

ROOT = Path(__file__).resolve().parent.parent
INSTALL = "apt-get install -y chromium  (Debian's package, as root; Playwright's own browser download is not used)"
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
BOOK_EXECUTE = "00"  # the chapters the book check executes (see the module's docstring)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def find_chromium() -> str | None:
    """Debian's Chromium ($MINIGEN_CHROMIUM overrides), or None."""
    for candidate in (os.environ.get("MINIGEN_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium",
                      shutil.which("chromium-browser")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="module")
def browser():
    path = find_chromium()
    if path is None:
        message = f"test_browser: Chromium is not installed; install it with: {INSTALL}"
        print(message, file=sys.stderr)
        unavailable = os.environ.get("MINIGEN_NO_BROWSER")  # set by .ci/run when apt could not install it
        if os.environ.get("CI") == "true" and not unavailable:  # .ci/run installs it: missing there is a defect
            pytest.fail(message)
        if unavailable:
            message += f" ({unavailable})"
        pytest.skip(message)
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=path, headless=True, args=BROWSER_ARGS)
        yield chromium
        chromium.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- JupyterLab, as `make lab` starts it
def make_lab_command() -> list[str]:
    """The recipe of `make lab`, as make itself prints it (-n; -o model: prepare nothing), for the
    Python running these tests (VENV=sys.prefix)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed: the test starts JupyterLab from the Makefile's own recipe")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under `make test`
    printed = subprocess.run(["make", "-s", "-n", "--no-print-directory", "-o", "model", "lab", f"VENV={sys.prefix}"],
                             cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    lines = [line for line in printed.splitlines() if " lab " in f" {line} "]
    assert len(lines) == 1, f"`make -n lab` should print one jupyter lab command, printed:\n{printed}"
    return shlex.split(lines[0])


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(base URL, token) of a JupyterLab started with `make lab`'s command plus a free port and a
    token. It runs in a copy of the repository's notebooks/, so that Lab's autosave can never write
    outputs into the chapters."""
    home = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", home / "notebooks", ignore=shutil.ignore_patterns(".*"))
    port, token = free_port(), secrets.token_hex(16)
    command = make_lab_command() + [f"--port={port}", "--ServerApp.port_retries=0",
                                    f"--IdentityProvider.token={token}"]
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # `make lab` draws inline
    env.update(JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
               JUPYTERLAB_SETTINGS_DIR=str(home / "settings"))  # a fresh Lab: no saved layout or settings
    news = home / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text('{"fetchNews": "false"}')  # no "official Jupyter news?" toast over the screenshots
    log = open(home / "lab.log", "w")
    server = subprocess.Popen(command, cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not start ({' '.join(command)}):\n{(home / 'lab.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def cells_for(notebook: Path, marker: str) -> tuple[list[int], int]:
    """(indices of the cells to run, index of the panel's cell): the first code cell containing
    `marker`, and every earlier cell that defines a name it (or a cell it needs) reads."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    source = ["".join(c["source"]) if c["cell_type"] == "code" else None for c in cells]
    panel = next(i for i, s in enumerate(source) if s is not None and marker in s)
    needed, chosen = set(), [panel]
    defines, reads = {}, {}
    for i, s in enumerate(source[:panel + 1]):
        if s is not None:
            defines[i], reads[i] = names_of(TransformerManager().transform_cell(s))
    needed = set(reads[panel])
    for i in range(panel - 1, -1, -1):
        if i in defines and defines[i] & needed:
            chosen.append(i)
            needed = (needed - defines[i]) | reads[i]
    return sorted(chosen), panel


def names_of(code: str) -> tuple[set[str], set[str]]:
    """(names a cell defines, names it reads before defining them), statement by statement."""
    defined, free = set(), set()
    for statement in ast.parse(code).body:
        loads, stores = set(), set()
        for node in ast.walk(statement):
            if isinstance(node, ast.Name):
                (loads if isinstance(node.ctx, ast.Load) else stores).add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                stores.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                stores.update((a.asname or a.name).split(".")[0] for a in node.names)
        free |= loads - defined
        defined |= stores
    return defined, free


def open_and_run(page, base: str, token: str, notebook: str, marker: str):
    """Open `notebook` in Lab, run the cells its panel needs, and return the panel's output area."""
    indices, panel = cells_for(ROOT / "notebooks" / notebook, marker)
    # a workspace of its own: Lab restores the last layout, and a second notebook tab would race the first
    page.goto(f"{base}/lab/workspaces/{Path(notebook).stem}/tree/{notebook}?token={token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    assert page.locator(".jp-NotebookPanel").count() == 1, "Lab opened other notebooks beside this one"
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell")
    total = len(json.loads((ROOT / "notebooks" / notebook).read_text(encoding="utf-8"))["cells"])
    deadline = time.monotonic() + 60
    while cells.count() < total:  # Lab renders a notebook's cells a few at a time
        assert time.monotonic() < deadline, f"{notebook}: Lab shows {cells.count()} cells of {total}"
        time.sleep(0.2)
    for i in indices:
        cell = cells.nth(i)
        cell.scroll_into_view_if_needed()
        cell.locator(".jp-InputPrompt").first.click()
        page.keyboard.press("Control+Enter")  # run the selected cell, stay on it
    output = cells.nth(panel).locator(".jp-Cell-outputArea")
    deadline = time.monotonic() + 240
    while output.locator(".widget-slider").count() == 0:  # the panel, or the error that stopped it
        errors = page.locator("[data-mime-type='application/vnd.jupyter.error']")
        if errors.count():
            pytest.fail(f"{notebook}: a cell failed in JupyterLab:\n{errors.first.inner_text()[-2000:]}")
        assert time.monotonic() < deadline, f"{notebook}: the panel did not appear (cells {indices})"
        time.sleep(0.5)
    output.scroll_into_view_if_needed()
    return output


def wait_for_change(page, locator, before: str, timeout: float = 60) -> str:
    """The panel's text once it differs from `before` and the kernel is idle again (settled)."""
    deadline = time.monotonic() + timeout
    while locator.inner_text() == before:
        assert time.monotonic() < deadline, f"the panel still shows {before!r}"
        time.sleep(0.2)
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator[data-status='idle']",
                           timeout=timeout * 1000)
    return locator.inner_text()


def open_panel(browser, lab, notebook: str, marker: str):
    """A new page with `notebook`'s panel run -> (page, its output area, the panel's text, that text now)."""
    base, token = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    output = open_and_run(page, base, token, notebook, marker)
    text = output.locator(".widget-html-content").first
    return page, output, text, text.inner_text()


def test_quant_panel_in_jupyterlab(browser, lab, smollm2, tmp_path):
    """Chapter 06: moving the bits slider from 4 to 8 changes the bytes shown, to what the package
    computes for those settings (an fp16 model's cache at 4,096 tokens)."""
    model, _ = smollm2
    page, output, text, before = open_panel(browser, lab, "06_kv_quantization.ipynb", "quant_panel(")
    output.screenshot(path=tmp_path / "04_quant_panel_bits4.png")
    handle = output.locator(".widget-slider").first.locator(".noUi-handle")
    handle.focus()
    page.keyboard.press("ArrowRight")  # bits: 2, [4], 8 -> 8
    after = wait_for_change(page, text, before)
    output.screenshot(path=tmp_path / "04_quant_panel_bits8.png")
    page.screenshot(path=tmp_path / "04_lab.png")
    page.close()

    def shown_mb(t: str) -> str:
        return re.search(r"4,096 tokens: ([\d,.]+) MB", t).group(1)

    keys = values = torch.zeros(model.config.n_kv_heads, 512, model.config.head_dim)
    for bits, t in ((4, before), (8, after)):  # the panel's defaults: group 32, window 32, keys per channel
        expected = _quant_numbers(keys, values, model.config, bits, 32, 32, "channel", 4096)["bytes"]
        assert shown_mb(t) == f"{expected / 1e6:,.1f}", (bits, t)
    assert float(shown_mb(after)) > float(shown_mb(before))


def test_window_panel_in_jupyterlab(browser, lab, smollm2, english_text_ids, tmp_path):
    """Chapter 07: moving the window slider down changes the perplexity shown, to what the package
    computes for that window, layer and head on the same tokens."""
    model, _ = smollm2
    page, output, text, before = open_panel(browser, lab, "07_window_attention.ipynb", "window_panel(")
    output.screenshot(path=tmp_path / "05_window_panel_default.png")
    sliders = output.locator(".widget-slider")
    window_before = int(sliders.nth(0).locator(".widget-readout").inner_text())
    sliders.nth(0).locator(".noUi-handle").focus()
    page.keyboard.press("PageDown")  # one large step down
    after = wait_for_change(page, text, before)
    window_after = int(sliders.nth(0).locator(".widget-readout").inner_text())
    sinks = int(sliders.nth(1).locator(".widget-readout").inner_text())
    output.screenshot(path=tmp_path / "05_window_panel_moved.png")
    page.close()
    assert window_after < window_before

    for window, t in ((window_before, before), (window_after, after)):
        n_tokens, layer, head = (int(x) for x in re.search(
            r"these (\d+) tokens.*layer (\d+), head (\d+)", t, re.S).groups())
        shown = float(re.search(r"perplexity of these \d+ tokens: ([\d.]+)", t).group(1))
        expected = window_numbers(model, english_text_ids[:n_tokens], window, min(sinks, window), layer, head)
        assert abs(shown - expected["perplexity"]) <= 0.011, (window, t, expected["perplexity"])
    assert before != after


# ---------------------------------------------------------------- the static book
@pytest.fixture(scope="module")
def book_html(tmp_path_factory) -> Path:
    """The book built by scripts/build_book.py with BOOK_EXECUTE's chapters executed."""
    out = tmp_path_factory.mktemp("book")
    start = time.perf_counter()
    built = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_book.py"), "--out", str(out),
                            "--execute", BOOK_EXECUTE], cwd=ROOT, capture_output=True, text=True)
    assert built.returncode == 0, f"the book did not build:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}"
    # a {ref} or {doc} whose target is missing is only a Sphinx warning: here it fails
    broken = [line for line in (built.stdout + built.stderr).splitlines()
              if "WARNING" in line and re.search(r"undefined label|unknown document|target not found", line)]
    assert broken == [], "broken cross-references:\n" + "\n".join(broken)
    print(f"book built in {time.perf_counter() - start:.1f} s (chapters executed: {BOOK_EXECUTE})")
    return out / "html"


@pytest.fixture(scope="module")
def book_server(book_html):
    handler = functools.partial(QuietHandler, directory=str(book_html))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_book_links_figures_and_math_load_offline(browser, book_html, book_server, tmp_path):
    """Every table-of-contents link resolves, every image loads (naturalWidth > 0), math is typeset
    by the book's own MathJax, and no page asks the network for anything."""
    book = load_book()
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    outside = []

    def only_local(route):
        if route.request.url.startswith(book_server + "/"):
            return route.continue_()
        outside.append(route.request.url)  # the book must work offline: refuse, and remember
        return route.abort()

    page.route("**/*", only_local)
    page.goto(f"{book_server}/index.html")
    page.screenshot(path=tmp_path / "book_index.png")
    links = page.eval_on_selector_all(".bd-sidebar-primary nav a.reference.internal", "els => els.map(e => e.href)")
    links = list(dict.fromkeys(link.split("#")[0] for link in links))
    # the article first, every chapter in book.toml's order, the ledger last
    expected = (["article.html"] + [f"{c.doc}.html" for c in book.chapters] + ["ledger.html"])
    assert [link.removeprefix(book_server + "/") for link in links] == expected
    front = page.eval_on_selector_all("main a.reference.internal", "els => els.map(e => e.href.split('#')[0])")
    assert set(front) - {f"{book_server}/index.html"} == set(links), \
        "the front page's own links (article, chapters, ledger) differ from the contents"

    images = math = 0
    for link in links:
        path = book_html / link.removeprefix(book_server + "/")
        assert path.is_file(), f"{link}: no file {path}"
        response = page.goto(link)
        assert response is not None and response.status == 200, (link, response and response.status)
        page.wait_for_load_state("networkidle")
        broken = page.evaluate("""async () => {
            await Promise.all([...document.images].map(i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; })));
            return [...document.images].filter(i => i.naturalWidth === 0).map(i => i.src.slice(0, 120)); }""")
        assert broken == [], f"{link}: images that do not load: {broken}"
        images += page.evaluate("document.images.length")
        if page.locator(".math").count():
            page.wait_for_function("window.MathJax && MathJax.startup && MathJax.startup.document", timeout=30_000)
            page.evaluate("MathJax.startup.promise")
            untypeset = page.evaluate("[...document.querySelectorAll('.math')].filter(e => !e.querySelector('mjx-container')).length")
            assert untypeset == 0, f"{link}: {untypeset} formulas shown as raw TeX"
            math += page.locator(".math").count()
        page.screenshot(path=tmp_path / f"book_{path.stem}.png")
    page.close()
    assert outside == [], f"the book asked the network for: {outside[:5]}"
    assert images > 0 and math > 0, "the check saw no figure or no formula: it checked nothing"
