#!/bin/sh
# Build the peers' environment for `make bench`: Icechunk 2.x needs Python >= 3.12, which the
# project's venv may not be. The peers' venv gets the project venv's Zarr, NumPy, xarray and dask
# versions, so the layers above every engine are the same code and only the engines differ.
#
#   bench/peers-venv.sh VENV PROJECT_PYTHON
#
# The Python comes from $PEERS_PYTHON if set, else the oldest >= 3.12 found among python3.1N and
# python3 on PATH, then pyenv's installed versions: the closest to the project's own Python, so
# the interpreter differs as little as it can between zarrlake's worker and Icechunk's.
set -eu
venv=$1
project_python=$2

is_312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
    if [ -n "${PEERS_PYTHON:-}" ]; then
        is_312 "$PEERS_PYTHON" && { echo "$PEERS_PYTHON"; return 0; }
        echo "PEERS_PYTHON=$PEERS_PYTHON is not a Python >= 3.12" >&2
        return 1
    fi
    for name in python3.12 python3.13 python3.14 python3; do
        p=$(command -v "$name" 2>/dev/null) && is_312 "$p" && { echo "$p"; return 0; }
    done
    # pyenv: its shims only run the active version, so look at the installed ones directly.
    root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
    for p in $(ls -d "$root"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V); do
        is_312 "$p" && { echo "$p"; return 0; }
    done
    return 1
}

if ! python=$(find_python); then
    echo "make bench: no Python >= 3.12 found (Icechunk 2.x needs one). Install one (e.g." \
         "'pyenv install 3.12'), or point PEERS_PYTHON at it." >&2
    exit 1
fi
pins=$("$project_python" -c 'from importlib.metadata import version as v
print(*(p + "==" + v(p) for p in ("zarr", "numpy", "xarray", "dask", "distributed")))')
echo "peers: $python ($("$python" --version 2>&1)), $pins" >&2
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# shellcheck disable=SC2086  # $pins is several requirement words
"$venv/bin/python" -m pip install -q "icechunk>=2" boto3 $pins
