# Sourced by bin/k3jax and bin/test: create or refresh .venv with Python 3.12.
# Finds Python 3.12 on PATH, through pyenv, or in the usual places; reinstalls
# only when pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.k3jax-installed"
EXTRAS="torch,dev,gpu-compile,triton,tokamax"

find_python312() {
  local c
  for c in "${K3JAX_PYTHON:-}" python3.12 python3 python; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  local roots=()
  command -v pyenv >/dev/null 2>&1 && roots+=("$(pyenv root)")
  roots+=("${PYENV_ROOT:-$HOME/.pyenv}" /root/.pyenv /opt/pyenv)
  for r in "${roots[@]}"; do
    for c in $(ls -d "$r"/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V -r); do
      if "$c" -c 'import sys' 2>/dev/null; then echo "$c"; return 0; fi
    done
  done
  for c in /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}

ensure_venv() {
  local want
  want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
  if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    return 0
  fi
  local py
  py="$(find_python312)" || { echo "k3jax: Python 3.12 not found (set K3JAX_PYTHON)" >&2; exit 1; }
  if [ ! -x "$VENV/bin/python" ]; then
    echo "k3jax: creating $VENV with $py" >&2
    "$py" -m venv "$VENV"
  fi
  echo "k3jax: installing k3jax[$EXTRAS] into $VENV (first run: a few minutes)" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[$EXTRAS]" >&2
  echo "$want" > "$STAMP"
}

ensure_venv
