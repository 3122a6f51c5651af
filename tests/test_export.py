"""HTML pages of the notebooks render their equations offline: MathJax is loaded from a folder beside them."""
import re

from flowlib.infra.runs import REPO_ROOT
from flowlib.tools.export import main


def test_a_page_loads_mathjax_from_its_own_folder_not_the_internet(tmp_path, capsys):
    assert main([str(REPO_ROOT / "notebooks/04_flow_sde.ipynb"), "--out", str(tmp_path)]) == 0
    page = (tmp_path / "04_flow_sde.html").read_text()
    scripts = re.findall(r'<script[^>]+src="([^"]*MathJax[^"]*)"', page)
    assert scripts == ["mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full,Safe"]
    assert "https://" not in "".join(re.findall(r'<script[^>]+src="([^"]*)"', page))  # no script from the internet
    for needed in ("MathJax.js", "config/TeX-AMS-MML_HTMLorMML-full.js", "jax/output/HTML-CSS/fonts/STIX-Web",
                   "fonts/HTML-CSS/STIX-Web"):
        assert (tmp_path / "mathjax" / needed).exists(), needed
    assert 'webFont: "STIX-Web"' in page
    assert "$$" in page or "\\(" in page or "$\\" in page  # the TeX is there for MathJax to typeset
    assert "1 page(s)" in capsys.readouterr().out


def test_a_missing_notebook_is_one_error(tmp_path, capsys):
    assert main([str(tmp_path / "nope.ipynb"), "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: notebook")
