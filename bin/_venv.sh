# Sourced by bin/k3jax and bin/test: create or refresh .venv with Python 3.12
# (found on PATH, through pyenv, or in the usual places) and install k3jax
# into it, editable, with the extras asked for: `ensure_venv EXTRAS`.
# bin/k3jax asks for what its command line needs (`extras_for ARGS`, the
# table in k3jax/cli/extras.py: the core alone for run, plan, make-checkpoint
# ...), bin/test for every extra (ALL_EXTRAS).
# The stamp ($VENV/.k3jax-installed) holds pyproject.toml's hash and the
# extras installed; pip runs only when pyproject.toml changed or an extra is
# asked for that is not installed yet (then with those already installed
# too, so none is dropped).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.k3jax-installed"
ALL_EXTRAS="dev,gpu-compile,tokamax,torch,triton"
LEGACY_EXTRAS="$ALL_EXTRAS"   # a one-line stamp (pyproject's hash alone) was written after installing all

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

python312() {
  find_python312 || { echo "k3jax: Python 3.12 not found (set K3JAX_PYTHON)" >&2; exit 1; }
}

# The extras a `k3jax ARGS` command line needs, comma-separated (k3jax/cli/extras.py,
# run as a script: it imports only the standard library).
extras_for() {
  local py="$VENV/bin/python"
  [ -x "$py" ] || py="$(python312)"
  "$py" -I "$ROOT/k3jax/cli/extras.py" "$@"
}

# Comma-separated names, sorted, without repeats or empty names.
_extras_set() {
  printf '%s\n' "$@" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -
}

ensure_venv() {
  local want_hash installed="" stamp_hash="" want
  want_hash="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
  if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ]; then
    { IFS= read -r stamp_hash || true; IFS= read -r installed || installed="$LEGACY_EXTRAS"; } < "$STAMP"
  fi
  want="$(_extras_set "$installed" "${1:-}")"
  if [ -n "$stamp_hash" ] && [ "$stamp_hash" = "$want_hash" ] && [ "$want" = "$(_extras_set "$installed")" ]; then
    return 0
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    local py
    py="$(python312)"
    echo "k3jax: creating $VENV with $py" >&2
    "$py" -m venv "$VENV"
  fi
  local target="$ROOT"
  [ -z "$want" ] || target="$ROOT[$want]"
  echo "k3jax: installing k3jax${want:+[$want]} into $VENV (first run: a few minutes)" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$target" >&2
  printf '%s\n%s\n' "$want_hash" "$want" > "$STAMP"
}
