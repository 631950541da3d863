"""Where the tests find the checkout: its root, the test data, these helpers."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
TESTS = ROOT / "tests"
FIXTURES = TESTS / "fixtures"  # data files the tests read (boards, templates, schemas)
SUPPORT = TESTS / "support"  # harnesses, brokers, the fleet simulator, model builders
