"""The Session every operation works on: a spec, its plan, a Remote to its hosts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..plan import JobPlan
from ..remote import Remote

if TYPE_CHECKING:  # the spec models (pydantic) load only on a plan-cache miss or when an operation needs them
    from ..spec import ClusterSpec

__all__ = ["Session"]


class Session:
    """A loaded spec, its plan, and a Remote to its hosts: what every operation works on.

    From a cached plan (clusterctl.plancache) the spec is loaded only when an operation asks for it."""

    def __init__(self, spec: "ClusterSpec | None", plan: JobPlan, remote: Remote, *, spec_path: str | None = None):
        self._spec, self._spec_path, self.plan, self.remote = spec, spec_path, plan, remote

    @property
    def spec(self) -> "ClusterSpec":
        """The validated spec (loaded on first use when the session was opened from a cached plan)."""
        if self._spec is None:
            from ..spec import load_spec

            self._spec = load_spec(self._spec_path)
        return self._spec

    @spec.setter
    def spec(self, value: "ClusterSpec") -> None:
        self._spec = value

    @property
    def spec_path(self) -> str | None:
        """The spec file the session was opened from (None when opened from a spec object)."""
        return self._spec_path

    @property
    def spec_loaded(self) -> bool:
        """Whether the spec models are loaded already (asking for `spec` then costs nothing)."""
        return self._spec is not None
