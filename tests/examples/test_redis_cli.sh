#!/usr/bin/env bash
# The score function from redis-cli alone (docs/protocol.md): check the library's api and the
# namespace's layout, read its generation and bucket bits, and call FCALL_RO kvredis_score.
# Usage: test_redis_cli.sh HOST PORT NAMESPACE WEIGHTS KEY_HEX...
#   WEIGHTS  "tier weight tier weight ..." (e.g. "cpu 0.8 gpu 1")
#   KEY_HEX  each block key as 16 hex digits, in chain order
# Prints one line per pod: "<pod> <score>", the score as the function replied it.
set -euo pipefail
host=$1 port=$2 ns=$3 weights=$4
shift 4
cli() { redis-cli --no-auth-warning -h "$host" -p "$port" "$@"; }

version=$(cli --raw FCALL_RO kvredis_version 0)
api=$(sed -n 2p <<<"$version")
layout=$(sed -n 3p <<<"$version")
[ "$api" = 1 ] || { echo "library api $api, expected 1" >&2; exit 1; }

meta=$(cli --raw HMGET "$ns:meta" layout bucket_bits gen)
[ "$(sed -n 1p <<<"$meta")" = "$layout" ] || { echo "namespace layout differs" >&2; exit 1; }
bits=$(sed -n 2p <<<"$meta")
gen=$(sed -n 3p <<<"$meta")

read -r -a pairs <<<"$weights"
nweights=$(( ${#pairs[@]} / 2 ))
# The chain: 8-byte big-endian keys, as one binary argument read from stdin (-x).
escaped=$(printf '%s' "$@" | sed 's/../\\x&/g')
printf "$escaped" | cli --raw -x FCALL_RO kvredis_score 4 "$ns:meta" "$ns:pi" "$ns:pp" "$ns:sx" \
    "$gen" "$ns:r:" "$bits" 0 "$nweights" "${pairs[@]}" 1 | paste -d ' ' - -
