"""A profile for a one-shot command (``generate``, ``model ...``, ``update make``): never the
daemon's own directories."""

from __future__ import annotations

import dataclasses
import logging

from agent.base.userdirs import cache_dir
from agent.profile.schema import DeviceProfile

log = logging.getLogger(__name__)


def one_shot_profile(profile: DeviceProfile) -> DeviceProfile:
    """`profile` for a command that is not the daemon: a weight cache it names (a board's
    ``/var/cache/edge-agent/xnnpack``, the daemon's, owned by its user) becomes ``xnnpack/`` in
    the user's `cache_dir()`, so a one-shot command never writes the daemon's files. A profile
    that names none keeps none (packed weights in memory, as before)."""
    named = profile.runtime.xnnpack_weight_cache_dir
    if named is None:
        return profile
    directory = cache_dir() / "xnnpack"
    if named != directory:
        log.info("weight cache %s is the daemon's; this command uses %s", named, directory)
    runtime = dataclasses.replace(profile.runtime, xnnpack_weight_cache_dir=directory)
    return dataclasses.replace(profile, runtime=runtime)
