"""The house rules of `agent/`, checked from the code's own imports (docs/ARCHITECTURE.md).

A *part* is a subpackage of `agent` (``agent.engine``), or one of the `NESTED` subpackages that
stand as parts of their own (``agent.api.grpc``). Every import between two parts must be in
`ALLOWED`: the flow is one way, model → runtime → engine → kv, with the APIs, the fleet link
and the updater as adapters around it, the operator's tools apart, and the daemon and the CLI
as the only places that wire parts together. Imports inside functions and under
``TYPE_CHECKING`` count: a lazy import is still an arrow. No two modules may import each other,
directly or around a circle. LiteRT is imported by the runtime (and the flatbuffer schema
reader) only, and wire types (our protobuf messages, gRPC, MQTT) stop at the adapters.

Run ``python tests/test_layering.py`` to print every violation.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

AGENT = Path(__file__).resolve().parent.parent / "agent"
GENERATED = ("pb",)  # protoc's output: not hand-written, not checked

ANYTHING = frozenset({"*"})

# subpackages that are parts of their own: the two APIs never import each other, and the
# device's fleet link stands apart from what the operator's tools share with it
NESTED = ("api.grpc", "api.http", "fleet.device")

# part → the parts (or single modules, "part.module") it may import. Keep it short: a new arrow
# is a design decision, and this table is where it is written down.
ALLOWED: Mapping[str, frozenset[str]] = {
    "agent": frozenset(),  # the package's __init__: __version__
    "base": frozenset({"agent"}),  # errors, files, TOML reads, where the shipped data is
    "pb": frozenset(),
    "_protogen": frozenset(),
    "models": frozenset(),
    "config": frozenset({"base"}),
    "tokenizer": frozenset({"base"}),
    "model": frozenset({"base", "tokenizer"}),  # a .litertlm's vocabulary check
    "profile": frozenset({"base", "model"}),
    "systemd": frozenset({"base", "profile"}),
    "runtime": frozenset({"base", "model", "profile"}),
    "kv": frozenset({"base"}),
    "constraint": frozenset({"base", "tokenizer"}),
    "chat": frozenset({"base", "constraint", "tokenizer"}),
    "engine": frozenset(
        {"base", "chat", "constraint", "kv", "model", "profile", "runtime", "tokenizer"}
    ),
    "status": frozenset({"base", "engine.types", "engine.stats"}),
    # protobuf messages more than one adapter sends
    "wire": frozenset({"base", "pb", "engine.types", "engine.stats", "status"}),
    "modelimport": frozenset({"base", "chat", "model", "tokenizer"}),
    "toolchain": frozenset({"agent", "model"}),
    # the updater: ota never imports the fleet link (the daemon hands it its transport)
    "ota": frozenset({"base", "config", "model", "pb"}),
    # the local APIs: what both share (identity, sockets, ports), then each on its own
    "api": frozenset({"base"}),
    "api.grpc": frozenset(
        {"api", "base", "chat", "config", "constraint", "engine", "pb", "status", "wire"}
    ),
    "api.http": frozenset({"api", "base", "chat", "config", "constraint", "engine", "status"}),
    # the fleet link: what device and operator share (topics, codec, the MQTT client) ...
    "fleet": frozenset({"base", "config", "pb"}),
    # ... and the device's side of it
    "fleet.device": frozenset(
        {"agent", "base", "config", "engine.stats", "engine.types", "fleet", "pb", "status"}
        | {"wire"}
    ),
    # the operator's tools: never imported by the daemon (FORBIDDEN), only by the CLI
    "operator": frozenset({"base", "config", "fleet", "ota.artifact", "pb"}),
    # the composition roots: the CLI may start the daemon, never the other way round (FORBIDDEN)
    "daemon": ANYTHING,
    "cli": ANYTHING,
    "__main__": ANYTHING,
    # the console script's entry: takes SIGINT over before anything heavy is imported
    "_entry": frozenset({"cli"}),
}

FORBIDDEN: Mapping[str, frozenset[str]] = {"daemon": frozenset({"cli", "operator"})}

LITERT = ("ai_edge_litert", "tflite_runtime")
# the runtime; LiteRT's own flatbuffer schema module (read lazily); the optional export extra
LITERT_IMPORTERS = ("runtime", "model.tflite.schema", "toolchain")
WIRE = ("agent.pb", "grpc", "paho")  # google.protobuf alone also reads file formats (.litertlm)
WIRE_IMPORTERS = (
    "api.grpc", "api.http", "fleet", "fleet.device", "operator", "ota", "wire", "daemon", "cli",
    "_protogen", "pb",
)  # fmt: skip

MAX_LINES = 450  # "no hand-written module over ~400 lines"
MAX_MODULES = 16  # a folder a newcomer can read by its names: more, and it hides a noun


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the imported module (or package), dotted
    line: int


def module_name(root: Path, path: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in GENERATED or "__pycache__" in rel or "_shim" in rel:
            continue
        found[module_name(root, path)] = path
    return found


def imports(name: str, path: Path, known: Mapping[str, Path]) -> Iterator[Import]:
    """Every import in the module, at any depth, resolved to the module it names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(name, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield Import(name, sub if sub in known else target, node.lineno)


def part(module: str) -> str:
    pieces = module.split(".")
    if len(pieces) > 2 and ".".join(pieces[1:3]) in NESTED:
        return ".".join(pieces[1:3])
    return pieces[1] if len(pieces) > 1 else pieces[0]


def allowed(source_part: str, target: str) -> bool:
    if part(target) in FORBIDDEN.get(source_part, frozenset()):
        return False
    rules = ALLOWED.get(source_part, frozenset())
    if rules is ANYTHING:
        return True
    inner = target.split(".", 1)[1] if "." in target else target
    nested = part(target) if part(target) in NESTED else None
    return any(
        (inner == rule or inner.startswith(rule + "."))
        # a rule naming a package does not reach into the parts nested in it
        and (nested is None or rule == nested or rule.startswith(nested + "."))
        for rule in rules
    ) or (target == "agent" and "agent" in rules)


def layering_violations(root: Path = AGENT) -> list[str]:
    known = modules(root)
    found = []
    for name, path in known.items():
        src = part(name)
        if src not in ALLOWED:
            found.append(f"{path}: part {src!r} is not in tests/test_layering.py's ALLOWED table")
            continue
        for imp in imports(name, path, known):
            if not (imp.target == root.name or imp.target.startswith(root.name + ".")):
                continue
            dst = part(imp.target)
            if dst != src and not allowed(src, imp.target):
                found.append(f"{path}:{imp.line}: {src} must not import {imp.target}")
    return found


def cycles(root: Path = AGENT) -> list[list[str]]:
    """Each import circle between modules, once (found by depth-first search)."""
    known = modules(root)
    graph = {
        name: sorted({i.target for i in imports(name, path, known) if i.target in known} - {name})
        for name, path in known.items()
    }
    # a package's __init__ is imported with each of its modules: an import of the package from
    # inside it is not a circle unless the __init__ imports back
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                circle = stack[stack.index(nxt) :]
                if frozenset(circle) not in seen:
                    seen.add(frozenset(circle))
                    found.append([*circle, nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name)
    return found


def foreign_importers(root: Path, prefixes: tuple[str, ...], parts: tuple[str, ...]) -> list[str]:
    known = modules(root)
    found = []
    for name, path in known.items():
        if part(name) in parts or any(name == f"{root.name}.{p}" for p in parts):
            continue
        for imp in imports(name, path, known):
            if any(imp.target == p or imp.target.startswith(p + ".") for p in prefixes):
                found.append(f"{path}:{imp.line}: {part(name)} imports {imp.target}")
    return found


def long_modules(root: Path = AGENT) -> list[str]:
    return [
        f"{path}: {n} lines (split it by noun: at most {MAX_LINES})"
        for path in modules(root).values()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    ]


def crowded_folders(root: Path = AGENT) -> list[str]:
    counts: dict[Path, int] = {}
    for path in modules(root).values():
        if path.name != "__init__.py":
            counts[path.parent] = counts.get(path.parent, 0) + 1
    return [
        f"{folder}: {n} modules (give a noun among them its own folder: at most {MAX_MODULES})"
        for folder, n in sorted(counts.items())
        if n > MAX_MODULES
    ]


def test_every_import_between_parts_is_allowed() -> None:
    assert layering_violations() == []


def test_no_import_cycles() -> None:
    assert cycles() == []


def test_only_the_runtime_imports_litert() -> None:
    assert foreign_importers(AGENT, LITERT, LITERT_IMPORTERS) == []


def test_wire_types_stop_at_the_adapters() -> None:
    assert foreign_importers(AGENT, WIRE, WIRE_IMPORTERS) == []


def test_no_hand_written_module_is_too_long() -> None:
    assert long_modules() == []


def test_no_folder_is_crowded() -> None:
    assert crowded_folders() == []


# The checker itself, on a small package written here: each rule must catch what it names.


def _package(tmp_path: Path, files: Mapping[str, str]) -> Path:
    root = tmp_path / "agent"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_the_checker_finds_an_arrow_against_the_flow(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "base/__init__.py": "",
            "base/errors.py": "",
            "kv/__init__.py": "",
            "kv/lru.py": "from agent.base.errors import AgentError\n",
            "engine/__init__.py": "",
            "engine/engine.py": "from ..kv import lru\n",
            # a lazy import of the engine by the KV tier: against the flow
            "kv/disk.py": "def f():\n    from agent.engine.engine import Engine\n",
            "ota/__init__.py": "",
            "ota/canary.py": "from agent.engine import engine\n",
            "cli/__init__.py": "from agent.daemon import run\n",
            "daemon/__init__.py": "from agent.cli import common\n",
            "cli/common.py": "",
        },
    )
    found = layering_violations(root)
    assert len(found) == 3, found
    assert any("daemon must not import agent.cli.common" in v for v in found)
    assert any("kv must not import agent.engine.engine" in v for v in found)
    assert any("ota must not import agent.engine.engine" in v for v in found)


def test_the_checker_keeps_nested_parts_apart(tmp_path: Path) -> None:
    """The two APIs share `api`'s own modules, never each other's; the daemon never imports the
    operator's tools."""
    root = _package(
        tmp_path,
        {
            "api/__init__.py": "",
            "api/identity.py": "",
            "api/grpc/__init__.py": "",
            "api/grpc/convert.py": "from agent.api.identity import key\n",
            "api/http/__init__.py": "",
            "api/http/openai.py": (
                "from agent.api.identity import key\nfrom agent.api.grpc import convert\n"
            ),
            "operator/__init__.py": "",
            "operator/view.py": "",
            "daemon/__init__.py": "from agent.operator import view\n",
        },
    )
    assert sorted(v.split(": ", 1)[1] for v in layering_violations(root)) == [
        "api.http must not import agent.api.grpc.convert",
        "daemon must not import agent.operator.view",
    ]


def test_the_checker_allows_single_modules_only_where_named(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/types.py": "",
            "engine/engine.py": "",
            "status/__init__.py": "",
            "status/value.py": (
                "from agent.engine.types import X\nfrom agent.engine.engine import E\n"
            ),
        },
    )
    assert [v.split(": ", 1)[1] for v in layering_violations(root)] == [
        "status must not import agent.engine.engine"
    ]


