"""LiteRT-LM's ``LlmMetadata`` (a `.litertlm` bundle's ``LlmMetadataProto`` section) turned into
what a `ModelMeta` records: start and stop token ids, the chat template, sampler defaults.
Per-role prefix/suffix templates become the equivalent Jinja template (`affix_template`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.base.errors import ModelFormatError

if TYPE_CHECKING:
    from agent.model.litertlm.bundle import Bundle

log = logging.getLogger(__name__)

TokenRef = tuple[int, ...] | str  # ids, or a token's text


@dataclass(frozen=True, slots=True)
class LlmInfo:
    """What an ``LlmMetadata`` says, before its token texts are looked up."""

    start: TokenRef | None
    stops: tuple[TokenRef, ...]
    template: str  # Jinja, or "" when the bundle has none
    template_kind: str  # "jinja" | "prefix/suffix" | "none"
    generation: tuple[tuple[str, float], ...]
    max_tokens: int | None
    model_type: str | None  # LlmModelType's case: "gemma3", "qwen3", "generic_model", ...


@dataclass(frozen=True, slots=True)
class TokenIds:
    bos_id: int | None
    eos_id: int | None
    stop_ids: tuple[int, ...]


def _token(union: Any) -> TokenRef | None:
    which = union.WhichOneof("token_union")
    if which == "token_ids":
        return tuple(int(i) for i in union.token_ids.ids) or None
    if which == "token_str":
        return str(union.token_str) or None
    return None


def jinja_literal(text: str) -> str:
    """`text` as a Jinja string literal that renders to exactly `text`."""
    out = []
    for ch in text:
        if ch in '\\"' or not (" " <= ch <= "~"):
            out.append(f"\\U{ord(ch):08x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def affix_template(
    user: tuple[str, str], model: tuple[str, str], system: tuple[str, str], bos: bool
) -> str:
    """The Jinja template that renders LiteRT-LM's per-role (prefix, suffix) pairs; `bos`: the
    conversation starts with the BOS token (LiteRT-LM puts the start token before the first
    turn, `runtime/core/session_utils.cc` ApplyPromptTemplates)."""
    up, us = map(jinja_literal, user)
    mp, ms = map(jinja_literal, model)
    sp, ss = map(jinja_literal, system)
    return (
        ("{{ bos_token }}" if bos else "") + "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' -%}"
        f"{{{{ {sp} }}}}{{{{ message['content'] }}}}{{{{ {ss} }}}}"
        "{%- elif message['role'] == 'user' -%}"
        f"{{{{ {up} }}}}{{{{ message['content'] }}}}{{{{ {us} }}}}"
        "{%- elif message['role'] in ('assistant', 'model') -%}"
        f"{{{{ {mp} }}}}{{{{ message['content'] }}}}{{{{ {ms} }}}}"
        "{%- else -%}"
        "{{ raise_exception('no prompt template for the role ' ~ message['role']) }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        f"{{%- if add_generation_prompt -%}}{{{{ {mp} }}}}{{%- endif -%}}"
    )


def _f32(x: float) -> float:
    """A proto float32 as the decimal it was written as (0.8, not 0.800000011920929)."""
    return float(f"{x:.7g}")


def _sampler(params: Any) -> tuple[tuple[str, float], ...]:
    from litert_lm_builder.runtime.proto import sampler_params_pb2

    kind = sampler_params_pb2.SamplerParameters.Type
    out: dict[str, float] = {}
    if params.type == kind.GREEDY:
        out["temperature"] = 0.0
    elif params.type in (kind.TOP_K, kind.TOP_P):
        out["temperature"] = _f32(params.temperature)
        if params.k > 0:
            out["top_k"] = float(params.k)
        if params.type == kind.TOP_P and 0.0 < params.p <= 1.0:
            out["top_p"] = _f32(params.p)
    return tuple(sorted(out.items()))


def parse_llm_metadata(data: bytes, where: str) -> LlmInfo:
    """Parse an ``LlmMetadata`` protobuf; `where` names it in errors.

    The protobuf is litert-lm-builder's generated ``llm_metadata_pb2``. Tokens are given either as
    ids or as text (resolved through the bundle's own tokenizer, `agent.tokenizer.vocab`). A chat
    template is either Jinja (``jinja_prompt_template``, used as it is) or per-role prefix/suffix
    pairs (``prompt_templates``), which are written here as the equivalent Jinja template: the BOS
    token first (when the bundle has a start token), then ``system``/``user``/``model`` prefix +
    content + suffix per message, the model's prefix as the generation prompt — what LiteRT-LM does
    with them. The affixes become Jinja string literals (every character outside printable ASCII
    escaped), so no affix text is ever read as Jinja.
    """
    from google.protobuf.message import DecodeError
    from litert_lm_builder.runtime.proto import llm_metadata_pb2

    md = llm_metadata_pb2.LlmMetadata()
    try:
        md.ParseFromString(data)
    except DecodeError as exc:
        raise ModelFormatError(f"{where}: LlmMetadata is not a valid protobuf: {exc}") from exc
    if md.HasField("suppress_tokens") and md.suppress_tokens.ids:
        log.warning(
            "%s: suppress_tokens %s are not applied: edge-agent may sample them",
            where,
            list(md.suppress_tokens.ids)[:8],
        )
    if md.HasField("jinja_prompt_template") and md.jinja_prompt_template:
        template, kind = md.jinja_prompt_template, "jinja"
    elif md.HasField("prompt_templates"):
        pt = md.prompt_templates

        def pair(name: str) -> tuple[str, str]:
            if not pt.HasField(name):
                return "", ""
            a = getattr(pt, name)
            return a.prefix, a.suffix

        has_bos = md.HasField("start_token")
        template = affix_template(pair("user"), pair("model"), pair("system"), has_bos)
        kind = "prefix/suffix"
    else:
        template, kind = "", "none"
    return LlmInfo(
        start=_token(md.start_token) if md.HasField("start_token") else None,
        stops=tuple(t for t in map(_token, md.stop_tokens) if t is not None),
        template=template,
        template_kind=kind,
        generation=_sampler(md.sampler_params) if md.HasField("sampler_params") else (),
        max_tokens=int(md.max_num_tokens) if md.max_num_tokens > 0 else None,
        model_type=md.llm_model_type.WhichOneof("model_type")
        if md.HasField("llm_model_type")
        else None,
    )


def read_llm_metadata(bundle: Bundle) -> LlmInfo:
    """The bundle's ``LlmMetadataProto`` section."""
    from agent.model.litertlm.bundle import read_section

    where = f"{bundle.path}: section {bundle.metadata.index} (LlmMetadataProto)"
    return parse_llm_metadata(read_section(bundle.path, bundle.metadata), where)


def resolve(info: LlmInfo, tokenizer: Path, where: str) -> TokenIds:
    """Token ids for the start and stop tokens, texts looked up in `tokenizer`.

    A start token of several ids is refused (a model directory holds one BOS id). A stop
    *sequence* of several ids cannot end a generation by id: it is left out with a warning.
    """
    vocab = None

    def ids(ref: TokenRef, what: str) -> tuple[int, ...]:
        nonlocal vocab
        if isinstance(ref, tuple):
            return ref
        from agent.tokenizer.vocab import Vocab

        vocab = vocab or Vocab(tokenizer)
        found = vocab.id(ref)
        if found is None:
            log.warning("%s: %s %r is not one token of the bundle's tokenizer", where, what, ref)
            return ()
        return (found,)

    bos = None
    if info.start is not None:
        start = ids(info.start, "start token")
        if len(start) != 1:
            raise ModelFormatError(
                f"{where}: start token {info.start!r} is {len(start)} ids; one is supported"
            )
        bos = start[0]
    stops: list[int] = []
    for ref in info.stops:
        got = ids(ref, "stop token")
        if len(got) == 1:
            stops.append(got[0])
        elif len(got) > 1:
            log.warning("%s: stop sequence %s of several ids left out", where, list(got))
    stops = list(dict.fromkeys(stops))
    if not stops:
        log.warning("%s: no stop token: a generation ends only at its token limit", where)
    return TokenIds(bos, stops[0] if stops else None, tuple(stops))
