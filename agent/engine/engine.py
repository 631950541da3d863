"""The engine: a loaded model, its tokenizer and the generation loop.

This issue's engine runs one request at a time on the caller's thread (a lock guards the one
resident KV cache); requests are `Generation`s stepped one unit at a time, which is what a
scheduler interleaves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agent.engine.generation import Generation
from agent.engine.sampler import Sampler, SamplingParams
from agent.engine.types import Completion, GenerateRequest, TokenEvent
from agent.errors import ContextOverflow, InvalidRequest, ModelFormatError
from agent.modeldir import ModelMeta, Variant, load_model_dir, sha256_file
from agent.profile import DeviceProfile, choose_quantization
from agent.runtime import litert
from agent.runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_PROMPT_CHARS = 1 << 20


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What is loaded and how it runs."""

    name: str
    version: str
    quantization: str
    sha256: str
    path: Path
    vocab_size: int
    context_length: int
    kv_layout: str
    signatures: tuple[str, ...]
    accelerator: str
    execution_path: str
    fallbacks: tuple[str, ...]
    memory: litert.MemoryPlan


class Engine:
    """Load a model directory under a profile; generate text from prompts."""

    def __init__(
        self,
        profile: DeviceProfile,
        model_dir: Path,
        *,
        quantization: str | None = None,
        verify: bool = True,
        prefer_interpreter: bool = False,
    ) -> None:
        self.profile = profile
        self.meta: ModelMeta = load_model_dir(model_dir)
        available = [v.quantization for v in self.meta.variants]
        quant = quantization or choose_quantization(profile, available)
        variant: Variant = self.meta.variant(quant)
        path = self.meta.path_of(variant)
        if verify:
            actual = sha256_file(path)
            if actual != variant.sha256:
                raise ModelFormatError(
                    f"{path}: sha256 {actual} does not match metadata {variant.sha256}"
                )
        self.tokenizer = Tokenizer(self.meta.tokenizer_path)
        self.loaded = litert.load(
            path,
            profile,
            context_length=self.meta.context_length,
            prefer_interpreter=prefer_interpreter,
        )
        layout = self.loaded.runner.layout
        if layout.vocab_size < self.tokenizer.vocab_size:
            raise ModelFormatError(
                f"{path}: model vocabulary {layout.vocab_size} is smaller than the tokenizer's "
                f"{self.tokenizer.vocab_size}"
            )
        self.info = ModelInfo(
            name=self.meta.name,
            version=self.meta.version,
            quantization=quant,
            sha256=variant.sha256,
            path=path,
            vocab_size=layout.vocab_size,
            context_length=layout.context_length,
            kv_layout=layout.kv.name,
            signatures=tuple(s.key for s in (*layout.prefill, layout.decode)),
            accelerator=self.loaded.accelerator,
            execution_path=self.loaded.path_kind,
            fallbacks=self.loaded.fallbacks,
            memory=self.loaded.memory,
        )
        self._kv = self.loaded.runner.new_kv()
        self._lock = threading.Lock()
        self._stop_ids = frozenset((self.meta.eos_id, *self.meta.stop_token_ids))

    def encode_prompt(self, request: GenerateRequest) -> list[int]:
        if not request.prompt:
            raise InvalidRequest("prompt is empty")
        if len(request.prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequest(
                f"prompt is {len(request.prompt)} characters; at most {MAX_PROMPT_CHARS}"
            )
        ids = self.tokenizer.encode(request.prompt)
        if request.add_bos:
            ids = [self.meta.bos_id, *ids]
        ctx = self.info.context_length
        if len(ids) >= ctx:  # at least one row must stay free for the first generated token
            raise ContextOverflow(len(ids), ctx)
        return ids

    def start(self, request: GenerateRequest, cancel: threading.Event | None = None) -> Generation:
        """Validate a request and make its `Generation` (nothing runs yet)."""
        gen = self.profile.generation
        sampling = request.sampling or SamplingParams(
            temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p
        )
        sampling.validate(self.info.vocab_size)
        max_tokens = gen.max_tokens if request.max_tokens is None else request.max_tokens
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens = {max_tokens} must be at least 1")
        ids = self.encode_prompt(request)
        return Generation(
            self.loaded.runner,
            self._kv,
            self.tokenizer.stream(),
            ids,
            start_pos=0,
            max_tokens=max_tokens,
            sampler=Sampler(sampling),
            stop=request.stop,
            stop_ids=self._stop_ids,
            prefill_chunk=gen.prefill_chunk,
            cancel=cancel,
        )

    def generate(
        self, request: GenerateRequest, cancel: threading.Event | None = None
    ) -> Iterator[TokenEvent]:
        """Stream a request's events; closing the iterator cancels the request."""
        generation = self.start(request, cancel)
        with self._lock:
            try:
                while not generation.done:
                    yield from generation.step()
            finally:
                if not generation.done:
                    generation.cancel.set()
                    generation.step()
                log.info("request done: %s", generation.stats())

    def complete(self, request: GenerateRequest) -> Completion:
        """Run a request to the end and collect it."""
        events = tuple(self.generate(request))
        last = events[-1]
        assert last.finish_reason is not None and last.stats is not None  # generate's contract
        return Completion(
            text="".join(e.text for e in events),
            token_ids=tuple(t for e in events for t in e.token_ids),
            finish_reason=last.finish_reason,
            stats=last.stats,
            events=events,
        )

    def close(self) -> None:
        self.loaded.runner.close()
