# Shared checks for head.sh and join.sh (sourced, not run).

die() { echo "error: $*" >&2; exit 1; }

require_ray() {
  command -v ray >/dev/null 2>&1 || die "the 'ray' command is not on PATH: activate the venv where healsweep is installed (see metal/README.md, step 2)"
}

valid_ipv4() {
  local ip=$1 part
  [[ $ip =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] || return 1
  for part in "${BASH_REMATCH[@]:1}"; do (( part <= 255 )) || return 1; done
  [[ $ip != 127.* && $ip != 0.0.0.0 ]]
}

valid_port() { [[ $1 =~ ^[0-9]+$ ]] && (( $1 >= 1024 && $1 <= 65535 )); }

# The address other machines reach this one on: the first argument, else the Wi-Fi/Ethernet address.
lan_address() {
  local given=${1:-} found=""
  if [[ -n $given ]]; then
    valid_ipv4 "$given" || die "'$given' is not a LAN IPv4 address (loopback and 0.0.0.0 are refused: other Macs could not reach them)"
    echo "$given"; return
  fi
  if command -v ipconfig >/dev/null 2>&1; then
    found=$(ipconfig getifaddr en0 2>/dev/null || ipconfig getifaddr en1 2>/dev/null || true)
  elif command -v hostname >/dev/null 2>&1; then
    found=$(hostname -I 2>/dev/null | awk '{print $1}')
  fi
  valid_ipv4 "${found:-}" || die "could not find this machine's LAN address; pass it explicitly (e.g. 192.168.1.20)"
  echo "$found"
}

# Token auth on every node: RAY_AUTH_MODE=token and the same token everywhere.
require_token() {
  export RAY_AUTH_MODE=token
  if [[ -n ${RAY_AUTH_TOKEN:-} ]]; then return; fi
  if [[ -n ${RAY_AUTH_TOKEN_PATH:-} ]]; then
    [[ -s $RAY_AUTH_TOKEN_PATH ]] || die "RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH is missing or empty"
    return
  fi
  [[ -s $HOME/.ray/auth_token ]] || die "${1:-no Ray auth token found}"
}

# Multi-node Ray on macOS is opt-in, on every node, head included.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1
