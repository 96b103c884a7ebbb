"""The documentation site: every page listed, every public name documented, every example run.

`./run docs` (in CI) builds the site with `mkdocs build --strict`: a broken
internal link or anchor, or a docstring griffe cannot parse, is an error. The
same build runs here, so `./run test` catches them too.
"""

import os
import re
import subprocess
import sys
import zlib

import jax
import pytest
import yaml

from helpers import ROOT, python_blocks, run_python_blocks

DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_ext" not in p.relative_to(DOCS).parts)
RUNNABLE = [p for p in PAGES if python_blocks(p)]


def _nav_pages(entries) -> list[str]:
    found = []
    for entry in entries:
        if isinstance(entry, str):
            found.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                found += _nav_pages(value) if isinstance(value, list) else [value]
    return found


def test_every_page_is_in_the_nav():
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = {str(p.relative_to(DOCS)) for p in PAGES}
    assert sorted(pages - set(nav)) == [], "add these pages to the nav of mkdocs.yml"
    assert sorted(set(nav) - pages) == [], "the nav of mkdocs.yml lists pages that do not exist"
    assert len(nav) == len(set(nav)), "a page is listed twice"


def _public_names() -> set[str]:
    import jmp_policy.nnx

    public = {f"jmp_policy.{name}" for name in jmp_policy.__all__}
    return public | {f"jmp_policy.nnx.{name}" for name in jmp_policy.nnx.__all__}


def test_every_public_name_has_a_reference_entry():
    public = _public_names()
    entries = [
        m.group(1)
        for page in sorted((DOCS / "api").glob("*.md"))
        for m in re.finditer(r"^::: (\S+)$", page.read_text(), flags=re.M)
    ]
    assert sorted(public - set(entries)) == [], "add these names to a page of docs/api/"
    assert sorted(set(entries) - public) == [], "these reference entries are not public names"
    assert len(entries) == len(set(entries)), "a name is documented twice"


def test_readme_links_to_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert len(links) >= 10  # the front door links to the guides
    assert [link for link in links if not (ROOT / link).is_file()] == []
    assert len(readme.splitlines()) < 200


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built as `./run docs` builds it (strict), into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_site_builds_strict_with_every_public_name_rendered(site):
    # objects.inv: four header lines, then zlib; a line per rendered object,
    # `name domain:role priority page#anchor display`.
    header, body = (site / "objects.inv").read_bytes().split(b"zlib.\n", 1)
    assert b"Sphinx inventory version 2" in header
    rendered = set()
    for line in zlib.decompress(body).decode().splitlines():
        name, _, _, location = line.split(" ", 4)[:4]
        anchor = location.split("#", 1)[1] if "#" in location else ""
        rendered.add(name if anchor == "$" else anchor)
    assert sorted(_public_names() - rendered) == []
    assert (site / "guides" / "getting_started.html").is_file()


# Pages whose examples print what a reader is told to expect.
EXPECTED_OUTPUT = {
    "guides/getting_started.md": ["skipped steps 0"],
    "guides/policies.md": ["applied 2, skipped 1, adam count 2"],
    "guides/cli.md": [
        "float16 would flush 100% of the gradient values to zero; recommended: mixed_bfloat16"
    ],
}


# Pages whose examples train or compile for long (slow: left out of the loop
# before a commit, run by CI).
SLOW_PAGES = {"guides/fp8.md", "guides/from_flax.md", "guides/equinox.md"}


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(p, marks=pytest.mark.slow) if str(p.relative_to(DOCS)) in SLOW_PAGES else p
        for p in RUNNABLE
    ],
    ids=lambda p: str(p.relative_to(DOCS)),
)
def test_page_examples_run(page, capsys):
    run_python_blocks(page)
    out = capsys.readouterr().out
    for expected in EXPECTED_OUTPUT.get(str(page.relative_to(DOCS)), []):
        assert expected in out, out


def test_guides_have_runnable_examples():
    """Every guide shows code that runs (the "Model coverage" and reference pages need none)."""
    guides = [p for p in PAGES if p.parent.name == "guides"]
    assert [p.name for p in guides if p not in RUNNABLE] == []
    assert jax.device_count() == 8  # conftest: the multi-device guide runs on 8 devices
