#!/usr/bin/env bash
# Join this Mac to a healsweep Ray pool as a worker offering {"metal": 1}.
#   metal/join.sh HEAD_IP:PORT [LAN_ADDRESS] [--cpus N] [--block]
# --block keeps `ray start` in the foreground (what the launchd agent uses).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"

head="" address="" cpus="" block=()
while (( $# )); do
  case $1 in
    --cpus) [[ $# -ge 2 ]] || die "--cpus needs a value"; cpus=$2; shift 2 ;;
    --block) block=(--block); shift ;;
    -h|--help) sed -n '2,4p' "$0"; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) if [[ -z $head ]]; then head=$1; elif [[ -z $address ]]; then address=$1; else die "unexpected argument $1"; fi; shift ;;
  esac
done
[[ -n $head ]] || die "usage: metal/join.sh HEAD_IP:PORT [LAN_ADDRESS] (the head prints its address)"
[[ $head == *:* ]] || die "'$head' must be HEAD_IP:PORT, e.g. 192.168.1.20:6379"
valid_ipv4 "${head%%:*}" || die "'${head%%:*}' is not the head's LAN IPv4 address"
valid_port "${head##*:}" || die "port '${head##*:}' must be a number from 1024 to 65535"
if [[ -n $cpus ]]; then [[ $cpus =~ ^[1-9][0-9]*$ ]] || die "--cpus must be a positive integer"; fi
require_ray
require_token "no Ray auth token: copy ~/.ray/auth_token from the head machine to ~/.ray/auth_token here"
ip=$(lan_address "$address")

args=(--address "$head" --node-ip-address "$ip" --resources '{"metal": 1}' --dashboard-host 127.0.0.1)
[[ -n $cpus ]] && args+=(--num-cpus "$cpus")
exec ray start "${args[@]}" "${block[@]}"
