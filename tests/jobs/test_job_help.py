"""``python -m jobs.build --help`` is written for people, and a job never lands in the repository's own jobs/ unless
asked: the builder's and the client script's option groups carry a title and a description in words (a settings
dataclass without a docstring used to show its generated signature, ``ModelSettings(*, arch: 'str' = ...)``), and
``--output-dir`` defaults to ``./fl_jobs`` of the current directory, while ``--presets`` keeps writing and checking
the committed jobs/."""

from __future__ import annotations

import re

import pytest

from jobs import build
from jobs.assembly import JOBS_DIR
from jobs.client import build_parser as client_parser

#: What a generated dataclass signature or a class name looks like: ``Name(*, field: 'type' = ...``, ``= <factory>``,
#: a ``...Settings`` class name.
REPR = re.compile(r"\w+\(\*|\w+: '\w|= <factory>|\w+Settings\b")


def _setting_groups(parser):
    return [group for group in parser._action_groups if group.title not in ("positional arguments", "options")]


@pytest.mark.parametrize("parser", [build.build_parser(), client_parser()], ids=["jobs.build", "client script"])
def test_every_option_group_has_a_title_and_description_written_for_people(parser):
    groups = _setting_groups(parser)
    assert len(groups) >= 11
    for group in groups:
        assert group.title and group.description, group.title
        for text in (group.title, group.description):
            assert not REPR.search(text), f"group {group.title!r} reads like code: {text[:80]!r}"
        assert group.title == group.title.strip() and "\n" not in group.title


def test_the_titles_are_distinct_so_that_help_reads_as_sections():
    titles = [group.title for group in _setting_groups(build.build_parser())]
    assert len(set(titles)) == len(titles)


def test_a_job_is_written_under_the_current_directory_not_the_repositorys_jobs(tmp_path, monkeypatch, capsys):
    written = []

    def export_job(spec, output_dir, *_):  # where the builder asks for the job; export_job resolves it from the cwd
        written.append(output_dir.resolve() / spec.name)
        return written[-1]

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(build, "export_job", export_job)
    assert build.main(["--name", "probe"]) == 0
    assert written == [tmp_path / build.DEFAULT_OUTPUT_DIR / "probe"]
    assert not written[0].is_relative_to(JOBS_DIR)
    assert f"exported {written[0]}" in capsys.readouterr().out


def test_presets_still_write_and_check_the_committed_jobs(monkeypatch):
    seen = []
    monkeypatch.setattr(build, "check_presets", lambda output_dir: seen.append(output_dir) or [])
    assert build.main(["--presets", "--check"]) == 0
    assert build.main(["--presets", "--check", "--output-dir", "elsewhere"]) == 0
    assert [str(path) for path in seen] == [str(JOBS_DIR), "elsewhere"]
