"""Opening the model a command or the daemon names: a model directory (`agent.model.directory`), or
a
`.litertlm` bundle (`agent.model.litertlm.bundle`) extracted once into a cache and described by the
same `ModelMeta`, and where that cache lives."""

from __future__ import annotations

from pathlib import Path

from agent.base.errors import ModelFormatError
from agent.base.userdirs import cache_dir as user_cache_dir
from agent.model.directory import METADATA_FILE, ModelMeta, load_model_dir
from agent.model.litertlm.bundle import is_litertlm
from agent.model.litertlm.cache import open_litertlm

LITERTLM_SUFFIX = ".litertlm"


def open_model(path: Path, cache_dir: Path) -> ModelMeta:
    """The model at `path`: a model directory, or a `.litertlm` bundle whose model and
    tokenizer are extracted into `cache_dir` (`agent.model.litertlm.cache`; once per bundle)."""
    if path.is_dir():
        return load_model_dir(path)
    if path.suffix == LITERTLM_SUFFIX or is_litertlm(path):
        return open_litertlm(path, cache_dir)
    if path.name == METADATA_FILE:
        return load_model_dir(path.parent)
    if not path.exists():
        raise ModelFormatError(f"{path}: no such model directory or .litertlm file")
    raise ModelFormatError(
        f"{path}: not a model directory or a .litertlm bundle (a single .tflite needs a "
        "model directory: edge-agent model import)"
    )


def unpack_cache_dir(weight_cache_dir: Path | None, state_dir: Path | None) -> Path:
    """Where `.litertlm` bundles are extracted: ``litertlm/`` beside the profile's XNNPACK
    weight cache (the daemon always has one), else in the state directory's ``cache/``, else
    in the user's cache (`agent.base.userdirs.cache_dir`: ``$CACHE_DIRECTORY``,
    ``$XDG_CACHE_HOME/edge-agent``, ``~/.cache/edge-agent``)."""
    if weight_cache_dir is not None:
        return weight_cache_dir.parent / "litertlm"
    if state_dir is not None:
        return state_dir / "cache" / "litertlm"
    return user_cache_dir() / "litertlm"
