"""The tflite-runtime backend (boards without an ai-edge-litert wheel, e.g. 32-bit Arm).

tflite-runtime 2.14 needs numpy<2, so it lives in its own venv (`.venv-legacy`, made by
`scripts/test`, which exports its interpreter as EDGE_AGENT_LEGACY_PYTHON); that venv has no
ai-edge-litert at all, so the flatbuffer schema comes from the `tflite` package there. These
tests run the real `edge-agent` in that venv and compare it token for token with
ai-edge-litert in this one.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.base.errors import ModelFormatError
from agent.engine.engine import Engine
from agent.engine.loading import estimate_memory
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest
from agent.profile import MIN_MAX_NUM_BYTES, parse_profile, profiles_dir
from agent.runtime import litert
from tests.support.tiny_models import TinyModelFactory

LEGACY_PYTHON = os.environ.get("EDGE_AGENT_LEGACY_PYTHON", "")
PROMPTS = ["def f(x):", "import os\n", "class A:"]


def legacy_profile(directory: Path) -> Path:
    """The dev profile on the legacy backend (composites off, no int4: what it can run)."""
    text = (profiles_dir() / "generic-x86_64.toml").read_text()
    text = re.sub(r'(?m)^backend = ".*"$', 'backend = "tflite-runtime"', text)
    text = re.sub(r"(?m)^require_fused = .*$", "require_fused = false", text)
    path = directory / "legacy-x86_64.toml"
    path.write_text(text.replace('name = "generic-x86_64"', 'name = "legacy-x86_64"'))
    return path


@pytest.fixture(scope="module")
def unfused_dir(tiny_model_factory) -> Path:
    return tiny_model_factory.model_dir(
        quantizations=("fp32", "int8_weight_only"), enable_hlfb=False
    )


def test_the_legacy_backend_refuses_what_it_cannot_run(tiny_model_factory, tmp_path) -> None:
    profile = parse_profile(_toml(legacy_profile(tmp_path)), tmp_path / "legacy-x86_64.toml")
    fused = tiny_model_factory(layout="transposed", prefill_lens=(8,), kv_max=64)
    with pytest.raises(ModelFormatError, match=r"STABLEHLO_COMPOSITE.*composites off"):
        litert.load(fused, profile)
    int4 = tiny_model_factory(
        layout="transposed", prefill_lens=(8,), kv_max=64, quantization="int4_block32"
    )
    with pytest.raises(ModelFormatError, match="int4 weights"):
        litert.load(int4, profile)
    hybrid = tiny_model_factory(
        layout="transposed", prefill_lens=(8,), kv_max=64, quantization="int8", enable_hlfb=False
    )
    with pytest.raises(ModelFormatError, match=r"dynamic-range int8.*FULLY_CONNECTED"):
        litert.load(hybrid, profile)
    # its prefill disagrees with its own decode on the default KV layout (measured)
    default = tiny_model_factory(layout="default", prefill_lens=(8,), kv_max=64, enable_hlfb=False)
    with pytest.raises(ModelFormatError, match=r"KV layout is 'default'"):
        litert.load(default, profile)


def _toml(path: Path) -> dict:  # type: ignore[type-arg]
    import tomllib

    return tomllib.loads(path.read_text())


def _legacy_generate(profile: Path, model: Path, quant: str, prompt: str) -> dict:  # type: ignore[type-arg]
    r = subprocess.run(
        [
            LEGACY_PYTHON,
            "-m",
            "agent",
            "--profile",
            str(profile),
            "generate",
            prompt,
            "--model",
            str(model),
            "--quantization",
            quant,
            "--temperature",
            "0",
            "--max-tokens",
            "12",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    doc: dict = json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[type-arg]
    return doc


@pytest.fixture(scope="module")
def legacy_python() -> str:
    if not LEGACY_PYTHON:
        pytest.skip("no legacy venv: scripts/test makes .venv-legacy and sets it")
    return LEGACY_PYTHON


def test_the_legacy_venv_has_tflite_runtime_and_no_ai_edge_litert(legacy_python) -> None:
    code = (
        "import importlib.util as u, numpy, tflite_runtime; "
        "print(numpy.__version__, tflite_runtime.__version__, "
        "u.find_spec('ai_edge_litert') is None)"
    )
    out = subprocess.run([legacy_python, "-c", code], capture_output=True, text=True, check=True)
    numpy_version, tflite_version, no_litert = out.stdout.split()
    assert numpy_version.startswith("1.") and tflite_version == "2.14.0" and no_litert == "True"


@pytest.mark.parametrize("quant", ["int8_weight_only", "fp32"])
def test_greedy_tokens_agree_with_ai_edge_litert(
    legacy_python, unfused_dir, dev_profile, tmp_path, quant
) -> None:
    profile = legacy_profile(tmp_path)
    engine = Engine.load(dev_profile, unfused_dir, quantization=quant)
    try:
        for prompt in PROMPTS:
            want = engine.complete(
                GenerateRequest(prompt, max_tokens=12, sampling=SamplingParams(0.0))
            )
            got = _legacy_generate(profile, unfused_dir, quant, prompt)
            assert got["tokens"] == list(want.token_ids), prompt
            assert got["stats"]["accelerator"] == "xnnpack"
    finally:
        engine.close()


# Two interleaved conversations and a fork, greedy; prints each turn's tokens as JSON.
SESSIONS = r"""
import json, re, sys, tomllib
from pathlib import Path
from agent.engine.engine import Engine, EngineLimits
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest
from agent.profile import parse_profile

