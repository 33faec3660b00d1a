#!/usr/bin/env bash
# Creates .venv in the repo root with Python 3.12 (jax >= 0.11 needs it) and installs the
# project with its test and examples extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  if command -v python3.12 >/dev/null && python3.12 -c '' 2>/dev/null; then
    command -v python3.12; return
  fi
  if command -v pyenv >/dev/null; then
    local p
    for p in "$(pyenv root)"/versions/3.12.*/bin/python3.12; do
      [ -x "$p" ] && { echo "$p"; return; }
    done
  fi
  return 1
}

if [ ! -x .venv/bin/python ]; then
  py=$(find_python) || {
    echo "setup_env.sh: no Python 3.12 found (tried python3.12 on PATH and pyenv's" \
         "versions/3.12.*); install one, e.g. 'pyenv install 3.12'" >&2
    exit 1
  }
  "$py" -m venv .venv
fi
# Editable install, so only a changed pyproject.toml needs a reinstall.
if [ ! .venv/.installed -nt pyproject.toml ]; then
  .venv/bin/python -m pip install -q -e '.[test,examples]'
  touch .venv/.installed
fi
