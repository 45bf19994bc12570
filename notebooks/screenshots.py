r"""Screenshots of a gallery notebook running in JupyterLab, for ``docs/images/`` (issue 35).

A one-off docs tool, run by hand when the pictures need refreshing: it is not part of CI or the
test suite, and nothing imports it. It starts JupyterLab headless on ``127.0.0.1`` (a free port,
a random token) in a temporary root holding a copy of the notebook, opens the notebook in a
headless Chromium driven by Playwright, runs every cell, and writes two PNGs:

- ``progress-widget.png``: the training cell WHILE it runs, with sparktrain's progress widget
  (tqdm's notebook widget, drawn because ``ipywidgets`` is importable in the kernel) part-way
  and the rank-tagged log lines that arrived so far;
- ``loss-plot.png``: the loss plot cell of the finished run.

The gallery's notebook trains in well under a second, too fast to catch mid-run. So the copy
(never the notebook in ``notebooks/``) gets one extra code cell, inserted after the cell that
defines ``train``, that wraps ``train`` so that each rank pauses ``--pause`` seconds (1.5 by
default) after every ``sparktrain.report`` call. The training itself is unchanged: same epochs,
same seeds, same losses, hence the same plot as the gallery's saved outputs. The cell shown in
the first picture is the notebook's own, unmodified.

Everything the run starts (JupyterLab, its kernel, the ranks, Chromium and Playwright's driver)
is stopped before the script exits, on error too.

Setup (a separate virtualenv: do not install these into the project's ``.venv``), then run::

    apt-get install -y chromium
    python3 -m venv /tmp/shotvenv
    /tmp/shotvenv/bin/pip install torch==2.13.0 -e . scikit-learn matplotlib ipykernel \
        ipywidgets jupyterlab playwright psutil
    /tmp/shotvenv/bin/python notebooks/screenshots.py

Playwright drives the system's Chromium (``--chromium``, default ``/usr/lib/chromium/chromium``);
``playwright install`` (which downloads a browser) is not needed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
from playwright.sync_api import Locator, Page, sync_playwright

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_NOTEBOOK = ROOT / "notebooks" / "06_ddp_mlp.ipynb"
DEFAULT_OUT = ROOT / "docs" / "images"
DEFAULT_CHROMIUM = "/usr/lib/chromium/chromium"  # Debian's binary (/usr/bin/chromium wraps it)

#: The cell inserted into the copy: every rank sleeps after each report (docs screenshots only).
SLOW_CELL = """\
# Added by notebooks/screenshots.py, for the docs screenshots only: each rank pauses after every
# sparktrain.report() so that the progress widget can be photographed mid-run.
_train_at_full_speed = train


def train(**kwargs):
    import time

    import sparktrain as _sparktrain

    report = _sparktrain.report

    def report_then_pause(*args, **metrics):
        report(*args, **metrics)
        time.sleep({pause!r})

    _sparktrain.report = report_then_pause
    return _train_at_full_speed(**kwargs)
"""

#: A substring of the training cell's source, and of the plot cell's.
RUN_CELL_MARK = "TorchDistributor(num_processes"
PLOT_CELL_MARK = "plt.plot("
#: The text the notebook's last cell prints when its assertions hold.
DONE_MARK = "loss fell from"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebook", type=Path, default=DEFAULT_NOTEBOOK)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the PNGs")
    parser.add_argument("--chromium", default=DEFAULT_CHROMIUM, help="the browser's executable")
    parser.add_argument(
        "--pause", type=float, default=1.5, help="seconds each rank sleeps after a report"
    )
    parser.add_argument(
        "--timeout", type=float, default=180.0, help="seconds the whole notebook may take"
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the temporary folder (server log, page shots); kept anyway on failure",
    )
    return parser.parse_args(argv)


def prepare_notebook(source: Path, dest: Path, pause: float) -> None:
    """Copy ``source`` to ``dest`` without outputs, with the pausing cell after ``train``'s."""
    notebook = json.loads(source.read_text())
    cells: list[dict[str, Any]] = notebook["cells"]
    defines = None
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        cell["outputs"], cell["execution_count"] = [], None
        text = cell["source"]
        text = text if isinstance(text, str) else "".join(text)
        if defines is None and re.search(r"^def train\(", text, re.M):
            defines = index
    if defines is None:
        raise SystemExit(f"{source}: no cell defines train(); nothing to slow down")
    slow: dict[str, Any] = {
        "cell_type": "code",
        "execution_count": None,
        "id": "screenshots-pause",
        "metadata": {},
        "outputs": [],
        "source": SLOW_CELL.format(pause=pause),
    }
    cells.insert(defines + 1, slow)
    dest.write_text(json.dumps(notebook, indent=1))


