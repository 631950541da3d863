"""The quality probe: the same two figures on every model a device serves, so an update that
installs and commits cleanly but is worse still shows (docs/FLEET.md, Quality probe).

- the mean negative log-likelihood per token of a fixed text shipped with the agent
  (`probe.json` beside this module: English prose and Python, what the demo model knows);
- the canary agreement: the share of the base model's greedy answers to a few prompts that the
  model predicts greedily when teacher-forced on prompt + answer (one pass, no sampling). The
  answers are the greedy answers of the first model this device probed, kept in the state
  directory as their token ids and as text: a model on the same tokenizer (the sha256 of its
  file) is forced on the very ids, so the base model scores exactly 1.0; another tokenizer
  encodes the text again (text need not encode back to the ids a model generated).

`probe_id` names the text, the prompts and the model the answers came from: figures compare
only under the same id. Like the update canary, this module never imports the engine: it runs a
`canary.Model` of callables (the daemon's binding: agent.daemon.probe).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import IO, Any

import numpy as np

from agent.base.errors import AgentError
from agent.base.fsutil import atomic_write, make_dirs
from agent.ota.canary import Model, score

DATA_FILE = "probe.json"  # package data of agent.ota (pyproject's package-data)
ANSWERS_FILE = "answers-{set_id}.json"
RESULTS_FILE = "results.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")

Decode = Callable[[Sequence[int]], str]  # token ids -> text, as the engine's tokenizer decodes


class ProbeError(AgentError):
    """The probe cannot run: its data or its files in the state directory are not usable, or
    the model gave non-finite logits while answering a canary prompt."""


@dataclass(frozen=True, slots=True)
class ProbeSet:
    """The fixed part of the probe: the text, the canary prompts and how many greedy tokens
    the base model answers each with."""

    text: str
    prompts: tuple[str, ...]
    answer_tokens: int

    @property
    def set_id(self) -> str:
        """sha256 of the text, prompts and answer length (names the answers file)."""
        doc = {
            "text": self.text,
            "prompts": list(self.prompts),
            "answer_tokens": self.answer_tokens,
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Answers:
    """The base model's greedy answers to the prompts, as text and as its token ids, the model
    they came from and its tokenizer (the sha256 of the tokenizer's file)."""

    origin: str  # the sha256 of the model that answered
    texts: tuple[str, ...]
    tokenizer: str
    ids: tuple[tuple[int, ...], ...]

    def forced(self, tokenizer: str) -> tuple[tuple[int, ...] | None, ...]:
        """Each answer's ids for a model on `tokenizer`: the generated ids on the same one,
        None (encode the text) on another."""
        return tuple(self.ids) if tokenizer == self.tokenizer else (None,) * len(self.texts)


@dataclass(frozen=True, slots=True)
class Result:
    """One model's latest probe on this device (`runs`: probes of it under this probe id)."""

    probe_id: str
    nll_per_token: float  # inf when the model gave non-finite logits on the text
    nll_tokens: int
    canary_agreement: float
    canary_tokens: int
    measured_unix: float
    runs: int
    cpu_s: float


def probe_id(probe: ProbeSet, answers: Answers) -> str:
    """sha256 of the probe set: text, prompts and the answers' origin."""
    doc = {"set": probe.set_id, "answers_from": answers.origin}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def load_set(path: Path | None = None) -> ProbeSet:
    """The probe set shipped with the agent (or the one at `path`); ProbeError if malformed."""
    try:
        raw = (
            path.read_text(encoding="utf-8")
            if path is not None
            else resources.files("agent.ota").joinpath(DATA_FILE).read_text(encoding="utf-8")
        )
        doc = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise ProbeError(f"the probe set {path or DATA_FILE} cannot be read: {exc}") from exc
    text, prompts, n = doc.get("text"), doc.get("prompts"), doc.get("answer_tokens")
    if not (
        isinstance(text, str)
        and text
        and isinstance(prompts, list)
        and prompts
        and all(isinstance(p, str) and p for p in prompts)
        and isinstance(n, int)
        and 1 <= n <= 256
    ):
        raise ProbeError(
            f"the probe set {path or DATA_FILE} is malformed: it needs a non-empty text, a "
            "non-empty list of non-empty prompts and answer_tokens 1-256"
        )
    return ProbeSet(text, tuple(prompts), n)


# ----------------------------------------------------------------------------- measuring


def greedy_answer(
    model: Model, decode: Decode, stop_ids: frozenset[int], prompt: str, n: int, context: int
) -> tuple[str, tuple[int, ...]]:
    """Up to `n` greedy tokens after `prompt` (ending early at a stop id or the `context`
    length), as text and ids, run step by step on the model's runner (`model.steps`: a fresh
    KV)."""
    ids = list(model.encode(prompt))[: context - 1]
    n = min(n, context - len(ids))
    step = model.steps(len(ids) + n)
    for pos in range(len(ids) - 1):
        step(ids[pos], pos)
    token, pos, out = ids[-1], len(ids) - 1, []
    for _ in range(n):
        logits = np.asarray(step(token, pos))[: model.vocab_size]
        if not np.isfinite(logits).all():
            raise ProbeError(f"non-finite logits while answering the canary prompt {prompt!r}")
        token, pos = int(logits.argmax()), pos + 1
        if token in stop_ids:
            break
        out.append(token)
    return decode(ids + out)[len(decode(ids)) :], tuple(out)


def agreement(
    model: Model, prompt: str, answer: str, context: int, answer_ids: Sequence[int] | None = None
) -> tuple[int, int]:
    """(answer tokens predicted greedily, answer tokens) with the model teacher-forced on
    prompt + answer (at most `context` tokens): the prompt's ids and `answer_ids` when given
    (the same tokenizer as the answering model's), else prompt + answer encoded together, the
    answer being what follows the prompt's own ids."""
    head = list(model.encode(prompt))
    if answer_ids is not None:
        ids, start = (head + list(answer_ids))[:context], len(head)
    else:
        ids = list(model.encode(prompt + answer))[:context]
        pairs = enumerate(zip(head, ids, strict=False))
        start = next((i for i, (a, b) in pairs if a != b), len(head))
    start = max(1, min(start, len(ids)))
    if start >= len(ids):
        return 0, 0
    step = model.steps(len(ids))
    hits = 0
    for pos in range(len(ids) - 1):
        logits = np.asarray(step(ids[pos], pos))[: model.vocab_size]
        if pos + 1 >= start:
            hits += bool(np.isfinite(logits).all()) and int(logits.argmax()) == ids[pos + 1]
    return hits, len(ids) - start


@dataclass(frozen=True, slots=True)
class Figures:
    """What one probe measured (`Result` adds the id, the time and the count)."""

    nll_per_token: float
    nll_tokens: int
    agreed: int
    canary_tokens: int

    @property
    def canary_agreement(self) -> float:
        return self.agreed / self.canary_tokens if self.canary_tokens else 0.0


def text_nll(model: Model, text: str, context: int) -> tuple[float, int]:
    """(mean NLL per token, tokens scored) of `text`: every token after the first given the
    ones before it, in windows of at most `context` tokens (each on a fresh KV, overlapping by
    one token) when the model's context is shorter than the text."""
    ids = list(model.encode(text))
    if context < 2:
        raise ProbeError(f"a context of {context} tokens cannot score a text")
    total, start = 0.0, 0
    while start < len(ids) - 1:
        window = ids[start : start + context]
        total += score(model.steps(len(window)), window, model.vocab_size) * (len(window) - 1)
        start += len(window) - 1
    return total / (len(ids) - 1), len(ids) - 1


def measure(
    model: Model, probe: ProbeSet, answers: Answers, context: int, tokenizer: str
) -> Figures:
    """Both figures of `model` (each step on its runner directly: the caller decides when;
    `context`: the most tokens one pass may hold; `tokenizer`: the sha256 of its tokenizer)."""
    if len(answers.texts) != len(probe.prompts):
        raise ProbeError(f"{len(answers.texts)} answers for {len(probe.prompts)} prompts")
    nll, tokens = text_nll(model, probe.text, context)
    agreed = total = 0
    forced = answers.forced(tokenizer)
    for prompt, answer, ids in zip(probe.prompts, answers.texts, forced, strict=True):
        a, t = agreement(model, prompt, answer, context, ids)
        agreed, total = agreed + a, total + t
    return Figures(nll, tokens, agreed, total)


# ----------------------------------------------------------------------------- state


class ProbeStore:
    """The probe's files in `directory` (the state directory's probe/): the base answers by
    probe set, and the latest result of at most two models (the serving one and the one before
    it). Written atomically; a file that does not parse is an error, never replaced."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def answers(self, probe: ProbeSet) -> Answers | None:
        path = self.directory / ANSWERS_FILE.format(set_id=probe.set_id)
        doc = self._read(path)
        if doc is None:
            return None
        origin, texts = doc.get("origin"), doc.get("answers")
        tokenizer, ids = doc.get("tokenizer"), doc.get("ids")
        n = len(probe.prompts)
        if not (
            isinstance(origin, str)
            and _SHA256.fullmatch(origin)
            and isinstance(tokenizer, str)
            and _SHA256.fullmatch(tokenizer)
            and isinstance(texts, list)
            and len(texts) == n
            and all(isinstance(t, str) for t in texts)
            and isinstance(ids, list)
            and len(ids) == n
            and all(isinstance(a, list) and all(_token(i) for i in a) for a in ids)
        ):
            raise ProbeError(
                f"{path} is not a probe answers file (origin and tokenizer: sha256s; answers "
                f"and ids: one text and one list of token ids per prompt, {n}); remove it to "
                "take the serving model's answers"
            )
        return Answers(origin, tuple(texts), tokenizer, tuple(tuple(a) for a in ids))

    def save_answers(self, probe: ProbeSet, answers: Answers) -> None:
        doc = {
            "origin": answers.origin,
            "answers": list(answers.texts),
            "tokenizer": answers.tokenizer,
            "ids": [list(a) for a in answers.ids],
        }
        self._write(self.directory / ANSWERS_FILE.format(set_id=probe.set_id), doc)

    def results(self) -> dict[str, Result]:
        """Model sha256 -> its latest result."""
        path = self.directory / RESULTS_FILE
        doc = self._read(path)
        if doc is None:
            return {}
        try:
            return {sha: _result(fields) for sha, fields in doc.items()}
        except (TypeError, ValueError) as exc:
            raise ProbeError(f"{path} is not a probe results file ({exc}); remove it") from exc

    def record(self, sha256: str, figures: Figures, pid: str, now: float, cpu_s: float) -> Result:
        """Store `sha256`'s new result (runs counted on from its last under the same id),
        keeping only the most recently measured other model beside it."""
        results = self.results()
        last = results.get(sha256)
        runs = last.runs + 1 if last is not None and last.probe_id == pid else 1
        new = Result(
            pid,
            figures.nll_per_token,
            figures.nll_tokens,
            figures.canary_agreement,
            figures.canary_tokens,
            now,
            runs,
            cpu_s,
        )
        others = sorted(
            ((r.measured_unix, sha) for sha, r in results.items() if sha != sha256), reverse=True
        )
        kept = {sha: results[sha] for _, sha in others[:1]}
        kept[sha256] = new
        self._write(self.directory / RESULTS_FILE, {s: asdict(r) for s, r in kept.items()})
        return new

    def _read(self, path: Path) -> dict[str, Any] | None:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ProbeError(f"{path} cannot be read ({exc}); remove it") from exc
        if not isinstance(doc, dict):
            raise ProbeError(f"{path} is not a JSON object; remove it")
        return doc

    def _write(self, path: Path, doc: dict[str, Any]) -> None:
        make_dirs(self.directory, 0o700)
        data = json.dumps(doc, indent=1, sort_keys=True).encode()

        def write(f: IO[bytes]) -> None:
            f.write(data)

        atomic_write(path, write)


def _token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _result(fields: Any) -> Result:
    if not isinstance(fields, dict):
        raise TypeError("a result is an object")
    r = Result(**fields)
    numbers = (r.nll_per_token, r.canary_agreement, r.measured_unix, r.cpu_s)
    if not isinstance(r.probe_id, str) or not all(isinstance(x, int | float) for x in numbers):
        raise ValueError("a result's fields have the wrong types")
    if math.isnan(r.nll_per_token) or not 0.0 <= r.canary_agreement <= 1.0:
        raise ValueError("a result's figures are out of range")
    return replace(r, nll_tokens=int(r.nll_tokens), canary_tokens=int(r.canary_tokens))
