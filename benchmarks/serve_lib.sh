# What the serve benchmarks share, sourced by them (`source "$(dirname "$0")/serve_lib.sh"`): the infertrace
# command, a preset's model made once, and one server at a time, started in the background and stopped on exit.

if command -v infertrace >/dev/null; then it=(infertrace); else it=(python3 -c 'from infertrace.cli import main; main()'); fi
it() { "${it[@]}" "$@"; }
stamp() { echo "[$(date +%T)] $*"; }

# model_of PRESET DIR: the model directory of PRESET under DIR, made on first use
model_of() {
  [ -f "$2/$1/config.json" ] || it model init --preset "$1" --out "$2/$1" >/dev/null
  echo "$2/$1"
}

# wait_healthy PORT LOG [SECONDS]: until the server ($server) answers /health; its log's tail and exit 1 if it
# exits first or is not healthy in SECONDS (300)
wait_healthy() {
  local port=$1 log=$2 limit=${3:-300}
  for _ in $(seq $((limit * 2))); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    kill -0 "$server" 2>/dev/null || { echo "server exited:"; tail -20 "$log"; exit 1; }
    sleep 0.5
  done
  echo "server not healthy after $limit s"; tail -20 "$log"; exit 1
}

# stop_server: SIGTERM drains (up to 30 s); a server still there 60 s later gets SIGKILL
server=""
stop_server() {
  [ -n "$server" ] || return 0
  kill -TERM "$server" 2>/dev/null || { server=""; return 0; }
  for _ in $(seq 60); do kill -0 "$server" 2>/dev/null || { server=""; return 0; }; sleep 1; done
  kill -KILL "$server" 2>/dev/null; server=""
}
trap stop_server EXIT
