#!/usr/bin/env bash
# The README's main job. For now: one site's shards driven by isthmusctl
# (deploy/demo-shard.sh); the two-site training demo replaces this when cross-site sync
# lands.
set -euo pipefail
exec "$(dirname "$0")/demo-shard.sh" "$@"
