"""A `.litertlm` bundle imported: its model extracted, its tokenizer and LLM metadata read."""

from __future__ import annotations

import logging
from pathlib import Path

from agent.base.errors import ModelFormatError
from agent.modelimport.draft import Draft, Progress

log = logging.getLogger(__name__)


def from_bundle(
    src: Path, tmp: Path, name: str | None, version: str | None, progress: Progress | None
) -> Draft:
    from agent.model.litertlm.bundle import extract_model, read_bundle, tokenizer_file
    from agent.model.litertlm.metadata import read_llm_metadata, resolve

    bundle = read_bundle(src)
    for s, why in bundle.ignored:
        log.info("%s: section %d (%s) not imported: %s", src, s.index, s.kind, why)
    info = read_llm_metadata(bundle)
    staged = tmp / "model.tflite.part"
    sha = extract_model(
        bundle, staged, None if progress is None else lambda d, t: progress(src.name, d, t)
    )
    quant, context = _facts(staged, info.max_tokens, src)
    file = f"model_{quant}.tflite"
    staged.rename(tmp / file)
    tok_name, data = tokenizer_file(bundle)
    (tmp / tok_name).write_bytes(data)
    ids = resolve(info, tmp / tok_name, str(src))
    given = bundle.system_item("version")
    meta = f"{src.name}'s LlmMetadata"
    decided = [
        f"bos_id {ids.bos_id if ids.bos_id is not None else 'none'} from {meta} (start token)",
        f"add_bos {str(ids.bos_id is not None).lower()} from {meta} (a start token is added)",
        f"eos_id {ids.eos_id if ids.eos_id is not None else 'none'} from {meta}",
        "stop_token_ids "
        + (", ".join(str(i) for i in ids.stop_ids) or "none")
        + f" from {meta} (stop tokens)",
    ]
    return Draft(
        name=name or src.name.removesuffix(".litertlm"),
        version=version or (str(given) if given is not None else "0"),
        context_length=context,
        tokenizer=tok_name,
        bos_id=ids.bos_id,
        eos_id=ids.eos_id,
        stop_token_ids=list(ids.stop_ids),
        chat_template=info.template,
        add_bos=ids.bos_id is not None,
        generation=dict(info.generation),
        variants=[(file, quant)],
        sha256={file: sha},
        decided=decided,
    )


def _facts(path: Path, hint: int | None, where: Path) -> tuple[str, int]:
    """(quantization, context length) of a `.tflite`; refuses what is not an LLM export."""
    from agent.model.facts import context_length_of, quantization_of
    from agent.model.tflite.file import read_model_file

    model = read_model_file(path)
    try:
        context, _ = context_length_of(model, hint)
    except ModelFormatError as exc:
        raise ModelFormatError(f"{where}: {exc}") from exc
    return quantization_of(model), context
