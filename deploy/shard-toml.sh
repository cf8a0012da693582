# Sourced by deploy/two-site.sh and bench/wan/run.sh: the keys of a few sites and the config of
# one shard of one site, in the layout both scripts use (keys under KEYS: SITE-I.key,
# workers-SITE/, admins/, peers-I/; data in DIR/SITE-I).
#   shard_toml DIR KEYS SITE I WORKER_EP ADMIN_EP PEER_EP PEERS [SYNC_LINES]
# PEERS: the sync.peers entries, already quoted and comma-separated. SYNC_LINES: more keys
# of the [sync] section, one per line. Writes the TOML to standard output.
shard_toml() {
  local dir=$1 keys=$2 site=$3 i=$4 worker=$5 admin=$6 peer=$7 peers=$8 sync_lines=${9:-}
  cat <<TOML
[shard]
id = "$site-$i"
index = $i
data_dir = "$dir/$site-$i"
[listen]
worker = "$worker"
admin = "$admin"
peer = "$peer"
[security]
secret_key = "$keys/$site-$i.key"
worker_keys = ["$keys/workers-$site"]
admin_keys = ["$keys/admins"]
peer_keys = ["$keys/peers-$i"]
[sync]
site = "$site"
peers = [$peers]
$sync_lines
TOML
}

# The keys of that layout under KEYS: an admin key, one worker key per site, one key per
# shard, and each shard index's peer allowlist (peers-I/ holds every site's shard I key).
#   make_keys CTL KEYS SHARDS SITE...
make_keys() {
  local ctl=$1 keys=$2 shards=$3 s i
  shift 3
  mkdir -p "$keys/admins"
  "$ctl" keygen --out "$keys/admins/admin" >/dev/null
  for s in "$@"; do
    mkdir -p "$keys/workers-$s"
    "$ctl" keygen --out "$keys/workers-$s/worker" >/dev/null
    for ((i = 0; i < shards; i++)); do
      mkdir -p "$keys/peers-$i"
      "$ctl" keygen --out "$keys/$s-$i" >/dev/null
      cp "$keys/$s-$i.pub" "$keys/peers-$i/$s.pub"
    done
  done
}
