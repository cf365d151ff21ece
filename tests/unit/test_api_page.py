"""The API page renders (issue 39): docstrings in the one format the docs tool reads, checked in the sources and in
the built page (examples as code blocks, cross-references as links or code, formulas as math)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import HANG_SECONDS

ROOT = Path(__file__).resolve().parents[2]
ROLE = re.compile(r":(class|func|meth|attr|data|mod|exc|obj|math|ref):`")


def test_no_docstring_uses_a_sphinx_role_or_a_singular_example_section():
    found = []
    for file in sorted((ROOT / "topocallbacks").rglob("*.py")):
        for number, line in enumerate(file.read_text().splitlines(), start=1):
            if ROLE.search(line) or re.fullmatch(r"\s*Example:", line):
                found.append(f"{file.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


@pytest.mark.slow
def test_the_built_api_page_has_code_examples_links_and_math_and_no_raw_markup(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    mkdocs = Path(sys.executable).with_name("mkdocs")
    done = subprocess.run([str(mkdocs), "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=HANG_SECONDS)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    html = (tmp_path / "site" / "api" / "index.html").read_text()
    assert not ROLE.search(html)
    assert "<blockquote>" not in html  # doctest lines were once read as nested quotes
    assert html.count('<span class="gp">&gt;&gt;&gt; </span>') > 30  # the examples are highlighted code blocks
    assert html.count('class="arithmatex"') > 10  # formulas go to MathJax
    assert "$" not in re.sub(r"<code.*?</code>|<pre.*?</pre>", "", html, flags=re.S)  # no math left as text
    assert 'href="#topocallbacks.TopoMonitor' in html  # a cross-reference is a link
