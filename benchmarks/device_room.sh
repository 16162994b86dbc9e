#!/usr/bin/env bash
# Make room for a device call. The device tool copies the working tree (tracked files) and the
# paths named in `carry`, and refuses more than 64 MiB in all; the GPU runs' raw files under
# benchmarks/results/ and the carried wheels (.whl, ~38 MiB) no longer fit together.
#
#   bash benchmarks/device_room.sh out .whl   # move the largest results folders out of the tree
#   ...device calls...
#   bash benchmarks/device_room.sh back       # put them back (before any commit)
#
# `out` moves whole folders of benchmarks/results/, the largest first, into
# $GPULENS_ROOM_HOLD (default ../hold-results beside the repository) until the tree plus the
# carried paths is at most $GPULENS_ROOM_BYTES bytes (their files' sizes; default 62000000),
# and lists them in moved.txt there. On 2026-11-28 the tool refused 65.8 MB of files so
# counted and took 62.9 MB. Never commit while folders are out: git sees them as deleted.
set -euo pipefail
cd "$(dirname "$0")/.."
HOLD="${GPULENS_ROOM_HOLD:-$(cd .. && pwd)/hold-results}"
LIMIT="${GPULENS_ROOM_BYTES:-62000000}"
mode="${1:-}"
shift || true

used() {  # bytes of the tree's tracked files that exist, plus the carried paths
    { git ls-files -z | xargs -0 -r du -sb 2>/dev/null || true
      for p in "$@"; do [ -e "$p" ] && du -sb "$p"; done; } | awk '{s += $1} END {print s + 0}'
}

case "$mode" in
out)
    mkdir -p "$HOLD"
    touch "$HOLD/moved.txt"
    now=$(used "$@")
    echo "tree and carried paths: ${now} bytes (limit ${LIMIT})"
    while [ "$now" -gt "$LIMIT" ]; do
        # awk reads all of sort's output: `head -1` could end the pipe early, and with pipefail
        # sort's SIGPIPE ended the script after the first folder.
        biggest=$(du -sb benchmarks/results/*/ 2>/dev/null | sort -rn | awk 'NR == 1' | cut -f2)
        [ -n "$biggest" ] || { echo "nothing left to move" >&2; exit 1; }
        name=$(basename "$biggest")
        mv "benchmarks/results/$name" "$HOLD/$name"
        echo "$name" >> "$HOLD/moved.txt"
        now=$(used "$@")
        echo "moved out $name: ${now} bytes"
    done
    ;;
back)
    [ -f "$HOLD/moved.txt" ] || { echo "nothing was moved out ($HOLD/moved.txt)"; exit 0; }
    while read -r name; do
        [ -n "$name" ] || continue
        if [ -e "benchmarks/results/$name" ]; then
            echo "benchmarks/results/$name exists; $HOLD/$name left where it is" >&2
            continue
        fi
        mv "$HOLD/$name" "benchmarks/results/$name"
        echo "back: $name"
    done < "$HOLD/moved.txt"
    rm "$HOLD/moved.txt"
    ;;
*)
    echo "usage: $0 out [CARRIED_PATH...] | back" >&2
    exit 2
    ;;
esac