profile_path, model, quant, state = sys.argv[1:5]
profile = parse_profile(tomllib.loads(Path(profile_path).read_text()), profile_path)
engine = Engine.load(profile, Path(model), quantization=quant, state_dir=Path(state),
                limits=EngineLimits(max_active=1))

def turn(sid, prompt):
    r = GenerateRequest(prompt, max_tokens=6, sampling=SamplingParams(0.0), session_id=sid)
    return list(engine.complete(r).token_ids)

a, b = engine.create_session(), engine.create_session()
out = [turn(a, "def f(x):"), turn(b, "import os\n"), turn(a, "\n    return"), turn(b, "\n")]
c = engine.fork_session(a)
out += [turn(c, "\n\nclass A:"), turn(a, "\n\nclass A:")]
print(json.dumps(out))
engine.close()
"""


def test_sessions_and_forks_agree_with_ai_edge_litert(legacy_python, unfused_dir, tmp_path) -> None:
    profile = legacy_profile(tmp_path)
    main_profile = tmp_path / "main" / "generic-x86_64.toml"
    main_profile.parent.mkdir()
    main_profile.write_text((profiles_dir() / "generic-x86_64.toml").read_text())
    runs = {}
    for name, python, prof in [
        ("legacy", legacy_python, profile),
        ("main", sys.executable, main_profile),
    ]:
        r = subprocess.run(
            [
                python,
                "-c",
                SESSIONS,
                str(prof),
                str(unfused_dir),
                "int8_weight_only",
                str(tmp_path / f"state-{name}"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        runs[name] = json.loads(r.stdout.strip().splitlines()[-1])
    assert runs["legacy"] == runs["main"]
    assert runs["main"][4] == runs["main"][5]  # the fork continues exactly as its parent


# The session tiers as tests/unit/engine/test_sessions.py drives them on the main backend, as a
# script run
# in either venv. Phase "spill": the host tier (spill, restore, continue) and the disk tier
# (spill, restore, continue, then a graceful stop saves the session). Phase "restart": a new
# process adopts the saved session and continues it. Prints what it saw as JSON.
TIERS = r"""
import json, sys, tomllib
from pathlib import Path
from agent.engine.engine import Engine, EngineLimits
from agent.engine.loading import estimate_memory
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest
from agent.base.errors import NotFound
from agent.profile import parse_profile

profile_path, model, quant, state, phase = sys.argv[1:6]
model, state = Path(model), Path(state)
data = tomllib.loads(Path(profile_path).read_text())
one = estimate_memory(parse_profile(data, profile_path), model, quant)
TURNS = ["def f(x):", "\n    return", "\n\nclass A:"]
MIB = 1 << 20

def engine(host=0, disk=0):
    # exactly one runtime KV cache fits beside the host tier: a second session pushes out
    data["runtime"]["max_num_bytes"] = one + host
    data["kv"].update(host_max_bytes=host, disk_max_bytes=disk, prefix_max_bytes=0)
    e = Engine.load(parse_profile(data, profile_path), model, quantization=quant,
               limits=EngineLimits(max_active=1, max_sessions=32), state_dir=state)
    assert e.memory.sessions == 1, e.memory
    return e

def turn(e, sid, prompt, n=6, owner=""):
    r = GenerateRequest(prompt, max_tokens=n, sampling=SamplingParams(0.0), session_id=sid,
                        owner=owner)
    return list(e.complete(r).token_ids)

def tier(e, sid):
    return next(s.tier for s in e.list_sessions() if s.id == sid)

def push_out(e):
    other = e.create_session()
    turn(e, other, "import os", 2)
    e.delete_session(other)

out = {}
if phase == "spill":
    e = engine(host=16 * MIB)
    ref = e.create_session()
    out["reference"] = [turn(e, ref, p) for p in TURNS]  # uninterrupted, never spilled
    e.delete_session(ref)
    fresh = e.create_session()
    out["without_history"] = turn(e, fresh, TURNS[1])
    e.delete_session(fresh)
    sid = e.create_session()
    h = {"turns": [turn(e, sid, TURNS[0])], "tiers": [tier(e, sid)]}
    push_out(e)
    st = e.tier_stats()
    h["tiers"].append(tier(e, sid))
    h["spilled"] = [st.host_sessions, st.host_bytes, st.host_budget, st.spills]
    h["turns"].append(turn(e, sid, TURNS[1]))
    h["tiers"].append(tier(e, sid))
    h["turns"].append(turn(e, sid, TURNS[2]))
    h["restores"] = e.tier_stats().restores_host
    out["host"] = h
    e.close()
    e = engine(disk=64 * MIB)
    sid = e.create_session(owner="app")
    d = {"id": sid, "turns": [turn(e, sid, TURNS[0], owner="app")]}
    push_out(e)
    d["tiers"] = [tier(e, sid)]
    d["files"] = sorted(p.name for p in (state / "sessions").glob("*.kv"))
    d["turns"].append(turn(e, sid, TURNS[1], owner="app"))
    d["tiers"].append(tier(e, sid))
    d["restores"] = e.tier_stats().restores_disk
    out["disk"] = d
    e.close()  # a graceful stop saves every session to disk
