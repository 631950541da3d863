"""`edge-agent keys generate` and `edge-agent update make|inspect`: the operator's tools for
signed model updates (docs/UPDATES.md).

Exit codes: 0 done; 1 `update inspect` found the bundle does not verify against
``--trusted-keys`` or its payload does not match the manifest; 2 usage errors, unreadable
or invalid inputs; 3 `update inspect`: the bundle is otherwise good but expired (or issued
more than a day in the future), so devices refuse it: re-sign it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from agent.base.errors import AgentError
from agent.cli.common import _fail, parse_duration
from agent.pb.edge_agent.ota.v1 import ota_pb2 as opb

EXIT_FAILED = 1
EXIT_EXPIRED = 3
DEFAULT_KEY_NAME = "update-signing"


# ----------------------------------------------------------------------------- keys


def cmd_keys_generate(args: argparse.Namespace) -> int:
    from agent.ota.artifact.keys import PRIVATE_SUFFIX, PUBLIC_SUFFIX, generate

    name = args.name
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        return _fail(f"--name {name!r}: use letters, digits, '.', '_' and '-'")
    out = Path(args.out_dir)
    try:
        out.mkdir(mode=0o700, parents=True, exist_ok=True)
        private, public = out / f"{name}{PRIVATE_SUFFIX}", out / f"{name}{PUBLIC_SUFFIX}"
        kid = generate(private, public, comment=name)
    except (AgentError, OSError) as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps({"key_id": kid, "private": str(private), "public": str(public)}))
    else:
        print(kid)
        print(
            f"wrote {private} (keep it secret, off the devices) and {public} "
            "(copy it to /etc/edge-agent/keys/ on the devices)",
            file=sys.stderr,
        )
    return 0


def add_keys_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``keys generate`` to the CLI's subparsers (sets `func`)."""
    top = subparsers.add_parser("keys", help="Ed25519 keys that sign model updates")
    sub = top.add_subparsers(dest="keys_command", required=True)
    p = sub.add_parser(
        "generate",
        help="a new key pair: NAME.key (private, 0600) and NAME.pub; prints the key id",
        description="Writes OUT_DIR/NAME.key (PEM PKCS#8, mode 0600) and OUT_DIR/NAME.pub "
        "(one line: 'ed25519 <base64> NAME'); never overwrites. Devices trust every *.pub in "
        "/etc/edge-agent/keys.",
    )
    p.add_argument("--out-dir", required=True, help="directory for the two files")
    p.add_argument(
        "--name", default=DEFAULT_KEY_NAME, help=f"file name stem (default: {DEFAULT_KEY_NAME})"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_keys_generate)


# ----------------------------------------------------------------------------- update


def _canary(args: argparse.Namespace, base_dir: Path, new_dir: Path) -> opb.Canary:
    """The manifest's canary, computed here by running the models in-process: with
    --canary-prompt, the new model's greedy tokens for it; by default the base model's greedy
    text and the bound on the new model's NLL over it (`canary.reference_canary`), which the
    new model must pass here too. The engine is built here, in the CLI: ota only gets models
    to check (docs/UPDATES.md, the canary)."""
    from agent.daemon.canary import engine_model
    from agent.engine.engine import Engine
    from agent.model.directory import load_model_dir
    from agent.ota import canary
    from agent.ota.artifact.bundle import BundleError, target_variant
    from agent.profile import resolve_profile
    from agent.profile.oneshot import one_shot_profile

    profile, _ = resolve_profile(args.canary_profile or getattr(args, "profile", None))
    profile = one_shot_profile(profile)  # never the daemon's /var/cache
    quant = target_variant(load_model_dir(new_dir), args.quantization).quantization
    if args.canary_prompt:
        engine = Engine.load(profile, new_dir, quantization=quant)
        try:
            n = args.canary_tokens or canary.DEFAULT_TOKENS
            tokens = canary.expected_tokens(engine_model(engine), args.canary_prompt, n)
        finally:
            engine.close()
        return opb.Canary(prompt=args.canary_prompt, expected_tokens=tokens)
    base = Engine.load(profile, base_dir, quantization=quant)
    try:
        made = canary.reference_canary(engine_model(base))
    finally:
        base.close()
    new = Engine.load(profile, new_dir, quantization=quant)
    try:
        problem = canary.check(engine_model(new), made)
    finally:
        new.close()
    if problem is not None:
        raise BundleError(
            f"{new_dir} fails the canary the devices would run: {problem}; "
            "--no-canary makes the bundle without one"
        )
    return made


