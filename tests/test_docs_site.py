"""The documentation site builds with `mkdocs build --strict` (a broken link or a missing page fails the suite),
every page a reader should find (docs/ and the results summaries) is in its navigation, the hook that serves files
outside docs/ rewrites links correctly, and the README stays short enough to read in five minutes."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
#: A reST role as the API pages would show it: `:role:` or `:domain:role:` followed by its (code) target.
RAW_ROLE = re.compile(r"(:(?:[a-z]+:)?[a-z]+:)(?=<code>|`)")

pytest.importorskip("mkdocs", reason="the docs tools come with the dev extra (make setup)")
yaml = pytest.importorskip("yaml")


def load_hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mkdocs_build(config: Path, site_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # the theme's end-of-life banner, not a problem of ours
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site_dir)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return [page for item in nav for page in nav_pages(item)]


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The real site, built once for the tests that read it."""
    site = tmp_path_factory.mktemp("docs") / "site"
    return site, mkdocs_build(ROOT / "mkdocs.yml", site)


def test_the_site_builds_strict_without_a_warning(built_site):
    site, built = built_site
    output = built.stdout + built.stderr
    assert built.returncode == 0, output[-4000:]
    assert "WARNING" not in output, output[-4000:]
    assert (site / "benchmarks" / "results" / "genomics" / "index.html").is_file()


def raw_roles(html: str) -> list[str]:
    """Sphinx/reST roles (:class:`x`, :py:func:`x`) left as text: mkdocstrings renders Markdown, not reST."""
    return RAW_ROLE.findall(html)


def test_a_raw_role_is_found_in_rendered_html():
    assert raw_roles("<p>see :class:<code>jobs.spec.JobSpec</code> and :py:func:`f`</p>") == [":class:", ":py:func:"]
    assert raw_roles("<p>see <code>jobs.spec.JobSpec</code>, a ratio 1:2, https://x.org</p>") == []


def test_the_api_pages_show_no_raw_sphinx_roles(built_site):
    site, built = built_site
    assert built.returncode == 0, (built.stdout + built.stderr)[-4000:]
    pages = sorted((site / "api").rglob("*.html"))
    assert len(pages) >= 5
    found = {page.relative_to(site).as_posix(): sorted(set(raw_roles(page.read_text()))) for page in pages}
    assert {page: roles for page, roles in found.items() if roles} == {}


def user_pages(mounted: tuple[str, ...]) -> set[str]:
    """The site's pages a reader must find from the navigation: every page under docs/, the benchmark methods and
    every results summary the hook serves. A grid's own `report.md` is left out: it is that grid's raw table, read
    from its summary (which links or embeds it), and the generated example folder pages are reached from the docs."""
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    summaries = {path for path in mounted if path.endswith(".md") and not path.endswith("/report.md")}
    return pages | summaries


def test_every_page_a_reader_should_find_is_in_the_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = set(nav_pages(config["nav"]))
    mounted = load_hooks().mounted_paths()
    assert "benchmarks/results/personalization.md" in mounted  # the hook serves the results summaries
    assert sorted(user_pages(mounted) - listed) == []
    missing = [page for page in listed if not (ROOT / "docs" / page).is_file() and page not in mounted]
    assert missing == []


def test_a_link_to_a_missing_file_outside_docs_fails_the_strict_build(tmp_path):
    # The real pages (the served reports link back into them) with the default theme, no API pages, one probe page.
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs, ignore=shutil.ignore_patterns("api"))
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"site_name: t\ndocs_dir: {docs}\nhooks:\n  - {ROOT / 'scripts' / 'mkdocs_hooks.py'}\n")
    (docs / "probe.md").write_text("# t\n\n[report](../benchmarks/results/genomics.md)\n")
    ok = mkdocs_build(config, tmp_path / "ok")
    assert ok.returncode == 0, (ok.stdout + ok.stderr)[-4000:]
    (docs / "probe.md").write_text("# t\n\n[report](../benchmarks/results/no_such_report.md)\n")
    broken = mkdocs_build(config, tmp_path / "broken")
    assert broken.returncode != 0
    assert "no_such_report.md" in broken.stdout + broken.stderr


@pytest.mark.parametrize(
    ("page", "target", "expected"),
    [
        ("genomics.md", "../benchmarks/results/genomics.md", "benchmarks/results/genomics.md"),
        ("tutorials/genomics.md", "../../benchmarks/README.md", "../benchmarks/README.md"),
        ("tutorials/genomics.md", "../genomics.md", "../genomics.md"),
        ("genomics.md", "../examples/genomics/", "examples/genomics/index.md"),
        ("benchmarks/results/genomics.md", "../../docs/genomics.md", "../../genomics.md"),
        ("benchmarks/results/genomics.md", "genomics_1kg/report.md", "genomics_1kg/report.md"),
        ("genomics.md", "../benchmarks/results/no_such_report.md", "../benchmarks/results/no_such_report.md"),
        ("genomics.md", "https://example.org/a.md", "https://example.org/a.md"),
    ],
)
def test_links_that_leave_docs_point_at_the_served_copy(page, target, expected):
    hooks = load_hooks()
    mounted = set(hooks.mounted_paths())
    assert "benchmarks/results/genomics.md" in mounted
    assert hooks.rewrite_link(page, target, mounted) == expected


def test_an_image_link_and_its_anchor_are_rewritten_together():
    hooks = load_hooks()
    markdown = "![plot](../benchmarks/results/genomics_1kg/curves.png), [a](../benchmarks/README.md#genomics-table)"
    rewritten = hooks.rewrite_links(markdown, "results.md", set(hooks.mounted_paths()))
    assert rewritten == "![plot](benchmarks/results/genomics_1kg/curves.png), [a](benchmarks/README.md#genomics-table)"


def test_the_readme_is_at_most_250_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def linked_pages(markdown_file: Path) -> set[str]:
    """Repository paths of the markdown pages a file links to (anchors dropped)."""
    links = load_hooks().LINK.findall(markdown_file.read_text())
    resolved = {os.path.normpath(markdown_file.parent / target).removeprefix(str(ROOT) + "/") for target, _ in links}
    return {path for path in resolved if path.endswith(".md") and (ROOT / path).is_file()}


def test_the_home_page_routes_to_every_page_the_readme_does():
    # A capability the README points a newcomer to (personalization, privacy, genotype files, GPU figures) must be
    # reachable from the site's home page too; the home page may link more.
    from_readme = linked_pages(ROOT / "README.md")
    assert "docs/personalization.md" in from_readme
    assert sorted(from_readme - linked_pages(ROOT / "docs" / "index.md")) == []
