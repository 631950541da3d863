"""The tflite-runtime backend (boards without an ai-edge-litert wheel, e.g. 32-bit Arm).

tflite-runtime 2.14 needs numpy<2, so it lives in its own venv (`.venv-legacy`, made by
`scripts/test`, which exports its interpreter as EDGE_AGENT_LEGACY_PYTHON); that venv has no
ai-edge-litert at all, so the flatbuffer schema comes from the `tflite` package there. These
tests run the real `edge-agent` in that venv and compare it token for token with
ai-edge-litert in this one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from agent.engine.engine import Engine
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest
from agent.errors import ModelFormatError
from agent.profile import parse_profile, profiles_dir
from agent.runtime import litert

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
    engine = Engine(dev_profile, unfused_dir, quantization=quant)
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
engine = Engine(profile, Path(model), quantization=quant, state_dir=Path(state),
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
    import sys

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
