"""`import_model`: the source checked, the model directory written into a temp directory beside
the target, read back and renamed into place, so a refusal or a crash leaves nothing
half-written."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from agent.base.errors import ModelFormatError
from agent.model.directory import ModelMeta, load_model_dir, write_model_dir_metadata
from agent.modelimport.bundle import from_bundle
from agent.modelimport.draft import Progress
from agent.modelimport.folder import from_folder

log = logging.getLogger(__name__)
_SOURCES = "tokenizer_config.json, generation_config.json, config.json or the tokenizer"


def _check_target(out: Path) -> None:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ModelFormatError(f"{out}: exists and is not a directory; choose another -o")
    if out.is_dir() and any(out.iterdir()):
        raise ModelFormatError(
            f"{out}: exists and is not empty; import writes only into a new or empty directory"
        )


def import_model(
    src: Path,
    out: Path,
    *,
    name: str | None = None,
    version: str | None = None,
    files: Sequence[str] = (),
    progress: Progress | None = None,
    allow_no_stop: bool = False,
    decided: list[str] | None = None,
) -> ModelMeta:
    """Write the model directory `out` from `src` (a `.litertlm` or a download folder).

    `files` picks which `.tflite` files of a folder to import (default: all of them).
    A model with no stop token would never end a generation: it is refused unless
    `allow_no_stop`. `decided`, when given, receives one line per token fact and its source.
    Raises `ModelFormatError` naming the file and what is wrong (an unreadable source file,
    an unwritable target too); `out` is then untouched.
    """
    try:
        return _import(src, out, name, version, files, progress, allow_no_stop, decided)
    except OSError as exc:
        raise ModelFormatError(f"{exc.filename or out}: {exc.strerror or exc}") from exc


def _import(
    src: Path,
    out: Path,
    name: str | None,
    version: str | None,
    files: Sequence[str],
    progress: Progress | None,
    allow_no_stop: bool,
    decided: list[str] | None,
) -> ModelMeta:
    from agent.model.litertlm.bundle import is_litertlm

    if not src.exists():
        raise ModelFormatError(f"{src}: no such file or directory")
    bundle = src.is_file() and (src.suffix == ".litertlm" or is_litertlm(src))
    if not bundle and not src.is_dir():
        raise ModelFormatError(f"{src}: neither a .litertlm bundle nor a folder with .tflite files")
    if bundle and files:
        raise ModelFormatError(f"{src}: --file picks .tflite files of a folder, not of a bundle")
    _check_target(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".import"))
    try:
        draft = (
            from_bundle(src, tmp, name, version, progress)
            if bundle
            else from_folder(src, tmp, name, version, files, progress)
        )
        if decided is not None:
            decided.extend(draft.decided)
        if not draft.stop_token_ids and not allow_no_stop:
            raise ModelFormatError(
                f"{src}: no stop token (no EOS in {_SOURCES if not bundle else 'its LlmMetadata'}"
                "): every generation would run to its token limit; name one in the source, or "
                "import anyway with --allow-no-stop"
            )
        write_model_dir_metadata(
            tmp,
            name=draft.name,
            version=draft.version,
            context_length=draft.context_length,
            bos_id=draft.bos_id,
            eos_id=draft.eos_id,
            stop_token_ids=draft.stop_token_ids,
            chat_template=draft.chat_template,
            variants=draft.variants,
            tokenizer=draft.tokenizer,
            add_bos=draft.add_bos,
            generation=draft.generation,
            sha256=draft.sha256,
        )
        load_model_dir(tmp)  # what was written reads back
        _readable(tmp)
        _check_target(out)  # nothing appeared there meanwhile
        os.replace(tmp, out)  # onto a missing or empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("model import: %s -> %s", src, out)
    return load_model_dir(out)


def _readable(directory: Path) -> None:
    """Modes as a plain copy would give them (temp files are created owner-only): the daemon's
    user must be able to read a directory someone else imported."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for f in directory.iterdir():
        os.chmod(f, 0o666 & ~umask)
