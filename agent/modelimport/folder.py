"""A download folder imported (litert-community / Hugging Face): its `.tflite` exports and
tokenizer copied, and what its side files (``tokenizer_config.json``, ``generation_config.json``,
``config.json``, ``chat_template.jinja``) say about ids, template and sampling."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.base.errors import ModelFormatError
from agent.modelimport.draft import Draft, Progress, copy_hashed
from agent.tokenizer.vocab import Vocab

TOKENIZERS = ("tokenizer.json", "tokenizer.model")
SIDE_FILES = ("tokenizer_config.json", "generation_config.json", "config.json")


def _json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return doc


def _token_text(doc: dict[str, Any], key: str, where: Path) -> str | None:
    """``bos_token``/``eos_token``: a string, an AddedToken object ``{"content": ...}`` or null."""
    value = doc.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value or None
    raise ModelFormatError(f"{where}: {key} = {value!r} should be a string or null")


def _ids(doc: dict[str, Any] | None, key: str, where: Path) -> list[int]:
    """An id or a list of ids (``eos_token_id``), as a list."""
    value = None if doc is None else doc.get(key)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelFormatError(f"{where}: {key} = {value!r} should be a token id or a list of ids")
    return list(values)


def _config_ids(config: dict[str, Any] | None, key: str, where: Path) -> list[int]:
    """`config.json`'s ids, also where multimodal configs nest them (``text_config``)."""
    found = _ids(config, key, where)
    if not found and config is not None and isinstance(config.get("text_config"), dict):
        found = _ids(config["text_config"], key, where)
    return found


def _template(src: Path, tok_config: dict[str, Any] | None) -> str:
    where = src / "tokenizer_config.json"
    value = None if tok_config is None else tok_config.get("chat_template")
    if value is None and (src / "chat_template.jinja").is_file():
        where = src / "chat_template.jinja"
        value = where.read_text(encoding="utf-8")
    if value is None:
        return ""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            have = ", ".join(repr(n) for n in named) or "none"
            raise ModelFormatError(
                f"{where}: chat_template is a list without a 'default' template (names: {have})"
            )
        value = named["default"]
    if not isinstance(value, str):
        raise ModelFormatError(
            f"{where}: chat_template = {value!r:.60} should be a string or a list of "
            "{name, template} objects"
        )
    if "{%" in value or "{{" in value:
        _check_jinja(value, where)
    return value


def _check_jinja(template: str, where: Path) -> None:
    """Refuse a template that the chat code could not compile (the same environment)."""
    from agent.chat.template import ChatTemplate

    error = ChatTemplate(template).error
    if error:
        raise ModelFormatError(f"{where}: chat_template is not valid Jinja ({error})")


def _generation(gen: dict[str, Any] | None, where: Path) -> dict[str, float]:
    if gen is None or gen.get("do_sample") is False:
        return {}
    out = {}
    for key in ("temperature", "top_k", "top_p"):
        value = gen.get(key)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ModelFormatError(f"{where}: {key} = {value!r} should be a number")
        out[key] = float(value)
    return out


def _special_ids(
    draft: Draft,
    src: Path,
    vocab: Vocab,
    tok_config: dict[str, Any] | None,
    gen: dict[str, Any] | None,
    config: dict[str, Any] | None,
) -> None:
    """BOS, EOS, the stop ids and whether to add BOS, each from the first file that states it:
    ``tokenizer_config.json`` (token strings, ``add_bos_token``), ``generation_config.json``,
    ``config.json``, and last the tokenizer itself (a SentencePiece model defines its own BOS
    and EOS ids). Every decision and its source go into `draft.decided`."""
    tc_where = src / "tokenizer_config.json"
    gen_where = src / "generation_config.json"
    cfg_where = src / "config.json"
    tok_name = vocab.path.name
    bos_text = None if tok_config is None else _token_text(tok_config, "bos_token", tc_where)
    eos_text = None if tok_config is None else _token_text(tok_config, "eos_token", tc_where)
    gen_eos = _ids(gen, "eos_token_id", gen_where)
    cfg_eos = _config_ids(config, "eos_token_id", cfg_where)
    bos_from = eos_from = ""
    if bos_text is not None:
        draft.bos_id, bos_from = vocab.require(bos_text, f"{tc_where}: bos_token"), tc_where.name
    elif tok_config is not None and "bos_token" in tok_config:  # null: the tokenizer has none
        draft.bos_id, bos_from = None, f"{tc_where.name} (bos_token: null)"
    elif bos := _ids(gen, "bos_token_id", gen_where):
        draft.bos_id, bos_from = bos[0], gen_where.name
    elif bos := _config_ids(config, "bos_token_id", cfg_where):
        draft.bos_id, bos_from = bos[0], cfg_where.name
    elif (own := vocab.own_ids()[0]) is not None:
        draft.bos_id, bos_from = own, tok_name
    if eos_text is not None:
        draft.eos_id, eos_from = vocab.require(eos_text, f"{tc_where}: eos_token"), tc_where.name
    elif gen_eos or cfg_eos:
        draft.eos_id = (gen_eos or cfg_eos)[0]
        eos_from = gen_where.name if gen_eos else cfg_where.name
    elif (own := vocab.own_ids()[1]) is not None:
        draft.eos_id, eos_from = own, tok_name
    more = gen_eos if gen is not None else cfg_eos
    eos_first = [] if draft.eos_id is None else [draft.eos_id]
    draft.stop_token_ids = list(dict.fromkeys([*eos_first, *more]))
    for what, i in (("bos", draft.bos_id), *(("stop", s) for s in draft.stop_token_ids)):
        if i is not None and not 0 <= i < vocab.size:
            raise ModelFormatError(
                f"{src}: {what} token id {i} is outside the tokenizer's {vocab.size} tokens"
            )
    add_bos = None if tok_config is None else tok_config.get("add_bos_token")
    if add_bos is not None and not isinstance(add_bos, bool):
        raise ModelFormatError(f"{tc_where}: add_bos_token = {add_bos!r} should be true or false")
    if add_bos and draft.bos_id is None:
        raise ModelFormatError(f"{tc_where}: add_bos_token is true but there is no bos_token")
    add_from = f"{tc_where.name} (add_bos_token)"
    if add_bos is None:
        add_bos = draft.bos_id is not None and vocab.adds_bos(draft.bos_id)
        add_from = f"{tok_name} (its encoding rule)" if draft.bos_id is not None else "no BOS"
    draft.add_bos = add_bos
    draft.decided = [
        f"bos_id {_named(vocab, draft.bos_id)} from {bos_from or 'nowhere: no file names one'}",
        f"add_bos {str(add_bos).lower()} from {add_from}",
        f"eos_id {_named(vocab, draft.eos_id)} from {eos_from or 'nowhere: no file names one'}",
        "stop_token_ids "
        + (", ".join(_named(vocab, i) for i in draft.stop_token_ids) or "none")
        + (f" (with {gen_where.name if gen is not None else cfg_where.name})" if more else ""),
    ]


