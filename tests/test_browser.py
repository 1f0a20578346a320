"""The course in a real browser: JupyterLab started here on loopback, Chromium driven
by Playwright, the chapter index, then every cell of a chapter through the Run menu.

It checks what a learner sees: the start cell says the cluster is running, no cell
shows an error, the widgets rendered (plotly's ``FigureWidget`` is a Jupyter widget),
the static plotly figures drew, and the live figure was redrawn in the browser with
new data as telemetry arrived. Screenshots go to the test's tmp folder (and, with
``DTLAB_SAVE_SCREENSHOTS=1``, one per chapter to ``docs/browser-chapterNN.png``).

The server runs on a *copy* of ``notebooks/`` (JupyterLab saves outputs into the
files it opens) with its own settings, workspaces, Jupyter and IPython folders, and
every process it starts carries a session tag in its environment: after the run no
kernel, controller or engine may remain (``tests/nbval_guard.py`` finds them).

Run alone: ``pytest -m browser``. Needs Debian's ``chromium`` and the ``playwright``
package (never ``playwright install``: the browser is the system's); skipped
without them.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import pytest

from dtlab.cli import lab_command
from tests.nbval_guard import TAG, reap, tagged_processes

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("DTLAB_CHROMIUM", "/usr/bin/chromium")
TOKEN = uuid.uuid4().hex
# Bounds on every wait (seconds). Generous: CI machines are small and shared.
SERVER_UP, PAGE_READY, RUN_ALL = 120, 180, 420

# Each chapter is opened by clicking its link in the index, as a learner does: 01
# (the live collectives figure), 07 (the control panel and the live dashboard), 12
# (the optional chapter: FP8, the V schedules and Muon on the engines) and 13 (the
# other optional one: a replica lost and healed, DiLoCo, a checkpoint saved on four
# engines and loaded on two after a restart).
CHAPTERS = [
    pytest.param("01_collectives.ipynb", id="01"),
    pytest.param("07_3d_parallelism.ipynb", id="07"),
    pytest.param("12_frontier.ipynb", id="12"),
    pytest.param("13_resilience.ipynb", id="13"),
]
LIVE = ("01_collectives.ipynb", "07_3d_parallelism.ipynb")  # widgets, live figures


# ---- helpers ---------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(base: str, path: str, method: str = "GET"):
    req = urllib.request.Request(f"{base}{path}?token={TOKEN}", method=method)
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
    return json.loads(body) if body else None


def _settings(folder: pathlib.Path) -> None:
    """JupyterLab user settings for a test run: no news pop-up, and every cell kept
    in the DOM (JupyterLab 4 may otherwise virtualise cells outside the view)."""
    for name, value in {
        "apputils-extension/notification": {
            "fetchNews": "false",
            "checkForUpdates": False,
        },
        "notebook-extension/tracker": {"windowingMode": "none"},
    }.items():
        path = folder / "@jupyterlab" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


class LabServer:
    """``dtlab lab``'s command on a copy of the chapters, in its own session (so it
    can be killed as a group), every descendant tagged."""

    def __init__(self, workdir: pathlib.Path):
        self.tag = f"browser-{uuid.uuid4().hex}"
        self.notebooks = workdir / "notebooks"
        shutil.copytree(ROOT / "notebooks", self.notebooks)
        _settings(workdir / "settings")
        self.workdir = workdir
        self.proc = None
        self.log = None

    def start(self) -> None:
        """Start the server and wait until it answers. A free port can be taken by
        another process before the server binds it: then try another one."""
        for _attempt in range(3):
            self._spawn()
            if self._wait_up():
                return
            if b"is not available" not in (self.workdir / "server.log").read_bytes():
                raise RuntimeError(
                    f"JupyterLab exited with {self.proc.returncode}: see "
                    f"{self.workdir / 'server.log'}"
                )
        raise RuntimeError("JupyterLab found no free port in 3 tries")

    def _spawn(self) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = lab_command(self.notebooks, port=self.port, no_browser=True, token=TOKEN)
        cmd += [
            f"--LabApp.user_settings_dir={self.workdir / 'settings'}",
            f"--LabApp.workspaces_dir={self.workdir / 'workspaces'}",
        ]
        env = dict(os.environ)
        env.update(
            {
                TAG: self.tag,  # inherited by kernels, controllers and engines
                "JUPYTER_CONFIG_DIR": str(self.workdir / "jupyter-config"),
                "IPYTHONDIR": str(self.workdir / "ipython"),
                "GLOO_SOCKET_IFNAME": "lo",
            }
        )
        if self.log is not None:
            self.log.close()
        self.log = open(self.workdir / "server.log", "wb")
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=self.workdir,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # one process group, killed as one
        )

    def _wait_up(self) -> bool:
        """True once the server answers; False if it exited first."""
        deadline = time.monotonic() + SERVER_UP
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                _api(self.base, "/api/status")
                return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        raise TimeoutError(f"JupyterLab did not answer within {SERVER_UP}s")

    def shutdown_kernels(self) -> None:
        """Shut every kernel down the way the Kernel menu does (the kernel exits
        by itself; its atexit handlers stop any cluster it still holds)."""
        for kernel in _api(self.base, "/api/kernels"):
            _api(self.base, f"/api/kernels/{kernel['id']}", method="DELETE")

    def leftovers(self, wait: float = 20.0) -> list[str]:
        """Tagged processes other than the server itself, after up to ``wait`` s."""
        deadline = time.monotonic() + wait
        while True:
            procs = [p for p in tagged_processes(self.tag) if p.pid != self.proc.pid]
            if not procs or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        out = []
        for p in procs:
            try:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
            except Exception:  # noqa: BLE001 - it exited while we looked
                pass
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.shutdown_kernels()
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self.log is not None:
            self.log.close()


# ---- what the page records while cells run -------------------------------------
# Every plotly figure that appears gets a 'plotly_afterplot' listener: each draw
# notes how many points the figure holds and whether its cell was still running.
# Static figures (plotly's mime renderer) draw once; a FigureWidget redraws when
# the kernel sends it new data.
_RECORD_DRAWS = """() => {
  window.__dtlabPlots = [];
  const cells = () => [...document.querySelectorAll(
    '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell')];
  const attach = (gd) => {
    const cell = gd.closest('.jp-CodeCell');
    // not yet in a cell (or plotly's off-screen copy for image export): later
    if (gd.__dtlab || !gd.on || !cell) return;
    const rec = {cell: cells().indexOf(cell), widget: null, draws: []};
    gd.__dtlab = rec;
    window.__dtlabPlots.push(rec);
    const snap = () => {
      // busy: some cell is running. A chapter 01 figure updates while its own cell
      // runs; chapter 07's dashboard, shown in one cell, while a later cell trains.
      const prompt = cells().map(
        c => c.querySelector('.jp-InputPrompt').textContent).join(' ');
      // data drawn: points of a scatter/bar, rows of a heatmap, cells of a table
      const rows = (t) => (t.cells && t.cells.values && t.cells.values[0]
        ? t.cells.values[0].length : 0);
      const points = (gd._fullData || []).reduce((n, t) => n + (t._length
        || (t.x ? t.x.length : 0) || (t.z ? t.z.length : 0) || rows(t) || 0), 0);
      // plotly's mime renderer (a static figure) marks its own node
      rec.widget = !gd.closest('.jp-RenderedPlotly');
      rec.draws.push({t: Date.now(), busy: prompt.includes('*'),
                      traces: (gd._fullData || []).length, points});
    };
    gd.on('plotly_afterplot', snap);
    snap();
  };
  const scan = () => document.querySelectorAll('.js-plotly-plot').forEach(attach);
  new MutationObserver(scan).observe(document.body,
    {subtree: true, childList: true, attributes: true, attributeFilter: ['class']});
  scan();
}"""

# Each code cell of the open notebook: its prompt, its outputs' text, mime types,
# plotly figures (static and widget) and widget views.
_CELLS = """() => [...document.querySelectorAll(
    '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell')].map(c => {
  const outs = [...c.querySelectorAll('.jp-OutputArea-output')];
  return {
    prompt: c.querySelector('.jp-InputPrompt').textContent.trim(),
    text: outs.map(o => o.innerText).join('\\n'),
    mimes: outs.map(o => o.getAttribute('data-mime-type')),
    plots: [...c.querySelectorAll('.jp-RenderedPlotly')].filter(
      g => g.querySelector('.main-svg')).length,
    widgetPlots: [...c.querySelectorAll('.js-plotly-plot')].filter(
      g => !g.closest('.jp-RenderedPlotly')).length,
    widgets: outs.filter(o => !o.hasAttribute('data-mime-type')
      && !o.classList.contains('jp-RenderedPlotly') && o.querySelector('.lm-Widget')
    ).length,
  };
})"""

_KERNEL_IDLE = """() => {
  const bar = document.querySelector('#jp-main-statusbar');
  return !!bar && bar.innerText.includes('| Idle');
}"""


# ---- fixtures -------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="the browser test needs `pip install playwright`"
    )
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(
            f"no Chromium at {CHROMIUM}: `apt-get install chromium` "
            "(or set DTLAB_CHROMIUM)"
        )
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def lab(browser, tmp_path_factory):
    server = LabServer(tmp_path_factory.mktemp("lab"))
    try:
        server.start()
        yield server
    finally:
        server.stop()
        left = server.leftovers(wait=10)
        reap(server.tag)
    assert not left, f"processes outlived the JupyterLab server: {left}"


# ---- the test -------------------------------------------------------------------
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_runs_in_a_real_browser(chapter, lab, browser, tmp_path):
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"screenshots in {shots}")
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(PAGE_READY * 1000)
    try:
        # the index: JupyterLab's default page, rendered markdown with the links
        # (?reset: a fresh workspace, so no tab of an earlier test comes back)
        page.goto(f"{lab.base}/lab/tree/index.ipynb?reset&token={TOKEN}")
        page.wait_for_selector(".jp-RenderedMarkdown h1")
        page.screenshot(path=shots / "index.png")
        # open the chapter by its link in the index, as a learner does
        page.locator(f".jp-RenderedMarkdown a[href*='/files/{chapter}']").first.click()
        page.wait_for_function(
            """(name) => {
              const tab = document.querySelector(
                '#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current');
              return !!tab && tab.innerText.includes(name)
                && !!document.querySelector(
                  '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell');
            }""",
            arg=chapter,
        )
        page.wait_for_function(_KERNEL_IDLE)
        page.evaluate(_RECORD_DRAWS)
        # Run menu -> Run All Cells, with the chapter focused
        page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").first.click()
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(
            ".lm-Menu-itemLabel", has_text=re.compile("^Run All Cells$")
        ).click()
        t0 = time.monotonic()
        cells = _wait_until_done(page, t0)
        elapsed = time.monotonic() - t0
        page.screenshot(path=shots / "end.png")
        plots = page.evaluate("window.__dtlabPlots")
        _screenshot_live(page, shots / "live.png")
        saved = _save(page, lab.notebooks / chapter)
        _check(chapter, cells, plots, saved, elapsed)
        if os.environ.get("DTLAB_SAVE_SCREENSHOTS") == "1":
            shutil.copy(
                shots / "live.png", ROOT / "docs" / f"browser-chapter{chapter[:2]}.png"
            )
    finally:
        page.close()
        # the chapter's last cell stopped its cluster; its kernel goes too, and
        # nothing it started may remain (the server itself stays for the next)
        try:
            lab.shutdown_kernels()
        finally:
            left = lab.leftovers()
            if left:
                reap(lab.tag)
    assert not left, f"{chapter} left processes behind: {left}"


def _wait_until_done(page, t0: float) -> list[dict]:
    """Until every code cell has run (or the run stopped at an error: JupyterLab
    then leaves the later cells unrun), bounded by RUN_ALL seconds."""
    started = False
    while time.monotonic() - t0 < RUN_ALL:
        cells = page.evaluate(_CELLS)
        busy = any("*" in c["prompt"] for c in cells)
        ran = sum(bool(re.fullmatch(r"\[\d+\]:", c["prompt"])) for c in cells)
        started = started or busy or ran
        if started and not busy and page.evaluate(_KERNEL_IDLE):
            return cells
        if not started and time.monotonic() - t0 > 60:
            raise AssertionError("Run All Cells did not start any cell within 60s")
        time.sleep(1.0)
    raise AssertionError(f"the chapter did not finish within {RUN_ALL}s")


def _screenshot_live(page, path) -> None:
    """A screenshot with the live figure (the first widget figure) in view."""
    live = page.locator(
        ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output"
        ":not([data-mime-type]) .js-plotly-plot"
    )
    if live.count():
        live.first.evaluate("g => g.scrollIntoView({block: 'start'})")
        page.wait_for_timeout(500)
    page.screenshot(path=path)


def _save(page, path: pathlib.Path) -> dict:
    """Save the notebook from the browser (Ctrl+S) and read the file back: the
    outputs as the kernel sent them, error outputs included."""
    before = path.stat().st_mtime_ns
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").first.click()
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 60
    while path.stat().st_mtime_ns == before:
        assert time.monotonic() < deadline, f"{path.name} was not saved within 60s"
        time.sleep(0.5)
    time.sleep(1.0)  # the server writes atomically, but let it finish
    return json.loads(path.read_text())


def _check(chapter, cells, plots, saved, elapsed):
    errors = [
        (i, f"{o['ename']}: {o['evalue']}")
        for i, cell in enumerate(c for c in saved["cells"] if c["cell_type"] == "code")
        for o in cell["outputs"]
        if o["output_type"] == "error"
    ]
    assert not errors, f"{chapter}: error outputs in code cells {errors}"
    unrun = [
        i for i, c in enumerate(cells) if not re.fullmatch(r"\[\d+\]:", c["prompt"])
    ]
    assert not unrun, f"{chapter}: cells {unrun} did not run (stopped at an error?)"
    # the cluster started: the start cell prints the running cluster
    start = next(c for c in cells if "LabCluster" in c["text"])
    assert re.search(r"<LabCluster \d+×\w+ running>: started in", start["text"]), start
    # widgets rendered: no widget fell back to its text form or an error box
    all_text = "\n".join(c["text"] for c in cells)
    for fallback in ("Error displaying widget", "Loading widget", "FigureWidget({"):
        assert fallback not in all_text, f"{chapter}: a widget shows {fallback!r}"
    # static figures drew: each has an SVG with points in it
    assert sum(c["plots"] for c in cells) >= 1, f"{chapter}: no plotly figure drew"
    static = [p for p in plots if not p["widget"]]
    assert all(any(d["points"] for d in p["draws"]) for p in static), static
    if chapter not in LIVE:
        return  # a chapter without widgets (12, 13): its cells ran, its figures drew
    assert sum(c["widgets"] for c in cells) >= 1, f"{chapter}: no widget view"
    # the live figure: while the notebook was still running, the browser redrew it
    # with new data at least twice (points drawn, not just the empty first frame)
    live = [p for p in plots if p["widget"]]
    assert live, f"{chapter}: no live figure (FigureWidget) appeared"
    during = [
        sorted({d["points"] for d in p["draws"] if d["busy"]} - {0}) for p in live
    ]
    assert any(len(states) >= 2 for states in during), (
        f"{chapter}: no live figure was redrawn with new data during its run; "
        f"points per draw while running: {during}"
    )
    print(f"{chapter}: ran in {elapsed:.0f}s; live figures drew {during} while running")
