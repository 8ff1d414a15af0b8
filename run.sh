#!/usr/bin/env bash
# One host of a run: its environment, its place in the run, then `python main.py`.
#
#   ./run.sh [main.py flags...]                                       # one process
#   ./run.sh --coordinator HOST:PORT --num-processes N --process-id I [--] [main.py flags...]
#
# launcher.sh starts this on every host (inside tmux); by hand it works the same way,
# e.g. on two machines:
#   host A: ./run.sh --coordinator A:8476 --num-processes 2 --process-id 0 -- --preset tiny
#   host B: ./run.sh --coordinator A:8476 --num-processes 2 --process-id 1 -- --preset tiny
#
# Environment:
#   .env          secrets (WANDB_API_KEY=...), one KEY=value per line, read from
#                 $MESHFORMER_ENV_FILE or else the .env next to this script (git-ignored).
#                 Values are exported, never printed.
#   PYTHON        interpreter; default: the virtualenv made by setup_tpu.sh
#                 ($MESHFORMER_VENV, default ~/.venvs/meshformer) if it exists, else python3.
# The working directory is kept: relative paths in the flags (runs/, data_cache/)
# are relative to where this is started.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { echo "run.sh: error: $*" >&2; exit 2; }

coordinator="" num_processes=1 process_id=0
flags=()
while (($#)); do
  case $1 in
    --coordinator) coordinator=${2:?--coordinator needs HOST:PORT}; shift 2 ;;
    --num-processes) num_processes=${2:?--num-processes needs a number}; shift 2 ;;
    --process-id) process_id=${2:?--process-id needs a number}; shift 2 ;;
    --coordinator=*) coordinator=${1#*=}; shift ;;
    --num-processes=*) num_processes=${1#*=}; shift ;;
    --process-id=*) process_id=${1#*=}; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; flags+=("$@"); break ;;
    *) flags+=("$1"); shift ;;
  esac
done
[[ $num_processes =~ ^[0-9]+$ && $num_processes -ge 1 ]] || die "--num-processes must be a positive number, got '$num_processes'"
[[ $process_id =~ ^[0-9]+$ && $process_id -lt $num_processes ]] \
  || die "--process-id must be in 0..$((num_processes - 1)), got '$process_id'"
if ((num_processes > 1)); then
  [[ -n $coordinator ]] || die "--num-processes $num_processes needs --coordinator HOST:PORT (process 0's host)"
  flags=(--dist.coordinator "$coordinator" --dist.num_processes "$num_processes" --dist.process_id "$process_id" "${flags[@]}")
fi

# --- secrets from .env (KEY=value lines; nothing is executed, nothing printed) ----
load_env() {
  local file=$1 line key value n=0 names=()
  while IFS= read -r line || [[ -n $line ]]; do
    n=$((n + 1))
    line=${line%$'\r'}
    [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
    if [[ ! $line =~ ^[[:space:]]*(export[[:space:]]+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]]; then
      echo "run.sh: $file line $n is not KEY=value; skipped" >&2  # the line itself may hold a secret
      continue
    fi
    key=${BASH_REMATCH[2]} value=${BASH_REMATCH[3]}
    if [[ $value =~ ^\"(.*)\"$ || $value =~ ^\'(.*)\'$ ]]; then value=${BASH_REMATCH[1]}; fi
    export "$key=$value"
    names+=("$key")
  done <"$file"
  echo "run.sh: environment from $file: ${names[*]:-(nothing)}" >&2
}
env_file=${MESHFORMER_ENV_FILE:-$here/.env}
if [[ -f $env_file ]]; then load_env "$env_file"; fi

# --- interpreter -------------------------------------------------------------
venv=${MESHFORMER_VENV:-$HOME/.venvs/meshformer}
if [[ -n ${PYTHON:-} ]]; then python=$PYTHON
elif [[ -x $venv/bin/python ]]; then python=$venv/bin/python
elif command -v python3 >/dev/null; then python=python3
else die "no python: run setup_tpu.sh on this host, or set PYTHON"
fi

export PYTHONUNBUFFERED=1  # the log (tee'd by launcher.sh) keeps up with the run
echo "run.sh: $(hostname): process $process_id of $num_processes${coordinator:+, coordinator $coordinator}; $python $here/main.py ${flags[*]}" >&2
exec "$python" "$here/main.py" "${flags[@]}"
