# Shared by scripts/run and scripts/test: find Python >= 3.11 and make the project's venv.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${EDGE_AGENT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
  echo "edge-agent needs Python >= 3.11 (found: $("$PY" --version 2>&1))" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  "$PY" -m venv "$VENV"
fi
pip_install() {
  local log
  log="$(mktemp)"
  if ! "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" >"$log" 2>&1; then
    grep -v -e "^WARNING: Location" "$log" >&2 || true
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}