def free_port() -> int:
    """A TCP port nobody listens on at the moment."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def lab_settings(settings_dir: Path) -> None:
    """User settings: no news or update toasts, no kernel dialog, in the pictures."""
    settings: dict[tuple[str, str], dict[str, object]] = {
        ("apputils-extension", "notification"): {"fetchNews": "false", "checkForUpdates": False},
        ("docmanager-extension", "plugin"): {"autoStartDefaultKernel": True},
    }
    for (extension, plugin), values in settings.items():
        folder = settings_dir / "@jupyterlab" / extension
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{plugin}.jupyterlab-settings").write_text(json.dumps(values))


def api(base: str, token: str, path: str, method: str = "GET") -> bytes:
    """One request to the Jupyter server's REST API."""
    request = urllib.request.Request(
        f"{base}{path}",
        method=method,
        headers={"Authorization": f"token {token}"},
        data=b"" if method == "POST" else None,
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        body: bytes = response.read()
        return body


@contextlib.contextmanager
def jupyterlab(root: Path, log: Path) -> Iterator[tuple[str, str]]:
    """Run JupyterLab headless in ``root``; yield its URL and token; stop all it started."""
    port, token = free_port(), secrets.token_hex(24)
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    for name, sub in [
        ("JUPYTER_CONFIG_DIR", "config"),
        ("JUPYTER_DATA_DIR", "data"),
        ("JUPYTER_RUNTIME_DIR", "runtime"),
        ("IPYTHONDIR", "ipython"),
        ("JUPYTERLAB_SETTINGS_DIR", "settings"),
        ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"),
        ("MPLCONFIGDIR", "matplotlib"),
    ]:
        env[name] = str(root.parent / sub)
    env.pop("MPLBACKEND", None)  # the notebook's plots are inline
    lab_settings(root.parent / "settings")
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if os.geteuid() == 0:  # a container's root: JupyterLab refuses without this
        command.append("--allow-root")
    with log.open("wb") as out:
        server = subprocess.Popen(
            command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    seen: set[psutil.Process] = set()
    try:
        deadline = time.monotonic() + 60
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"JupyterLab exited ({server.returncode}); see {log}")
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
                api(base, token, "/api/status")
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab did not answer within 60 s; see {log}")
            time.sleep(0.5)
        yield base, token
    finally:
        seen.update(descendants(server.pid))
        stop_server(server, base, token)
        seen.update(descendants(server.pid))
        _, alive = psutil.wait_procs(list(seen), timeout=15)
        for process in alive:  # whatever outlived a clean shutdown
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(alive, timeout=5)


def descendants(pid: int) -> set[psutil.Process]:
    """Every living process below ``pid``."""
    with contextlib.suppress(psutil.Error):
        return set(psutil.Process(pid).children(recursive=True))
    return set()


def stop_server(server: subprocess.Popen[bytes], base: str, token: str) -> None:
    """Shut the kernels and the server down through the API; terminate, then kill, if need be."""
    with contextlib.suppress(OSError, ValueError):
        for kernel in json.loads(api(base, token, "/api/kernels")):
            api(base, token, f"/api/kernels/{kernel['id']}", method="DELETE")
    with contextlib.suppress(OSError):
        api(base, token, "/api/shutdown", method="POST")
    for send in (None, signal.SIGTERM, signal.SIGKILL):
        if send is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, send)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=15)
            return


def code_cell(page: Page, mark: str) -> Locator:
    """The notebook's code cell whose source contains ``mark``."""
    return page.locator(".jp-CodeCell").filter(
        has=page.locator(".jp-InputArea-editor", has_text=mark)
    )


def fail_on_error(page: Page) -> None:
    """Raise with the traceback's text if a cell's output shows an error; accept a dialog."""
    dialog = page.locator(".jp-Dialog .jp-mod-accept")
    if dialog.count():  # "Select Kernel" (the notebook's own kernel is the default)
        dialog.first.click()
    errors = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
    for index in range(errors.count()):
        text = errors.nth(index).inner_text()
        if "Traceback" in text:
            raise RuntimeError(f"a cell failed:\n{text}")


