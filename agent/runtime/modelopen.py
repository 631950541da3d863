"""Opening the model a command or the daemon names: a model directory (`agent.modeldir`), or a
`.litertlm` bundle (`agent.runtime.litertlm`) extracted once into a cache and described by the
same `ModelMeta`, and where that cache lives."""

from __future__ import annotations

from pathlib import Path

from agent.errors import ModelFormatError
from agent.modeldir import METADATA_FILE, ModelMeta, load_model_dir
from agent.runtime.litertlm import is_litertlm
from agent.runtime.litertlm_cache import open_litertlm
from agent.userdirs import cache_dir as user_cache_dir

LITERTLM_SUFFIX = ".litertlm"


def open_model(path: Path, cache_dir: Path) -> ModelMeta:
    """The model at `path`: a model directory, or a `.litertlm` bundle whose model and
    tokenizer are extracted into `cache_dir` (`agent.runtime.litertlm_cache`; once per bundle)."""
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
    in the user's cache (`agent.userdirs.cache_dir`: ``$CACHE_DIRECTORY``,
    ``$XDG_CACHE_HOME/edge-agent``, ``~/.cache/edge-agent``)."""
    if weight_cache_dir is not None:
        return weight_cache_dir.parent / "litertlm"
    if state_dir is not None:
        return state_dir / "cache" / "litertlm"
    return user_cache_dir() / "litertlm"
