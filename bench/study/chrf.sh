# shellcheck shell=bash disable=SC2154
# Sourced by the translation studies (distill.sh, translate.sh): chrF of a model's greedy
# translations of held-out pairs, needing $worker (isthmus-worker) set.
# chrf_json DIR LANGS LINES PREFIX GENERATE-FLAGS...: translates the first LINES pairs of
# DIR/heldout-L.jsonl for each L of the comma-separated LANGS with `isthmus-worker generate
# GENERATE-FLAGS --translate L` into PREFIX-L.jsonl, scores them with deploy/chrf.py
# (NLTK) and prints {"L": chrF, ...}.
chrf_json() {
  local dir=$1 langs=$2 lines=$3 prefix=$4 l sep="" json="{"
  local -a list
  shift 4
  local -a pids=()
  IFS=, read -r -a list <<< "$langs"
  # One language per core at a time; the scores once all are translated.
  for l in "${list[@]}"; do
    head -n "$lines" "$dir/heldout-$l.jsonl" > "$prefix-input-$l.jsonl"
    while [ "${#pids[@]}" -ge "$(getconf _NPROCESSORS_ONLN)" ]; do
      wait "${pids[0]}" || return 1
      pids=("${pids[@]:1}")
    done
    "$worker" generate "$@" --translate "$l" --tokens 160 \
      --input "$prefix-input-$l.jsonl" --output "$prefix-$l.jsonl" 2>/dev/null &
    pids+=($!)
  done
  for l in "${pids[@]}"; do wait "$l" || return 1; done
  for l in "${list[@]}"; do
    json+="$sep\"$l\": $(/usr/bin/python3 deploy/chrf.py --json "$prefix-$l.jsonl" |
      /usr/bin/python3 -c 'import json, sys; print(json.load(sys.stdin)["chrf"])')"
    sep=", "
  done
  echo "$json}"
}
