"""What a rollout targets and how it reaches it, over a real mosquitto against simulated
devices (tests/support/fleetsim.py): "already on target" means every file that defines the model, so
a metadata-only update (same weights, 1.0.0 -> 1.0.1) is offered and installed, not counted as
done; `resume ID` connects as `start` did with no flags; a target that matches nothing ends the
rollout instead of leaving it `running`; `--target` cannot swallow the bundle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from agent.model.directory import load_model_dir, write_model_dir_metadata
from agent.operator.rollout.run import create_rollout, load_rollout
from agent.operator.rollout.state import Target, to_json
from agent.ota.artifact.bundle import make_bundle
from tests.support.broker import Mosquitto
from tests.support.fleetsim import SimDevice, SimModels
from tests.unit.operator.test_rollout import broker, config, conn, edge_agent, models, opts, sim

__all__ = ["broker", "config", "models"]  # fixtures


def relabelled(models: SimModels, out: Path, version: str) -> Path:
    """The shipped model's very files under another version and stop list: a metadata fix."""
    shutil.copytree(models.shipped, out)
    meta = load_model_dir(out)
    write_model_dir_metadata(
        out,
        name=meta.name,
        version=version,
        context_length=meta.context_length,
        bos_id=meta.bos_id,
        eos_id=meta.eos_id,
        stop_token_ids=[*meta.stop_token_ids, 3],
        chat_template=meta.chat_template,
        variants=[(v.file, v.quantization) for v in meta.variants],
        tokenizer=meta.tokenizer,
    )
    return out


def test_a_metadata_only_update_is_offered_and_installed(
    broker: Mosquitto, models: SimModels, config: Path, tmp_path: Path
) -> None:
    fixed = relabelled(models, tmp_path / "fixed", "1.0.1")
    same = load_model_dir(models.shipped).variant("int8").sha256
    assert load_model_dir(fixed).variant("int8").sha256 == same  # the weights did not change
    bundle = tmp_path / "fix.tar"
    make_bundle(models.shipped, fixed, [models.key], bundle, version=1)
    ids = [f"dev-{i}" for i in range(4)]
    store = tmp_path / "rollouts"
    with sim(broker, models, tmp_path / "fleet", [SimDevice(d) for d in ids]) as fleet:
        done = edge_agent("fleet", "rollout", "start", str(bundle), "--target", "all",
                          "--waves", "50%,100%", "--soak", "0", "--json",
                          *conn(broker, config, store))  # fmt: skip
        assert done.returncode == 0, done.stderr
        rep = json.loads(done.stdout)
        assert rep["state"] == "completed", rep
        assert rep["already"] == 0 and rep["committed"] == len(ids), rep
        for d in ids:
            assert fleet.offers(d) == 1 and fleet.version(d) == "1.0.1", d
        inv = edge_agent("fleet", "inventory", "--json", "--broker", broker.url,
                         "--config", str(config))  # fmt: skip
        assert inv.returncode == 0, inv.stderr
        versions = {r["device"]: r["version"] for r in json.loads(inv.stdout)}
        assert all(versions[d] == "1.0.1" for d in ids), versions
        # and a second rollout of the same bundle finds every device done
        again = edge_agent("fleet", "rollout", "start", str(bundle), "--target", "all",
                           "--soak", "0", "--json", *conn(broker, config, store))  # fmt: skip
        assert again.returncode == 0, again.stderr
        rep = json.loads(again.stdout)
        assert rep["already"] == len(ids) and rep["offered"] == 0, rep
        assert all(fleet.offers(d) == 1 for d in ids)


def test_resume_connects_as_start_did_without_flags(
    broker: Mosquitto, models: SimModels, config: Path, tmp_path: Path
) -> None:
    bundle = models.bundle(tmp_path / "u1.tar", version=1)
    store = tmp_path / "rollouts"
    ids = ["a-1", "a-2"]
    create_rollout(store, bundle, Target("devices", devices=tuple(ids)), (1.0,),
                   prefix="fleet/v1", soak_s=0.0, rollout_id="r-kept",
                   connection=opts(broker).to_pairs())  # fmt: skip
    with sim(broker, models, tmp_path / "fleet", [SimDevice(d) for d in ids]) as fleet:
        # as docs/ROLLOUTS.md writes it: no --broker, and a config without a [fleet] broker
        done = edge_agent("fleet", "rollout", "resume", "r-kept", "--json",
                          "--config", str(config), "--rollouts-dir", str(store))  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["state"] == "completed"
        assert all(fleet.version(d) == "1.1.0" for d in ids)


def test_a_target_that_matches_nothing_ends_the_rollout(
    broker: Mosquitto, models: SimModels, config: Path, tmp_path: Path
) -> None:
    bundle = models.bundle(tmp_path / "u1.tar", version=1)
    store = tmp_path / "rollouts"
    with sim(broker, models, tmp_path / "fleet", [SimDevice("lab-1", group="lab")]):
        done = edge_agent("fleet", "rollout", "start", str(bundle), "--target", "group:nobody",
                          "--id", "r-none", *conn(broker, config, store))  # fmt: skip
    assert done.returncode == 1 and "matches --target group:nobody" in done.stderr
    assert "Traceback" not in done.stderr
    state = to_json(load_rollout(store, "r-none"))
    assert state["state"] == "aborted" and "nothing was offered" in state["reason"]
    assert state["spec"]["connection"]["broker"] == broker.url  # kept for resume
    listed = edge_agent("fleet", "rollout", "status", "--json", "--rollouts-dir", str(store))
    assert [(r["rollout_id"], r["state"]) for r in json.loads(listed.stdout)] == [
        ("r-none", "aborted")
    ]


def test_target_takes_one_value_and_cannot_swallow_the_bundle(
    broker: Mosquitto, models: SimModels, config: Path, tmp_path: Path
) -> None:
    bundle = models.bundle(tmp_path / "u1.tar", version=1)
    store = tmp_path / "rollouts"
    # the old usage, the bundle last: refused by the parser, nothing written
    bad = edge_agent("fleet", "rollout", "start", "--target", "a-1", "a-2", str(bundle),
                     *conn(broker, config, store))  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert not store.exists() or not any(store.iterdir())
    ids = ["a-1", "a-2", "a-3"]
    with sim(broker, models, tmp_path / "fleet", [SimDevice(d) for d in ids]) as fleet:
        done = edge_agent("fleet", "rollout", "start", str(bundle), "--target", "a-1,a-2",
                          "--target", "a-3", "--soak", "0", "--json",
                          *conn(broker, config, store))  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["committed"] == 3
        assert all(fleet.version(d) == "1.1.0" for d in ids)
