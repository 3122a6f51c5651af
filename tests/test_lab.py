"""Working in the lab leaves the repository clean: a notebook opened and saved through the Jupyter server that
``make lab`` starts (as JupyterLab saves it, with the kernel's Python version in its metadata) shows no change in
``git status`` (``flowlib.infra.lab.strip_on_save``; the git filter of ``make install`` alone does not do it: git
reports a file whose size changed as modified without running the filter)."""
import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flowlib.infra.lab import SERVER_ARGS
from flowlib.infra.runs import REPO_ROOT

pytestmark = pytest.mark.slow  # starts a Jupyter server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(port: int, token: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/contents/{path}", method="PUT" if body else "GET",
                                 data=json.dumps(body).encode() if body else None,
                                 headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def _server(root: Path, *args: str):
    """A Jupyter server on ``root`` with ``args``, answering at the yielded ``(port, token)``; stopped on exit."""
    port, token = _free_port(), "flowlib-test"
    server = subprocess.Popen([sys.executable, "-m", "jupyter", "server", "--no-browser", f"--port={port}",
                               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--allow-root",
                               *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
    try:
        for _ in range(120):
            try:
                _api(port, token, "")
                break
            except OSError:
                time.sleep(0.5)
        yield port, token
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_opening_and_saving_notebooks_through_the_server_leaves_git_status_clean(tmp_path):
    clone = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True)
    strip = next(line for line in (REPO_ROOT / "Makefile").read_text().splitlines() if line.startswith("STRIP :="))
    clean = f"{shlex.quote(sys.executable)} -m nbstripout {strip.split(':=', 1)[1].strip()}"
    subprocess.run(["git", "-C", str(clone), "config", "filter.nbstripout.clean", clean], check=True)  # as make install
    with _server(clone, *SERVER_ARGS) as (port, token):
        for name in ("notebooks/00_flows_2d.ipynb", "notebooks/03_reinflow.ipynb", "notebooks/00_flows_2d.py"):
            model = _api(port, token, f"{name}?content=1")
            nb = model["content"]
            nb["metadata"].setdefault("language_info", {})["version"] = "3.11.99"  # what a kernel adds on save
            _api(port, token, name, {"type": "notebook", "format": "json", "content": nb})
        status = subprocess.run(["git", "-C", str(clone), "status", "--porcelain"], capture_output=True, text=True)
        assert status.stdout == "", f"saving an unchanged notebook changed the repository:\n{status.stdout}"
        _api(port, token, "notebooks/00_flows_2d.ipynb", {"type": "notebook", "format": "json", "content": {
            **nb, "cells": nb["cells"][:-1]}})  # a real change still shows (the test can fail)
        status = subprocess.run(["git", "-C", str(clone), "status", "--porcelain"], capture_output=True, text=True)
        assert " M notebooks/00_flows_2d.ipynb" in status.stdout.splitlines()


def test_the_lab_serves_make_labs_settings_closing_a_tab_ends_its_kernel(tmp_path):
    """JupyterLab reads ``make lab``'s settings (``flowlib.infra.lab.write_settings``) as its defaults: the server
    hands the browser a notebook tracker whose ``kernelShutdown`` (close a tab, end its kernel) is on, and ``.py``
    files opening as notebooks. From an empty settings folder the same server says off (the test can fail)."""
    from flowlib.infra.lab import LAB_SETTINGS, write_settings

    def served(settings_dir: Path) -> dict:  # JupyterLab's settings as its server hands them to the browser
        with _server(tmp_path, f"--LabApp.app_settings_dir={settings_dir}") as (port, token):
            out = {}
            for plugin in LAB_SETTINGS:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/lab/api/settings/{plugin}",
                                             headers={"Authorization": f"token {token}"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    out[plugin] = json.loads(r.read())["schema"]["properties"]
            return out

    tracker, viewer = "@jupyterlab/notebook-extension:tracker", "@jupyterlab/docmanager-extension:plugin"
    with_settings = served(write_settings(tmp_path / "settings").parent)
    assert with_settings[tracker]["kernelShutdown"]["default"] is True
    assert with_settings[viewer]["defaultViewers"]["default"] == {"python": "Jupytext Notebook"}
    (tmp_path / "none").mkdir()
    assert served(tmp_path / "none")[tracker]["kernelShutdown"]["default"] is False
