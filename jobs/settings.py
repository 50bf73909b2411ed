"""The job settings on the command line: ``python -m jobs.build`` and every site's client script ``jobs/client.py``.

The settings themselves are declared once in `aggregators.contracts.job_settings` (the bottom layer, which the server's
controller reads too), on the one declaration of `aggregators.contracts.hparams` that server rules and client algorithms
use; they are re-exported here unchanged. This module adds what only a command line needs: one option per setting in an
argument group per settings group (`add_arguments`), the parsers of JSON and number-or-none values, and argument
parsers whose errors are one line.

This module imports only the standard library and the bottom layer, so the client script can use it on a site
before (and without) importing torch, Lightning or NVFlare's job API; `registries` imports the registries the
settings name when build time calls it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from aggregators.contracts.hparams import REAL, Kind, allowed_text, declared_fields, field_bounds
from aggregators.contracts.job_settings import (
    ATTACK_FIELDS,
    CLIENT,
    JOB_GROUPS,
    JSON_FIELDS,
    NUM_CLASSES,
    SERVER,
    SITE,
    AttackSettings,
    ClientAlgorithmSettings,
    DataSettings,
    JobBuildError,
    LocalTrainingSettings,
    ModelSettings,
    PrecisionSettings,
    PrivacySettings,
    RoundSettings,
    SecureAggregationSettings,
    SiteSettings,
    TrackingSettings,
    UserCodeSettings,
    check_settings,
    dataset_num_classes,
    is_private,
    registry_problem,
    setting,
    setting_fields,
    setting_problem,
)

__all__ = [  # the declarations, importable from here as before they moved to the bottom layer
    "ATTACK_FIELDS",
    "CLIENT",
    "JOB_GROUPS",
    "JSON_FIELDS",
    "NUM_CLASSES",
    "SERVER",
    "SITE",
    "AttackSettings",
    "ClientAlgorithmSettings",
    "ClientArgumentParser",
    "DataSettings",
    "JobBuildError",
    "Kind",
    "LocalTrainingSettings",
    "ModelSettings",
    "OneLineErrorParser",
    "PrecisionSettings",
    "PrivacySettings",
    "RoundSettings",
    "SecureAggregationSettings",
    "SiteSettings",
    "TrackingSettings",
    "UserCodeSettings",
    "add_arguments",
    "allowed_text",
    "check_settings",
    "compact_json",
    "dataset_num_classes",
    "flag",
    "is_private",
    "parse_json_object",
    "parse_number_or_none",
    "registries",
    "registry_problem",
    "setting",
    "setting_fields",
    "setting_problem",
]


def registries() -> dict[str, Mapping[str, Any]]:
    """The registries the job settings name (``registry="models"`` ...), by those names: the bottom layer names no
    module above it, so build time hands them to `check_settings`. Imports them (and torch) when called."""
    from aggregators.registry import RULES
    from lightning_modules.algorithms.registry import CLIENT_ALGORITHMS
    from lightning_modules.models import MODELS

    return {"client_algorithms": CLIENT_ALGORITHMS, "models": MODELS, "rules": RULES}


# --------------------------------------------------------------------------------------------------------------------
# Command lines
# --------------------------------------------------------------------------------------------------------------------
def compact_json(value: Mapping[str, Any], option: str = "a JSON setting") -> str:
    """JSON without whitespace: NVFlare splits ``task_script_args`` on whitespace and does not honour quotes;
    ``option`` (``--data-args``, ...) names the setting in the refusal."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    if any(ch.isspace() for ch in text):
        raise JobBuildError(f"{option} must not contain whitespace (NVFlare splits arguments on it): {text}")
    return text


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def parse_number_or_none(text: str) -> int | float | None:
    """``none`` -> None, ``3`` -> 3, ``0.5`` / ``nan`` / ``1e-3`` -> float (a dot or exponent makes a fraction)."""
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, a number or none, got {text!r}") from None


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_optional(text: str) -> Any:
        return None if text.lower() == "none" else parse(text)

    parse_optional.__name__ = getattr(parse, "__name__", "value")
    return parse_optional


def _parser_type(kind: Kind) -> Callable[[str], Any]:
    if kind.base is dict:
        return parse_json_object
    if kind.base is REAL:  # an integer count or a fraction: the text decides which
        return parse_number_or_none
    base = kind.base if kind.base in (int, float) else str
    return _optional(base) if kind.optional else base


def group_description(group: type) -> str | None:
    """The first paragraph of a settings group's docstring (its own: a dataclass without one gets its signature as
    ``__doc__``, which is no description)."""
    own = group.__dict__.get("__doc__") or ""
    return None if own.startswith(group.__name__ + "(") else own.strip().split("\n\n")[0] or None


def add_arguments(
    parser: argparse.ArgumentParser,
    groups: Sequence[type],
    *,
    sides: Sequence[str],
    json_as_text: bool = False,
    choices_help: Mapping[str, str] | None = None,
) -> None:
    """Add one option per field of ``groups`` used on ``sides``, in an argument group per settings group (titled
    with the group's ``title``, described by its docstring).

    ``json_as_text``: JSON settings stay text (the client script parses them itself). Options are not checked by
    argparse beyond their type: `check_settings` checks values, so every entry point words errors alike.
    """
    for group in groups:
        arguments = parser.add_argument_group(group.title, group_description(group))
        for spec_field, kind in declared_fields(group):
            if spec_field.metadata["side"] not in sides:
                continue
            default = spec_field.default if spec_field.default is not dataclasses.MISSING else {}
            description = (choices_help or {}).get(spec_field.name) or spec_field.metadata["help"]
            if kind.base is bool:
                arguments.add_argument(flag(spec_field.name), action="store_true", help=description)
                continue
            if kind.base is dict and json_as_text:
                arguments.add_argument(flag(spec_field.name), default="{}", help=f"{description} (default: {{}})")
                continue
            allowed = allowed_text(kind, field_bounds(spec_field))
            arguments.add_argument(
                flag(spec_field.name),
                type=_parser_type(kind),
                default=default,
                metavar=spec_field.name.upper() if kind.choices is None else "{" + ",".join(kind.choices) + "}",
                help=f"{description}; {allowed} (default: {default})",
            )


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (``error: ...``) and exit code 2, as the builder's
    refusals of bad settings are."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


class ClientArgumentParser(argparse.ArgumentParser):
    """The client script's parser: after parsing, every value is checked against its declaration (type,
    finiteness, range, options), so a hand-written command line is refused as the builder would refuse it."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> tuple[Any, list[str]]:
        parsed, extra = super().parse_known_args(args, namespace)
        checked = argparse.Namespace(**vars(parsed))
        for name in JSON_FIELDS & set(vars(parsed)):
            try:
                setattr(checked, name, parse_json_object(getattr(parsed, name)))
            except argparse.ArgumentTypeError as exc:
                self.error(f"{flag(name)}: {exc}")
        try:
            check_settings(checked, (*JOB_GROUPS, SiteSettings), registries=None)
        except JobBuildError as exc:
            self.error(str(exc))
        return parsed, extra