def cmd_update_make(args: argparse.Namespace) -> int:
    from agent.ota.artifact.bundle import make_bundle
    from agent.ota.artifact.keys import load_private
    from agent.ota.inspection import describe, inspect

    try:
        expires_in = parse_duration(args.expires_in)
    except ValueError as exc:
        return _fail(f"--expires-in: {exc}")
    if args.version < 1:
        return _fail(f"--version {args.version}: versions start at 1")
    if args.canary_tokens is not None and not args.canary_prompt:
        return _fail("--canary-tokens needs --canary-prompt")
    if args.no_canary and args.canary_prompt:
        return _fail("--no-canary and --canary-prompt: choose one")
    if args.canary_tokens is not None and not 1 <= args.canary_tokens <= 64:
        return _fail(f"--canary-tokens {args.canary_tokens}: allowed 1..64")
    mender_opts = (args.mender_device_types, args.mender_artifact_name, args.mender_key)
    if args.mender is None and any(mender_opts):
        return _fail("--mender-device-type, --mender-artifact-name and --mender-key need --mender")
    if args.mender is not None and not args.mender_device_types:
        return _fail("--mender needs --mender-device-type (the devices' Mender device_type)")
    base_dir, new_dir, out = Path(args.base_dir), Path(args.new_dir), Path(args.output)
    try:
        keys = [load_private(Path(k)) for k in args.key]
        mender = _mender_options(args)  # checked before anything is written
        canary = None if args.no_canary else _canary(args, base_dir, new_dir)
        make_bundle(
            base_dir,
            new_dir,
            keys,
            out,
            version=args.version,
            update_id=args.update_id,
            expires_in_s=expires_in,
            payload_url=args.url or "",
            compatible_profiles=args.compatible_profiles,
            compatible_arch=args.arch,
            min_agent_version=args.min_agent_version or "",
            canary=canary,
            quantization=args.quantization,
        )
        doc = inspect(out)
        if mender is not None:
            _write_mender(args, out, doc, *mender)
    except (AgentError, OSError) as exc:
        return _fail(str(exc))
    print(json.dumps(doc, indent=2) if args.json else describe(doc))
    return 0


def _mender_options(args: argparse.Namespace) -> tuple[Any, Any] | None:
    """--mender's (spec, signing key), checked; the spec's name is settled once the bundle is
    made (its default names the model)."""
    if args.mender is None:
        return None
    from agent.ota.mender.artifact import ArtifactSpec, load_signing_key

    spec = ArtifactSpec(args.mender_artifact_name or "x", tuple(args.mender_device_types))
    key = load_signing_key(Path(args.mender_key)) if args.mender_key else None
    return spec, key


def _write_mender(
    args: argparse.Namespace, bundle: Path, doc: dict[str, Any], spec: Any, key: Any
) -> None:
    """The Mender Artifact carrying `bundle` (agent.ota.mender.artifact)."""
    import dataclasses

    from agent.ota.mender.artifact import write_artifact

    m = doc["manifest"]
    name = args.mender_artifact_name or f"{m['model_name']}-{m['version']}"
    meta = (("update_id", m["update_id"]), ("version", m["version"]))
    try:
        write_artifact(
            bundle, Path(args.mender), dataclasses.replace(spec, name=name, meta=meta), key
        )
    except BaseException:
        bundle.unlink(missing_ok=True)  # this command made it: nothing half-done stays
        raise


def cmd_update_inspect(args: argparse.Namespace) -> int:
    from agent.ota.artifact.keys import load_trusted
    from agent.ota.inspection import describe, inspect

    try:
        trusted = load_trusted(Path(args.trusted_keys)) if args.trusted_keys else None
        doc = inspect(Path(args.bundle), trusted)
    except (AgentError, OSError) as exc:
        return _fail(str(exc))
    print(json.dumps(doc, indent=2) if args.json else describe(doc))
    payload_ok = doc["payload"]["size_ok"] and doc["payload"]["sha256_ok"]
    if not payload_ok or doc["verified"] is False:
        return EXIT_FAILED
    return EXIT_EXPIRED if doc["expired"] or doc["not_yet_valid"] else 0


