#!/usr/bin/env bash
# One peer's environment: analyses/peers/setup.sh NAME  ->  .venv-peers/NAME
# CPU torch 2.13.0 first (so no CUDA build is fetched), then analyses/peers/NAME/requirements.txt,
# then analyses/peers/NAME/requirements-no-deps.txt (if any) without dependencies. Never part of longprobe.
set -euo pipefail
name=${1:?usage: analyses/peers/setup.sh NAME (a folder of analyses/peers/)}
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
peer="$here/$name"
[ -f "$peer/requirements.txt" ] || { echo "no peer $name: $peer/requirements.txt is missing" >&2; exit 2; }
venv="$root/.venv-peers/$name"
test -x "$venv/bin/python" || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q -r "$peer/requirements.txt"
if [ -f "$peer/requirements-no-deps.txt" ]; then
    "$venv/bin/python" -m pip install -q --no-deps -r "$peer/requirements-no-deps.txt"
fi
"$venv/bin/python" -m pip freeze > "$venv/freeze.txt"
echo "$venv ready ($(wc -l < "$venv/freeze.txt") packages, list in $venv/freeze.txt)"