else:
    e = engine(disk=64 * MIB)
    out["sessions"] = [[s.id, s.tier, s.owner] for s in e.list_sessions()]
    sid = out["sessions"][0][0]
    try:
        turn(e, sid, TURNS[2], owner="someone else")
        out["stranger"] = "served"
    except NotFound:
        out["stranger"] = "not found"
    out["turn"] = turn(e, sid, TURNS[2], owner="app")
    out["restores"] = e.tier_stats().restores_disk
    e.close()
print(json.dumps(out))
"""

# A context long enough that one session's plan (weights, activations, one KV cache) is above
# the smallest budget a profile may set (16 MiB): the tiny model with kv_max 128 plans 1.5 MiB,
# so its budget could not hold exactly one cache. The file stays 0.6 MB.
TIERS_KV_MAX = 10240


@pytest.fixture(scope="module")
def long_context_dir(
    tiny_model_factory: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    d: Path = tiny_model_factory.model_dir(
        quantizations=("int8_weight_only",), enable_hlfb=False, kv_max=TIERS_KV_MAX
    )
    directory = tmp_path_factory.mktemp("profile")
    profile = parse_profile(_toml(legacy_profile(directory)), directory / "legacy-x86_64.toml")
    one = estimate_memory(profile, d, "int8_weight_only")
    assert one >= MIN_MAX_NUM_BYTES, f"raise TIERS_KV_MAX: one session plans {one} bytes"
    return d


def _tiers(python: str, profile: Path, model: Path, state: Path, phase: str) -> dict[str, Any]:
    r = subprocess.run(
        [python, "-c", TIERS, str(profile), str(model), "int8_weight_only", str(state), phase],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    doc: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return doc


@pytest.fixture(scope="module")
def tier_runs(
    legacy_python: str, long_context_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """Both phases on tflite-runtime (legacy venv) and on ai-edge-litert (this venv)."""
    root = tmp_path_factory.mktemp("tiers")
    main_profile = root / "generic-x86_64.toml"
    main_profile.write_text((profiles_dir() / "generic-x86_64.toml").read_text())
    runs = {}
    for name, python, profile in [
        ("legacy", legacy_python, legacy_profile(root)),
        ("main", sys.executable, main_profile),
    ]:
        state = root / f"state-{name}"
        runs[name] = {
            phase: _tiers(python, profile, long_context_dir, state, phase)
            for phase in ("spill", "restart")
        }
    return runs


def test_host_tier_spill_and_restore_continue_bit_for_bit(
    tier_runs: dict[str, dict[str, Any]],
) -> None:
    run = tier_runs["legacy"]["spill"]
    want, host = run["reference"], run["host"]
    # the history matters: a restore that lost or garbled it would not give the same tokens
    assert run["without_history"] != want[1]
    assert host["tiers"] == ["bound", "host", "bound"]
    sessions, used, budget, spills = host["spilled"]
    assert sessions == 1 and 0 < used <= budget and spills >= 1
    assert host["turns"] == want and host["restores"] == 1


def test_disk_tier_spill_restore_and_restart(tier_runs: dict[str, dict[str, Any]]) -> None:
    spill, restart = tier_runs["legacy"]["spill"], tier_runs["legacy"]["restart"]
    want, disk = spill["reference"], spill["disk"]
    assert disk["tiers"] == ["disk", "bound"] and disk["files"] == [f"{disk['id']}.kv"]
    assert disk["turns"] == want[:2] and disk["restores"] == 1
    # a new process adopts the saved session, for its owner only, and continues it
    assert restart["sessions"] == [[disk["id"], "disk", "app"]]
    assert restart["stranger"] == "not found"
    assert restart["turn"] == want[2] and restart["restores"] == 1


def test_tiers_agree_with_ai_edge_litert(tier_runs: dict[str, dict[str, Any]]) -> None:
    def comparable(run: dict[str, Any]) -> dict[str, Any]:
        """The run without its random session id."""
        run = copy.deepcopy(run)
        sid = run["spill"]["disk"].pop("id")
        assert run["spill"]["disk"].pop("files") == [f"{sid}.kv"]
        assert run["restart"]["sessions"][0].pop(0) == sid
        return run

    assert comparable(tier_runs["legacy"]) == comparable(tier_runs["main"])