def _named(vocab: Vocab, i: int | None) -> str:
    return "none" if i is None else f"{i} {vocab.piece(i)!r}"


def _pick_tflite(src: Path, files: Sequence[str]) -> list[Path]:
    found = sorted(p for p in src.iterdir() if p.suffix == ".tflite" and p.is_file())
    if files:
        by_name = {p.name: p for p in found}
        missing = [f for f in files if f not in by_name]
        if missing:
            raise ModelFormatError(f"{src}: no .tflite named {', '.join(missing)}")
        found = [by_name[f] for f in dict.fromkeys(files)]
    if not found:
        bundles = sorted(p.name for p in src.glob("*.litertlm"))
        hint = f"; import the bundle itself: {', '.join(bundles)}" if bundles else ""
        raise ModelFormatError(f"{src}: no .tflite file (a model export) in the folder{hint}")
    return found


def from_folder(
    src: Path,
    tmp: Path,
    name: str | None,
    version: str | None,
    files: Sequence[str],
    progress: Progress | None,
) -> Draft:
    from agent.model.facts import context_length_of, quantization_of
    from agent.model.tflite.file import read_model_file

    tok_file = next((src / t for t in TOKENIZERS if (src / t).is_file()), None)
    if tok_file is None:
        raise ModelFormatError(f"{src}: no tokenizer ({' or '.join(TOKENIZERS)}) in the folder")
    tok_config, gen, config = (_json(src / f) for f in SIDE_FILES)
    vocab = Vocab(tok_file)
    draft = Draft(name=name or src.resolve().name, version=version or "0")
    draft.chat_template = _template(src, tok_config)
    draft.generation = _generation(gen, src / "generation_config.json")

    by_quant: dict[str, Path] = {}
    contexts: dict[int, Path] = {}
    vocab_size = 0
    for path in _pick_tflite(src, files):
        model = read_model_file(path)
        try:
            context, layout = context_length_of(model)
        except ModelFormatError as exc:
            also = " (choose the model's files with --file)" if not files else ""
            raise ModelFormatError(f"{path}: {exc}{also}") from exc
        quant = quantization_of(model)
        if quant in by_quant:
            raise ModelFormatError(
                f"{path}: a second {quant} variant (beside {by_quant[quant].name}); a model "
                "directory holds one file per quantization: pick one with --file"
            )
        by_quant[quant] = path
        contexts.setdefault(context, path)
        vocab_size = layout.vocab_size if not vocab_size else min(vocab_size, layout.vocab_size)
    if len(contexts) > 1:
        listed = ", ".join(f"{p.name}: {c}" for c, p in contexts.items())
        raise ModelFormatError(
            f"{src}: the variants have different context lengths ({listed}); a model "
            "directory holds one: pick files of one length with --file"
        )
    draft.context_length = next(iter(contexts))
    if vocab.size > vocab_size:
        raise ModelFormatError(
            f"{tok_file}: the tokenizer has {vocab.size} tokens but the model's vocabulary "
            f"is {vocab_size}"
        )

    _special_ids(draft, src, vocab, tok_config, gen, config)

    for quant, path in sorted(by_quant.items()):
        draft.sha256[path.name] = copy_hashed(path, tmp / path.name, progress)
        draft.variants.append((path.name, quant))
    draft.tokenizer = tok_file.name
    shutil.copyfile(tok_file, tmp / tok_file.name)
    for side in SIDE_FILES:
        if (src / side).is_file():
            shutil.copyfile(src / side, tmp / side)
    return draft
