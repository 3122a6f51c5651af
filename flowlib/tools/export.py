"""Notebooks as HTML pages that render their equations offline.

    python -m flowlib.export                                   # notebooks/*.ipynb -> outputs/html/
    python -m flowlib.export outputs/03_reinflow/default/03_reinflow.ipynb --out /tmp/pages

nbconvert's pages load MathJax from a CDN, so on a machine without the internet every equation shows as raw TeX.
Here each page loads MathJax 2.7 (the version nbconvert's template is written for) from a ``mathjax/`` folder
copied next to it from ``jupyter_server_mathjax``: the folder of pages can be opened, copied or served anywhere.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from flowlib.infra.runs import REPO_ROOT, outputs_root, save_text, shown

MATHJAX_DIR = "mathjax"
MATHJAX_CONFIG = "TeX-AMS-MML_HTMLorMML-full,Safe"  # the combined configuration jupyter_server_mathjax ships
# The web fonts it ships are STIX-Web (MathJax's default, TeX, is not there); as the classic notebook set it.
FONTS = ('<script type="text/x-mathjax-config">MathJax.Hub.Config({"HTML-CSS": '
         '{availableFonts: [], imageFont: null, preferredFont: null, webFont: "STIX-Web"}});</script>\n')


def mathjax_source() -> Path:
    """The MathJax 2.7 tree that ``jupyter_server_mathjax`` ships (installed with the project's dependencies)."""
    try:
        import jupyter_server_mathjax
    except ImportError as err:
        raise ImportError("offline MathJax needs jupyter_server_mathjax: `make install` "
                          "(or pip install jupyter-server-mathjax)") from err
    return Path(jupyter_server_mathjax.__file__).parent / "static"


def export(notebooks: list[Path], out_dir: Path) -> list[Path]:
    """Write ``<out_dir>/<name>.html`` for each notebook and the ``mathjax/`` folder they load; the pages' paths."""
    from nbconvert import HTMLExporter

    out_dir = Path(out_dir)
    target = out_dir / MATHJAX_DIR
    if not (target / "MathJax.js").is_file():
        shutil.copytree(mathjax_source(), target, dirs_exist_ok=True)
    # require.js (from a CDN) only serves widget outputs, which stored notebooks here do not hold
    exporter = HTMLExporter(mathjax_url=f"{MATHJAX_DIR}/MathJax.js?config={MATHJAX_CONFIG}", require_js_url="")
    pages = []
    for nb in notebooks:
        nb = Path(nb)
        if not nb.is_file():
            raise FileNotFoundError(f"notebook {nb} not found: pass an .ipynb (notebooks/*.ipynb or a run's copy)")
        body, _ = exporter.from_filename(str(nb))
        script = f'<script src="{exporter.mathjax_url}'
        body = body.replace(script, FONTS + script, 1)
        pages.append(save_text(out_dir / f"{nb.stem}.html", body))
    return pages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flowlib.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", type=Path, help="the .ipynb files (default: notebooks/*.ipynb)")
    ap.add_argument("--out", type=Path, default=None, help="folder of the pages (default: outputs/html)")
    args = ap.parse_args(argv)
    notebooks = args.notebooks or sorted((REPO_ROOT / "notebooks").glob("[0-9]*.ipynb"))
    try:
        pages = export(notebooks, args.out or outputs_root() / "html")
    except (FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(pages)} page(s) in {shown(pages[0].parent)}, equations rendered offline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
