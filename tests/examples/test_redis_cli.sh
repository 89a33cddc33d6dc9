#!/usr/bin/env bash
# The score function from redis-cli alone (docs/protocol.md): check the library's api, the
# namespace's layout and the block key scheme it records, read its generation and bucket bits,
# and call FCALL_RO kvredis_score over the chain in parts of at most SCORE_KEYS_PER_CALL keys
# (env, default 4096), each part carrying the (pod, data-parallel rank)s still in, their scores
# so far and their stamps, and the protocol version last.
# Usage: test_redis_cli.sh HOST PORT NAMESPACE SCHEME WEIGHTS KEY_HEX...
#   SCHEME   the block key scheme the keys were computed with, "<algo>:<block size>:<seed>"
#            (e.g. "xxh3_64:16:"); a namespace recording another one is refused
#   WEIGHTS  "tier weight tier weight ..." (e.g. "cpu 0.8 gpu 1")
#   KEY_HEX  each block key as 16 hex digits, in chain order
# Prints one line per (pod, rank): "<pod> <rank> <score>", the score as the function last
# replied it (a pod's score is its best rank's).
set -euo pipefail
host=$1 port=$2 ns=$3 scheme=$4 weights=$5
shift 5
keys=("$@")
per_call=${SCORE_KEYS_PER_CALL:-4096}
cli() { redis-cli --no-auth-warning -h "$host" -p "$port" "$@"; }

version=$(cli --raw FCALL_RO kvredis_version 0)
api=$(sed -n 2p <<<"$version")
layout=$(sed -n 3p <<<"$version")
[ "$api" = 3 ] || { echo "library api $api, expected 3" >&2; exit 1; }

# HMGET replies one line per field (an absent scheme: an empty line)
mapfile -t meta < <(cli --raw HMGET "$ns:meta" layout bucket_bits gen scheme)
[ "${meta[0]}" = "$layout" ] || { echo "namespace layout differs" >&2; exit 1; }
bits=${meta[1]} gen=${meta[2]} recorded=${meta[3]:-}
if [ -n "$recorded" ] && [ "$recorded" != "$scheme" ]; then
    echo "namespace $ns holds block keys of scheme $recorded, these keys are of $scheme" >&2
    exit 1
fi

read -r -a pairs <<<"$weights"
nweights=$(( ${#pairs[@]} / 2 ))
declare -A scores=()
order=()
carried=(0)  # the (pod, rank)s still in the race after the earlier parts: rank, score, stamp
start=0
while (( start < ${#keys[@]} )); do
    part=("${keys[@]:start:per_call}")
    more=$(( start + ${#part[@]} < ${#keys[@]} ? 1 : 0 ))
    # The part: 8-byte big-endian keys, as one binary argument read from stdin (-X chain).
    escaped=$(printf '%s' "${part[@]}" | sed 's/../\\x&/g')
    mapfile -t reply < <(printf "$escaped" | cli --raw -X __chain__ FCALL_RO kvredis_score 4 \
        "$ns:meta" "$ns:pi" "$ns:pp" "$ns:sx" "$gen" "$ns:r:" "$bits" 0 \
        "$nweights" "${pairs[@]}" 1 __chain__ "$more" "${carried[@]}" kvredis-api:3)
    # Reply: walked, cut (1: the walk stopped at its work limit), then pod, rank, score,
    # still-in, stamp.
    [[ ${#reply[@]} -ge 2 && ${reply[0]} =~ ^[0-9]+$ ]] || { printf '%s\n' "${reply[@]}" >&2; exit 1; }
    walked=${reply[0]} cut=${reply[1]}
    live=()
    for (( i = 2; i + 4 < ${#reply[@]}; i += 5 )); do
        slot="${reply[i]} ${reply[i + 1]}"
        [[ -v "scores[$slot]" ]] || order+=("$slot")
        scores[$slot]=${reply[i + 2]}
        [ "${reply[i + 3]}" = 1 ] && live+=("${reply[i]}" "${reply[i + 1]}" "${reply[i + 2]}" "${reply[i + 4]}")
    done
    if (( ${#live[@]} == 0 || walked == 0 || (walked < ${#part[@]} && cut == 0) )); then
        break  # none left, or a key none holds
    fi
    start=$(( start + walked ))
    carried=($(( ${#live[@]} / 4 )) "${live[@]}")
done
for slot in "${order[@]}"; do
    printf '%s %s\n' "$slot" "${scores[$slot]}"
done