def test_the_checker_finds_a_lazy_cycle(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "model/__init__.py": "",
            "model/file.py": "def read():\n    from agent.model.parse import parse\n",
            "model/parse.py": "from agent.model.file import ModelFile\n",
            "model/other.py": "from agent.model import file\n",
        },
    )
    assert cycles(root) == [["agent.model.file", "agent.model.parse", "agent.model.file"]]


def test_the_checker_finds_litert_and_wire_types_out_of_place(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "runtime/__init__.py": "",
            "runtime/litert.py": "from ai_edge_litert import interpreter\n",
            "engine/__init__.py": "",
            "engine/engine.py": "import tflite_runtime.interpreter\nimport grpc\n",
        },
    )
    assert len(foreign_importers(root, LITERT, LITERT_IMPORTERS)) == 1
    assert len(foreign_importers(root, WIRE, WIRE_IMPORTERS)) == 1


def test_the_checker_finds_an_unknown_part_and_a_long_module(tmp_path: Path) -> None:
    root = _package(tmp_path, {"gadget.py": "x = 1\n" * (MAX_LINES + 1)})
    assert any("'gadget' is not in" in v for v in layering_violations(root))
    assert len(long_modules(root)) == 1
    crowd = {f"kv/m{i}.py": "" for i in range(MAX_MODULES + 1)}
    assert crowded_folders(_package(tmp_path / "crowded", {"kv/__init__.py": "", **crowd})) != []
    del crowd["kv/m0.py"]
    assert crowded_folders(_package(tmp_path / "fits", {"kv/__init__.py": "", **crowd})) == []


if __name__ == "__main__":
    problems = [
        *layering_violations(),
        *(" -> ".join(c) for c in cycles()),
        *foreign_importers(AGENT, LITERT, LITERT_IMPORTERS),
        *foreign_importers(AGENT, WIRE, WIRE_IMPORTERS),
        *long_modules(),
        *crowded_folders(),
    ]
    print("\n".join(problems) or "the layering holds")
    sys.exit(1 if problems else 0)