class _Renamed(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kw: object) -> None:
        parser.error(
            "--profile was renamed --compatible-profile (the device profiles that may install "
            "the update); --canary-profile names the profile the models run with here"
        )


def add_update_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``update make`` and ``update inspect`` to the CLI's subparsers (each sets `func`)."""
    top = subparsers.add_parser("update", help="make and inspect signed model update bundles")
    sub = top.add_subparsers(dest="update_command", required=True)

    p = sub.add_parser(
        "make",
        help="a bundle: the delta BASE_DIR -> NEW_DIR and a manifest signed with every --key",
    )
    p.add_argument("base_dir", metavar="BASE_DIR", help="the model directory devices have now")
    p.add_argument("new_dir", metavar="NEW_DIR", help="the model directory they should get")
    p.add_argument(
        "--key", action="append", required=True, help="private key file (repeat to co-sign)"
    )
    p.add_argument("-o", "--output", required=True, metavar="BUNDLE", help="bundle file")
    p.add_argument("--version", type=int, required=True, help="monotonic update version (>= 1)")
    p.add_argument("--expires-in", default="7d", help="validity, e.g. 12h, 7d, 2w (default: 7d)")
    p.add_argument("--url", help="where devices download the payload (default: over MQTT)")
    p.add_argument(
        "--compatible-profile",
        dest="compatible_profiles",
        action="append",
        default=[],
        metavar="PROFILE",
        help="a device profile that may install it (repeat; default: any)",
    )
    # `--profile` means "run with this profile" everywhere else; here it once meant the above
    p.add_argument("--profile", action=_Renamed, help=argparse.SUPPRESS)
    p.add_argument(
        "--arch", action="append", default=[], help="aarch64, x86_64, ... (repeat; default: any)"
    )
    p.add_argument("--min-agent-version", help="oldest agent version that may install it")
    p.add_argument("--quantization", help="the variant that will serve (default: int8)")
    p.add_argument("--update-id", help="unique id of this update (default: random)")
    p.add_argument(
        "--canary-prompt",
        help="instead of the default canary, expect the new model's first greedy tokens for "
        "this prompt (computed here by running NEW_DIR)",
    )
    p.add_argument(
        "--canary-tokens",
        type=int,
        metavar="N",
        help="with --canary-prompt: how many greedy tokens to expect (default: 4)",
    )
    p.add_argument(
        "--canary-profile",
        help="profile to run the models with here (default: the global --profile, else detect)",
    )
    p.add_argument(
        "--no-canary",
        action="store_true",
        help="no canary in the manifest (default: the base model's greedy text for a fixed "
        "seed, which the new model must predict about as well as the base model, checked here "
        "and on every device before it serves)",
    )
    p.add_argument(
        "--mender",
        metavar="ARTIFACT",
        help="also write a Mender Artifact (module-image, type edge-agent-model) carrying the "
        "bundle, for fleets that deploy with Mender (docs/UPDATES.md)",
    )
    p.add_argument(
        "--mender-device-type",
        dest="mender_device_types",
        action="append",
        default=[],
        metavar="TYPE",
        help="with --mender: a Mender device_type that may install it (repeat; at least one)",
    )
    p.add_argument(
        "--mender-artifact-name",
        metavar="NAME",
        help="with --mender: the artifact name (default: <model name>-<version>)",
    )
    p.add_argument(
        "--mender-key",
        metavar="PEM",
        help="with --mender: sign the artifact for Mender too (RSA or ECDSA P-256 private key)",
    )
    p.add_argument("--json", action="store_true", help="print the bundle as `inspect --json`")
    p.set_defaults(func=cmd_update_make)

    from agent.cli.update_local import add_local_parsers

    add_local_parsers(sub)
    p = sub.add_parser(
        "inspect",
        help="show a bundle's manifest, signatures and payload check",
        description="Exit 1 if the payload does not match the manifest, or with --trusted-keys "
        "if no trusted key validly signed it; exit 3 if it is otherwise good but expired (or "
        "issued more than a day in the future): devices would refuse it.",
    )
    p.add_argument("bundle", metavar="BUNDLE")
    p.add_argument("--trusted-keys", metavar="DIR", help="check the signatures against DIR/*.pub")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_update_inspect)
