#!/bin/bash
# benchmarks/mkvenv.sh NAME SRC [DIR]: a venv DIR/v-NAME (DIR defaults to /tmp/bt) with the wheel of the
# checkout (or unpacked tree) SRC installed and compiled, as pip installs it; its dependencies are this
# checkout's .venv. For timing an installed clusterctl (fanout.py --python / --compare-python).
set -euo pipefail
name=$1; src=$2; dir=${3:-/tmp/bt}
root=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$dir/whl-$name" "$dir/v-$name"
mkdir -p "$dir"
"$root/.venv/bin/pip" wheel -q --no-deps --no-build-isolation -w "$dir/whl-$name" "$src" >/dev/null 2>&1
"$root/.venv/bin/python" -m venv "$dir/v-$name"
site=$("$root/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mine=$("$dir/v-$name/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site" > "$mine/zz-deps.pth"
"$dir/v-$name/bin/pip" install -q --no-deps --no-index "$dir"/whl-"$name"/*.whl
cd / && "$dir/v-$name/bin/python" -m compileall -q "$mine/clusterctl" >/dev/null
