# Sourced by deploy/two-site.sh and bench/wan/run.sh: the config of one shard of one site,
# in the layout both scripts use (keys under KEYS: SITE-I.key, workers-SITE/, admins/,
# peers-I/; data in DIR/SITE-I).
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
