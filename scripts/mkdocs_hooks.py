"""MkDocs hook: the docs site also serves the repository files that the pages link to outside `docs/`.

The pages link to benchmark reports, their plots and the examples with relative paths that work on GitHub
(`../benchmarks/results/genomics.md`). MkDocs only knows files under `docs/` and, with `--strict`, fails on such a
link. So this hook adds those files to the site at their repository path (`benchmarks/results/genomics.md` is the
page `benchmarks/results/genomics/`) and rewrites, page by page, every link that leaves `docs/` into the same target
seen from the page's place in the site. A link to a file that does not exist is left as written, so MkDocs still
reports it and `--strict` still fails on it.
"""

from __future__ import annotations

import ast
import functools
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
DOCS = "docs"
#: Repository files served beside the pages: glob patterns relative to the repository root.
MOUNTED = (
    "benchmarks/README.md",
    "benchmarks/results/*.md",
    "benchmarks/results/*/report.md",
    "benchmarks/results/**/*.png",
    "examples/**/*.py",
)
#: A markdown link or image target: `](target)` or `](target#anchor)`, no spaces.
LINK = re.compile(r"\]\(([^)\s#]+)((?:#[^)\s]*)?)\)")


@functools.cache
def mounted_paths(root: Path = ROOT) -> tuple[str, ...]:
    """Repository-relative paths of the files outside `docs/` that the site serves."""
    found = {p.relative_to(root).as_posix() for pattern in MOUNTED for p in root.glob(pattern) if p.is_file()}
    return tuple(sorted(path for path in found if "/cells/" not in path and "__pycache__" not in path))


def repository_path(site_path: str, mounted: set[str]) -> str:
    """Where a file of the site lives in the repository: mounted files at their own path, pages under `docs/`."""
    return site_path if site_path in mounted else posixpath.join(DOCS, site_path)


def site_path(repo_path: str) -> str:
    """Where a repository file is in the site: `docs/<page>.md` is `<page>.md`, a mounted file keeps its path."""
    prefix = DOCS + "/"
    return repo_path[len(prefix) :] if repo_path.startswith(prefix) else repo_path


def rewrite_link(page_site_path: str, target: str, mounted: set[str]) -> str:
    """The link `target` of the page at `page_site_path`, as it must read in the site.

    Only relative links that leave `docs/` (or, from a mounted file, enter it) change; URLs, absolute paths and
    links that stay on their side are returned as written.
    """
    if "://" in target or target.startswith(("/", "mailto:")):
        return target
    page_dir = posixpath.dirname(repository_path(page_site_path, mounted))
    resolved = posixpath.normpath(posixpath.join(page_dir, target))
    if resolved.startswith("../") or not (ROOT / resolved).exists():
        return target  # outside the repository, or missing: MkDocs reports it as written
    in_site = site_path(resolved)
    if (ROOT / resolved).is_dir():
        in_site = posixpath.join(in_site, "index.md")  # a folder's page (generated for the example packages)
    return posixpath.relpath(in_site, posixpath.dirname(page_site_path) or ".")


def rewrite_links(markdown: str, page_site_path: str, mounted: set[str]) -> str:
    """Every markdown link and image target of a page, rewritten by `rewrite_link`."""

    def replace(match: re.Match[str]) -> str:
        return f"]({rewrite_link(page_site_path, match.group(1), mounted)}{match.group(2)})"

    return LINK.sub(replace, markdown)


def package_folders(paths: tuple[str, ...]) -> list[str]:
    """Folders of mounted Python files (the examples): each gets a generated index page listing its files."""
    return sorted({posixpath.dirname(path) for path in paths if path.endswith(".py")})


def folder_index(folder: str, root: Path = ROOT) -> str:
    """Markdown of a folder's index page: its package docstring, then a link to every file in it."""
    init = root / folder / "__init__.py"
    docstring = ast.get_docstring(ast.parse(init.read_text())) if init.is_file() else None
    names = sorted(p.name for p in (root / folder).iterdir() if p.is_file() and p.suffix == ".py")
    listing = "\n".join(f"- [`{name}`]({name})" for name in names)
    return f"# `{folder}/`\n\n" + (f"```text\n{docstring}\n```\n\n" if docstring else "") + listing + "\n"


def on_files(files: Files, config) -> Files:
    paths = mounted_paths()
    for path in paths:
        files.append(File(path, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    for folder in package_folders(paths):
        files.append(File.generated(config, f"{folder}/index.md", content=folder_index(folder)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    return rewrite_links(markdown, page.file.src_uri, set(mounted_paths()))