def run_all(page: Page, tries: int = 3) -> None:
    """Run > Run All Cells, until the first code cell shows it is queued or running.

    Now and then (about one try in five here) JupyterLab takes the command while the kernel it
    has just started is not wired to the notebook yet: the cells stay ``[ ]`` and nothing runs.
    """
    prompt = page.locator(".jp-CodeCell .jp-InputPrompt").first
    for attempt in range(tries):
        if attempt:
            print("Run All Cells did not start the notebook; again", file=sys.stderr)
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            fail_on_error(page)
            if re.search(r"[*\d]", prompt.inner_text()):
                return
            time.sleep(0.25)
    raise RuntimeError(f"Run All Cells did not start the notebook in {tries} tries")


def progress_of(cell: Locator) -> tuple[int, int] | None:
    """``(n, total)`` from the progress widget in ``cell``'s output, once it is drawn."""
    labels = cell.locator(".jp-OutputArea-output .widget-hbox .widget-html")
    for index in range(labels.count()):
        match = re.search(r"(\d+)/(\d+)", labels.nth(index).inner_text())
        if match:
            return int(match.group(1)), int(match.group(2))
    return None


def shoot(args: argparse.Namespace, base: str, token: str, name: str, work: Path) -> None:
    """Open the notebook, run it all, and take the two pictures."""
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.timeout
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=args.chromium, headless=True)
        try:
            page = browser.new_page(
                viewport={"width": 1000, "height": 1000}, device_scale_factor=1.5
            )
            page.goto(f"{base}/lab/tree/{name}?reset&token={token}")
            page.locator(".jp-Notebook .jp-CodeCell").first.wait_for(timeout=60_000)
            idle = page.locator('.jp-Notebook-ExecutionIndicator[data-status="idle"]')
            idle.wait_for(timeout=60_000)  # the kernel started
            time.sleep(1)
            fail_on_error(page)  # a dialog that came up while the notebook opened
            page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current").click()
            page.locator("#jp-left-stack").wait_for(state="hidden")  # the notebook's full width
            run_all(page)
            started = time.monotonic()

            run_cell = code_cell(page, RUN_CELL_MARK)
            while True:  # wait for the bar to reach half the run, then take the picture
                fail_on_error(page)
                progress = progress_of(run_cell)
                if progress and progress[1] and 2 * progress[0] >= progress[1]:
                    step, total = progress
                    break
                finished = page.locator(".jp-OutputArea-output", has_text=DONE_MARK).count()
                if finished or (progress and progress[0] >= progress[1]):
                    raise RuntimeError(f"the run finished before it was caught: {progress}")
                if time.monotonic() > deadline:
                    page.screenshot(path=work / "timeout.png", full_page=True)
                    raise RuntimeError(f"no progress widget mid-run: {work / 'timeout.png'}")
                time.sleep(0.1)
            time.sleep(0.3)  # the log lines of that step
            run_cell.scroll_into_view_if_needed()
            run_cell.screenshot(path=args.out / "progress-widget.png")
            print(
                f"mid-run at step {step}/{total}, {time.monotonic() - started:.0f} s"
                f" after Run All: {args.out / 'progress-widget.png'}"
            )

            done = page.locator(".jp-OutputArea-output", has_text=DONE_MARK)
            while not done.count():
                fail_on_error(page)
                if time.monotonic() > deadline:
                    page.screenshot(path=work / "timeout.png", full_page=True)
                    raise RuntimeError(f"the notebook did not finish: {work / 'timeout.png'}")
                time.sleep(0.25)
            plot_cell = code_cell(page, PLOT_CELL_MARK)
            plot = plot_cell.locator(".jp-OutputArea-output img")
            plot.wait_for()
            page.set_viewport_size({"width": 760, "height": 1000})  # the plot is ~460 px wide
            plot_cell.scroll_into_view_if_needed()
            time.sleep(0.5)  # the layout after the resize
            plot_cell.screenshot(path=args.out / "loss-plot.png")
            print(f"finished: {args.out / 'loss-plot.png'}")
            if args.keep:
                page.screenshot(path=work / "page.png", full_page=True)
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    """Render the notebook and write the pictures; return the exit status."""
    args = parse_args(argv)
    args.out = args.out.resolve()
    if not Path(args.chromium).exists() and not shutil.which(args.chromium):
        raise SystemExit(f"no browser at {args.chromium} (apt-get install -y chromium)")
    work = Path(tempfile.mkdtemp(prefix="sparktrain-shots-"))
    try:
        root = work / "root"
        root.mkdir()
        name = args.notebook.name
        prepare_notebook(args.notebook, root / name, args.pause)
        with jupyterlab(root, work / "jupyterlab.log") as (base, token):
            shoot(args, base, token, name, work)
    except BaseException:
        args.keep = True  # the server's log and the page, to see what went wrong
        raise
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
