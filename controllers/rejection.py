"""A client result the server refused, and why.

Its own module because both the round engine (which validates every result) and the NVFlare adapters (which
convert ``FLModel`` results and call the engine's validation) speak of it: the adapters build on the engine, so the
engine must not import them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rejection:
    """A client result the server refused, with every reason found."""

    site: str
    problems: tuple[str, ...]

    def __str__(self) -> str:
        return f"rejected result from {self.site}: " + "; ".join(self.problems)
