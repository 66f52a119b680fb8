#!/usr/bin/env bash
# Prepares this checkout's .venv on a node of deploy/cluster-local.yaml (its setup command).
#
#   deploy/node_setup.sh                # full pinned install: `make setup` (minutes)
#   deploy/node_setup.sh BASE_VENV      # reuse a venv that already holds osvl's dependencies (seconds)
#
# Reuse: a venv of the node's own python3 (same minor version as BASE_VENV's) whose site-packages
# gets a .pth naming this checkout first, then BASE_VENV's site-packages, so `import osvl` is this
# checkout and every dependency is the already-installed wheel; BASE_VENV's `ray` and `serve` entry points are
# copied with this venv's interpreter. Why not a symlink to BASE_VENV: its interpreter may live where the cluster's user
# cannot read (e.g. under another user's home), and its osvl is another checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
base="${1:-}"
if [ -z "$base" ]; then
  exec make setup
fi
py_ver=$("$base/bin/python" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null \
  || sed -n 's/^version *= *\([0-9]*\)\.\([0-9]*\).*/python\1.\2/p' "$base/pyvenv.cfg")
site="$base/lib/$py_ver/site-packages"
test -d "$site" || { echo "node_setup: no site-packages at $site" >&2; exit 1; }
rm -rf .venv
python3 -m venv --without-pip .venv
own=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
case "$own" in */"$py_ver"/*) ;; *) echo "node_setup: python3 here is not $py_ver (BASE_VENV's)" >&2; exit 1;; esac
printf '%s\n%s\n' "$PWD" "$site" > "$own/osvl-node.pth"
for tool in ray serve; do  # BASE_VENV's entry points, with this venv's interpreter
  sed "1s|.*|#!$PWD/.venv/bin/python|" "$base/bin/$tool" > ".venv/bin/$tool"
  chmod +x ".venv/bin/$tool"
done
.venv/bin/ray --version
