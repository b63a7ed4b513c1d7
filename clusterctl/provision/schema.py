"""The `provision` section of the spec. Must not import clusterctl.spec (which imports this)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ProvisionSpec"]


class ProvisionSpec(BaseModel):
    """What every host needs before a job can run (filled in by the provisioning work)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
