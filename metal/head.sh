#!/usr/bin/env bash
# Start the head of a healsweep Ray pool on this machine.
#   metal/head.sh [LAN_ADDRESS] [--port 6379] [--with-metal]
# --with-metal also offers this Mac's GPU to trials ({"metal": 1}); without it the head only
# schedules. The dashboard stays on 127.0.0.1; token auth is on (a token is generated on first use).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"

port=6379 with_metal=0 address=""
while (( $# )); do
  case $1 in
    --port) [[ $# -ge 2 ]] || die "--port needs a value"; port=$2; shift 2 ;;
    --with-metal) with_metal=1; shift ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [[ -z $address ]] || die "more than one address given"; address=$1; shift ;;
  esac
done
valid_port "$port" || die "port '$port' must be a number from 1024 to 65535"
require_ray
ip=$(lan_address "$address")

export RAY_AUTH_MODE=token
if [[ -z ${RAY_AUTH_TOKEN:-} && -z ${RAY_AUTH_TOKEN_PATH:-} && ! -s $HOME/.ray/auth_token ]]; then
  ray get-auth-token --generate >/dev/null
fi
require_token "could not create a Ray auth token"

resources='{}'
(( with_metal )) && resources='{"metal": 1}'
ray start --head --node-ip-address "$ip" --port "$port" \
  --dashboard-host 127.0.0.1 --include-dashboard true --resources "$resources"

cat <<MSG

Head is up at $ip:$port (dashboard on 127.0.0.1 only).
On each worker Mac: copy ~/.ray/auth_token from this machine to ~/.ray/auth_token there, then run
  metal/join.sh $ip:$port
Start sweeps from this machine with: healsweep sweep run SPEC --address $ip:$port
MSG
