#!/usr/bin/env bash
# Start run.sh on every host of a run, headless: one detached tmux session per host,
# so that a dropped ssh connection does not stop training.
#
#   ./launcher.sh --hosts hosts.txt [--name RUN] [options] [-- main.py flags...]
#   ./launcher.sh --tpu NAME --zone ZONE [--project P] [--name RUN] [-- main.py flags...]
#   ./launcher.sh ... --watch [--max-restarts N] [-- main.py flags...]
#                                     start RUN and stay in the foreground: poll every host and,
#                                     when a process ends other than by finishing (preempted, exit
#                                     75; crashed; its host no longer answers), stop the others,
#                                     wait for the hosts and start every one again: the run resumes
#                                     from its latest complete checkpoint. Up to N restarts (3)
#   ./launcher.sh ... --status        which hosts are running RUN
#   ./launcher.sh ... --stop          end RUN's tmux sessions (the processes with them)
#   ./launcher.sh ... --setup         run setup_tpu.sh on every host (in the foreground)
#   ./launcher.sh ... --ray-start [-- ray start flags...]
#                                     a Ray cluster for data/tokenize.py --ray: the head on the
#                                     first host, a node on every other (tmux sessions RUN-ray-pI);
#                                     prints the address to pass to --ray
#   ./launcher.sh ... --ray-status | --ray-stop
#
# Hosts: a file with one host per line, "SSH_TARGET [ADDRESS [SLICE]]" ('#' starts a
# comment): line i runs process i and the first line is the coordinator; ADDRESS is how
# the other hosts reach that host (default: SSH_TARGET without "user@"). With --tpu the
# hosts are the TPU VM's workers, in worker order (gcloud compute tpus tpu-vm describe),
# reached by their external IPs (internal ones with --internal-ips).
# Multi-slice (TPU slices joined over the data-center network): --tpu A,B,... names one
# TPU per slice, or the hosts file's SLICE column numbers each host's slice (0, 1, ...,
# hosts of a slice on consecutive lines). Every host then gets the megascale runtime's
# environment: MEGASCALE_COORDINATOR_ADDRESS (the first host of slice 0),
# MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID, MEGASCALE_PORT (8081), and main.py gets
# --mesh.slices N unless the flags set it.
#
# On every host, under --remote-dir (default "meshformer" in the home directory):
#   code/<commit>/      this repo at the launcher's HEAD (git archive; uncommitted changes
#                       are not sent), unpacked once and never modified afterwards
#   logs/RUN-pI.log     the output of process I; logs/RUN-pI.status: running | exit N | stopped
#   .env                a copy of the local .env (secrets for run.sh), if there is one
# Runs start in that directory, so relative paths (runs/, data_cache/) live there.
# Attach to a host's session: ssh HOST -t tmux attach -t RUN-pI
#
# Options:
#   --name RUN            run name: tmux sessions RUN-p0, RUN-p1, ... and --run.name RUN
#                         (default: the --run.name among the flags, else "meshformer")
#   --port P              coordinator port on the first host (default 8476)
#   --ray-port P          the Ray head's port on the first host (default 6379)
#   --remote-dir DIR      see above (relative to the remote home unless absolute)
#   --python PATH         interpreter on the hosts (default: run.sh chooses)
#   --ssh-user U, --ssh-port P, --ssh-key FILE, --ssh-option OPT (repeatable, "-o OPT")
#                         defaults from $LAUNCHER_SSH_USER, $LAUNCHER_SSH_PORT, $LAUNCHER_SSH_KEY
#   --connect-timeout S   give up on a host after S seconds (default 10)
#   --poll S              --watch: seconds between polls of the hosts (default 30)
#   --wait-hosts S        --watch: how long to wait for the hosts (or the TPU) to be back (default 1800)
#   --recreate            --watch --tpu: delete and create again a TPU found PREEMPTED or
#                         TERMINATED (same type, runtime and spot/preemptible), then --setup it;
#                         without it the launcher waits for the TPU to be READY again
# Exits non-zero, naming the host, when a host cannot be reached; then nothing is started.
set -euo pipefail

LAUNCHER_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DEFAULT_PORT=8476  # the port JAX itself uses for TPU pods
DEFAULT_RAY_PORT=6379  # Ray's own default
RAY_HEAD_WAIT_S=60     # how long the other nodes (and the launcher) wait for the head to listen

die() { echo "launcher: error: $*" >&2; exit 2; }
say() { echo "launcher: $*" >&2; }

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

# ----------------------------------------------------------------------------
# Options shared with debug_tpu.sh (which sources this file)

hosts_file="" tpu="" zone="" project="" internal_ips=0
name="" port=$DEFAULT_PORT ray_port=$DEFAULT_RAY_PORT remote_dir=meshformer python=""
ssh_user=${LAUNCHER_SSH_USER:-} ssh_port=${LAUNCHER_SSH_PORT:-} ssh_key=${LAUNCHER_SSH_KEY:-}
ssh_options=() connect_timeout=10
action=start
watch=0 max_restarts="" poll_s=30 wait_hosts_s=1800 recreate=0 restart_reason=""
DEFAULT_MAX_RESTARTS=3
PREEMPTED_EXIT_CODE=75  # main.py's "preempted, resume me" (runtime/preemption.py)
flags=()

# parse_option "$@": consumes one option; sets `shifted` to how many words it used (0 = not ours).
parse_option() {
  shifted=2
  case $1 in
    --hosts) hosts_file=${2:?--hosts needs a file} ;;
    --tpu) tpu=${2:?--tpu needs a TPU name} ;;
    --zone) zone=${2:?--zone needs a zone} ;;
    --project) project=${2:?--project needs a project} ;;
    --name) name=${2:?--name needs a run name} ;;
    --port) port=${2:?--port needs a number} ;;
    --remote-dir) remote_dir=${2:?--remote-dir needs a directory} ;;
    --python) python=${2:?--python needs a path} ;;
    --ssh-user) ssh_user=${2:?--ssh-user needs a user} ;;
    --ssh-port) ssh_port=${2:?--ssh-port needs a port} ;;
    --ssh-key) ssh_key=${2:?--ssh-key needs a file} ;;
    --ssh-option) ssh_options+=(-o "${2:?--ssh-option needs OPTION=VALUE}") ;;
    --connect-timeout) connect_timeout=${2:?--connect-timeout needs seconds} ;;
    --internal-ips) internal_ips=1; shifted=1 ;;
    *) shifted=0 ;;
  esac
}

check_options() {
  [[ -n $hosts_file || -n $tpu ]] || die "say where to run: --hosts FILE or --tpu NAME --zone ZONE (see --help)"
  [[ -z $hosts_file || -z $tpu ]] || die "give --hosts or --tpu, not both"
  [[ -z $tpu || -n $zone ]] || die "--tpu $tpu needs --zone"
  [[ $port =~ ^[0-9]+$ ]] || die "--port must be a number, got '$port'"
  [[ $ray_port =~ ^[0-9]+$ ]] || die "--ray-port must be a number, got '$ray_port'"
  [[ $connect_timeout =~ ^[0-9]+$ ]] || die "--connect-timeout must be a number of seconds, got '$connect_timeout'"
  local value
  for value in "${max_restarts:-0}" "$poll_s" "$wait_hosts_s"; do
    [[ $value =~ ^[0-9]+$ ]] || die "--max-restarts, --poll and --wait-hosts take a whole number, got '$value'"
  done
  [[ -z $max_restarts ]] || ((watch)) || die "--max-restarts needs --watch"
  ((!recreate)) || [[ -n $tpu && $watch == 1 ]] || die "--recreate needs --watch and --tpu"
  ((!watch)) || [[ $action == start ]] || die "--watch starts a run: it does not go with --$action"
  max_restarts=${max_restarts:-$DEFAULT_MAX_RESTARTS}
  [[ $remote_dir =~ ^[A-Za-z0-9_./-]+$ ]] || die "--remote-dir may only hold letters, digits and _ . / - (got '$remote_dir')"
  if [[ -z $name ]]; then
    local i
    for ((i = 0; i < ${#flags[@]}; i++)); do
      case ${flags[i]} in
        --run.name=*) name=${flags[i]#*=} ;;
        --run.name) name=${flags[i + 1]:-} ;;
      esac
    done
    name=${name:-meshformer}
  elif [[ $action != ray-* ]] && ! printf '%s\n' "${flags[@]}" | grep -q '^--run\.name'; then
    flags+=(--run.name "$name")
  fi
  [[ $name =~ ^[A-Za-z0-9_-]+$ ]] || die "the run name may only hold letters, digits, _ and - (got '$name'): it names tmux sessions"
  if [[ -n $tpu && -z $ssh_key && -f $HOME/.ssh/google_compute_engine ]]; then
    ssh_key=$HOME/.ssh/google_compute_engine  # the key `gcloud compute tpus tpu-vm ssh` installs
  fi
}

# ----------------------------------------------------------------------------
# Hosts: ssh_targets[i] is how to ssh to process i's host, addresses[i] how peers reach it

ssh_targets=() addresses=() host_slices=()  # host_slices[i]: process i's TPU slice (multi-slice)
MEGASCALE_PORT=8081  # the megascale runtime's port on slice 0's first host (Ray's and GKE's default)

resolve_hosts() {
  local line target address slice rest
  if [[ -n $hosts_file ]]; then
    [[ -f $hosts_file ]] || die "no hosts file $hosts_file"
    while IFS= read -r line || [[ -n $line ]]; do
      line=${line%%#*}
      read -r target address slice rest <<<"$line" || true
      [[ -n $target ]] || continue
      [[ -z $rest ]] || die "$hosts_file: '$line': expected 'SSH_TARGET [ADDRESS [SLICE]]'"
      ssh_targets+=("$target")
      addresses+=("${address:-${target#*@}}")
      host_slices+=("${slice:-0}")
    done <"$hosts_file"
    ((${#ssh_targets[@]})) || die "$hosts_file lists no hosts"
  else
    command -v gcloud >/dev/null || die "--tpu needs the gcloud CLI (or list the hosts in a file for --hosts)"
    local name k=0 names
    IFS=, read -r -a names <<<"$tpu"
    for name in "${names[@]}"; do  # one TPU per slice, its workers in order
      resolve_tpu_workers "$name" "$k"
      k=$((k + 1))
    done
    ssh_user=${ssh_user:-$(id -un)}  # gcloud's default user for TPU VMs
  fi
  check_slices
}

# resolve_tpu_workers NAME SLICE: append TPU NAME's workers to the hosts.
resolve_tpu_workers() {
  local name=$1 k=$2 internal external found=() reach=()
  local describe=(gcloud compute tpus tpu-vm describe "$name" --zone "$zone")
  [[ -z $project ]] || describe+=(--project "$project")
  internal=$("${describe[@]}" --format='value(networkEndpoints[].ipAddress)') \
    || die "could not describe TPU $name in zone $zone (is the name right, and gcloud logged in?)"
  external=$("${describe[@]}" --format='value(networkEndpoints[].accessConfig.externalIp)' 2>/dev/null || true)
  # gcloud separates list values with ';' (or ',' in some versions)
  read -r -a found <<<"${internal//[;,]/ }"
  if ((internal_ips)) || [[ -z ${external//[;,[:space:]]/} ]]; then
    reach=("${found[@]}")
  else
    read -r -a reach <<<"${external//[;,]/ }"
  fi
  ((${#found[@]})) || die "TPU $name has no network endpoints (is it READY?)"
  ((${#reach[@]} == ${#found[@]})) || die "TPU $name: some workers have no external IP; use --internal-ips from inside its network"
  addresses+=("${found[@]}") ssh_targets+=("${reach[@]}")
  local _
  for _ in "${found[@]}"; do host_slices+=("$k"); done
}

# Slices are numbered 0, 1, ... in host order (JAX numbers processes slice by slice).
n_slices=1
check_slices() {
  local i expected=0
  for i in "${!host_slices[@]}"; do
    [[ ${host_slices[i]} =~ ^[0-9]+$ ]] || die "host ${ssh_targets[i]}: slice '${host_slices[i]}' is not a number"
    if ((host_slices[i] == expected + 1)); then
      expected=$((expected + 1))
    elif ((host_slices[i] != expected)); then
      die "host ${ssh_targets[i]}: slice ${host_slices[i]} out of order: number slices 0, 1, ... with each slice's hosts on consecutive lines"
    fi
  done
  n_slices=$((expected + 1))
}

# ----------------------------------------------------------------------------
# ssh

# ssh takes the first value given for an option, so --ssh-option comes before the
# defaults: never a password prompt, and a host seen for the first time is trusted
# (a changed host key still stops the launch).
ssh_base() {
  ssh_cmd=(ssh "${ssh_options[@]}" -o BatchMode=yes -o ConnectTimeout="$connect_timeout" -o StrictHostKeyChecking=accept-new
           -o ServerAliveInterval=15 -o ServerAliveCountMax=4)
  [[ -z $ssh_user ]] || ssh_cmd+=(-l "$ssh_user")
  [[ -z $ssh_port ]] || ssh_cmd+=(-p "$ssh_port")
  [[ -z $ssh_key ]] || ssh_cmd+=(-i "$ssh_key" -o IdentitiesOnly=yes)
}

# on_host I ARGS...: ssh to process I's host and run ARGS there.
on_host() {
  local i=$1; shift
  "${ssh_cmd[@]}" "${ssh_targets[i]}" "$@"
}

# for_all_hosts FN [I...]: runs `FN I` for every process (or the ones given) in parallel,
# output in a per-host file; prints each host's output prefixed by its name, and returns
# 1, naming the hosts, if any failed (their ids are left in failed_ids).
failed_ids=()
for_all_hosts() {
  local fn=$1 i status=0 failed=() ids=("${@:2}")
  local outdir pids=()
  ((${#ids[@]})) || ids=("${!ssh_targets[@]}")
  outdir=$(mktemp -d)
  for i in "${ids[@]}"; do
    "$fn" "$i" >"$outdir/$i" 2>&1 </dev/null &
    pids[i]=$!
  done
  failed_ids=()
  for i in "${ids[@]}"; do
    wait "${pids[i]}" && continue
    (($? != 255)) || echo "ssh could not reach this host" >>"$outdir/$i"
    status=1; failed+=("${ssh_targets[i]}"); failed_ids+=("$i")
  done
  for i in "${ids[@]}"; do
    sed "s|^|${ssh_targets[i]} (process $i): |" "$outdir/$i"
  done
  rm -rf "$outdir"
  if ((status)); then
    say "failed on: ${failed[*]}"
  fi
  return "$status"
}

# Prints nothing when host I answers, has tmux and does not run this run already
# (the last two only matter for starting).
reach_host() {
  local out session
  session=$(session_of "$1")
  if ! out=$(on_host "$1" "if ! command -v tmux >/dev/null; then echo tmux-missing;
    elif tmux has-session -t =$session 2>/dev/null; then echo already-running; else echo tmux-ok; fi" 2>&1); then
    echo "cannot reach it over ssh: $(tail -n 1 <<<"${out:-no answer}")"
    return 1
  fi
  [[ $action == start || $action == ray-start ]] || return 0
  case $out in
    *tmux-ok) ;;
    *tmux-missing) echo "tmux is not installed there (launcher.sh --setup, or apt-get install tmux)"; return 1 ;;
    *already-running) echo "run $name is already running there (tmux session $session): --stop it first, or pick another --name"; return 1 ;;
    *) echo "unexpected answer over ssh: $out"; return 1 ;;
  esac
}

# ----------------------------------------------------------------------------
# Code: this repo at HEAD, unpacked once per commit on every host

commit=""

resolve_commit() {
  commit=$(git -C "$LAUNCHER_DIR" rev-parse HEAD 2>/dev/null) || die "$LAUNCHER_DIR is not a git checkout"
  if [[ -n $(git -C "$LAUNCHER_DIR" status --porcelain --untracked-files=no) ]]; then
    say "warning: uncommitted changes are not launched; the hosts run commit ${commit:0:12}"
  fi
}

# A fresh directory is filled and then renamed into place, so a half-copied tree is never
# run and two launches of the same commit (or two processes on one host) never collide.
sync_code() {
  # shellcheck disable=SC2016  # expanded by the remote shell, with $0 = remote dir, $1 = commit
  local unpack='set -e; cd; mkdir -p "$0/code"; d="$0/code/$1"
if [ -e "$d/.complete" ]; then cat >/dev/null; exit 0; fi
t=$(mktemp -d "$0/code/.incoming.XXXXXX"); tar -x -C "$t"; touch "$t/.complete"
chmod 755 "$t"; mv -T "$t" "$d" 2>/dev/null || rm -rf "$t"'
  git -C "$LAUNCHER_DIR" archive --format=tar "$commit" | on_host "$1" "bash -c '$unpack' $remote_dir $commit"
  if [[ -f $LAUNCHER_DIR/.env ]]; then
    on_host "$1" "umask 077; cd && mkdir -p $remote_dir && cat > $remote_dir/.env" <"$LAUNCHER_DIR/.env"
  fi
}

# ----------------------------------------------------------------------------
# Remote scripts, run with `bash -s` on the host; values are quoted here with %q

session_of() { if [[ $action == ray-* ]]; then echo "$name-ray-p$1"; else echo "$name-p$1"; fi; }

# remote_prelude I [ANSWER]: into the remote dir, creating it; or, given ANSWER, print
# that and stop when the dir does not exist (nothing was ever started there).
remote_prelude() {
  printf 'set -euo pipefail; cd\n'
  if (($# > 1)); then
    printf 'if ! cd %q 2>/dev/null; then echo %q; exit 0; fi\n' "$remote_dir" "$2"
  else
    printf 'mkdir -p %q; cd %q\n' "$remote_dir" "$remote_dir"
  fi
  printf 'session=%q\n' "$(session_of "$1")"
  # shellcheck disable=SC2016  # the remote shell expands these
  printf '%s\n' 'log=logs/$session.log; status_file=logs/$session.status' \
    'running() { tmux has-session -t "=$session" 2>/dev/null; }'
}

# The job that runs inside tmux on host I: run.sh, its output to the log (and the pane),
# then its exit status to the status file.
# shellcheck disable=SC2016  # $(...) and ${PIPESTATUS} are for the job's shell
job_script() {
  local i=$1 n=${#ssh_targets[@]} env=()
  [[ -z $python ]] || env+=("PYTHON=$python")
  [[ -z $restart_reason ]] || env+=("MESHFORMER_RESTART_REASON=$restart_reason")  # the run's restart row says why
  [[ ! -f $LAUNCHER_DIR/.env ]] || env+=("MESHFORMER_ENV_FILE=.env")
  printf '#!/usr/bin/env bash\n# written by launcher.sh: run %s, process %s of %s, commit %s\n' "$name" "$i" "$n" "$commit"
  printf 'cd; cd %q\n' "$remote_dir"
  printf 'echo "=== $(date -u +%%Y-%%m-%%dT%%H:%%M:%%SZ) $(hostname): run %s, process %s of %s, commit %s" >> %q\n' \
    "$name" "$i" "$n" "$commit" "logs/$(session_of "$i").log"
  local run_flags=("${flags[@]}")
  if ((n_slices > 1)); then  # the megascale runtime joins the slices over the data-center network
    env+=("MEGASCALE_COORDINATOR_ADDRESS=${addresses[0]}:$MEGASCALE_PORT" "MEGASCALE_NUM_SLICES=$n_slices"
          "MEGASCALE_SLICE_ID=${host_slices[i]}" "MEGASCALE_PORT=$MEGASCALE_PORT")
    [[ " ${flags[*]} " == *" --mesh.slices"* ]] || run_flags+=("--mesh.slices=$n_slices")
  fi
  printf '%q ' env "${env[@]}" "code/$commit/run.sh" --coordinator "${addresses[0]}:$port" \
    --num-processes "$n" --process-id "$i" -- "${run_flags[@]}"
  printf '2>&1 | tee -a %q\n' "logs/$(session_of "$i").log"
  printf 'echo "exit ${PIPESTATUS[0]}" > %q\n' "logs/$(session_of "$i").status"
}

start_host() {
  local i=$1
  {
    remote_prelude "$i"
    # shellcheck disable=SC2016
    printf '%s\n' 'if running; then echo "run already running here (tmux session $session): --stop it first"; exit 3; fi' \
      'mkdir -p logs jobs'
    # shellcheck disable=SC2016
    printf 'cat > jobs/$session.sh <<'\''MESHFORMER_JOB'\''\n%s\nMESHFORMER_JOB\n' "$(job_script "$i")"
    # shellcheck disable=SC2016
    printf '%s\n' 'echo running > "$status_file"' \
      'tmux new-session -d -s "$session" -c "$PWD" "bash $PWD/jobs/$session.sh"' \
      'echo "started tmux session $session; log: $PWD/$log"'
  } | on_host "$i" bash -s
}

status_host() {
  {
    remote_prelude "$1" "not started"
    # shellcheck disable=SC2016
    printf '%s\n' 'if running; then state=running' \
      'elif [ -f "$status_file" ] && [ "$(cat "$status_file")" != running ]; then state=$(cat "$status_file")' \
      'elif [ -f "$status_file" ]; then state="gone (its tmux session ended without an exit status)"' \
      'else state="not started"; fi' \
      'echo "$state; log: $PWD/$log"'
  } | on_host "$1" bash -s
}

# Stopping takes two rounds over the hosts: which of them run RUN (running_ids), then
# stop each. One host's processes, once their coordinator or a collective peer is gone,
# abort on their own (exit 134) within moments, often before their own stop reaches
# them: a host that ran RUN when --stop began counts as stopped, whichever came first.
running_ids=()
find_running_hosts() {
  local line
  running_ids=()
  while IFS= read -r line; do
    [[ $line =~ \(process\ ([0-9]+)\):\ running\; ]] && running_ids+=("${BASH_REMATCH[1]}")
  done < <(for_all_hosts status_host 2>/dev/null)
  return 0  # (not the last line's match: a host that runs nothing is no error)
}

stop_host() {
  {
    remote_prelude "$1" "not running"
    local ran_at_start=0
    [[ " ${running_ids[*]} " != *" $1 "* ]] || ran_at_start=1
    printf 'ran_at_start=%s\n' "$ran_at_start"
    # shellcheck disable=SC2016
    printf '%s\n' 'if running || [ "$ran_at_start" = 1 ]; then' \
      '  sid=$(tmux display-message -p -t "=$session:" "#{pane_pid}" 2>/dev/null || true)  # the job leads its session' \
      '  tmux kill-session -t "=$session" 2>/dev/null || true  # (it may have ended on its own meanwhile)' \
      '  for signal in TERM KILL; do  # what outlived the hangup: e.g. Ray workers, in groups of their own' \
      '    for _ in 1 2 3 4 5 6 7 8 9 10; do' \
      '      [ -n "$sid" ] && pgrep -s "$sid" >/dev/null || break' \
      '      pkill "-$signal" -s "$sid" || true; sleep 0.5  # (they may all exit between pgrep and pkill)' \
      '    done' \
      '  done' \
      '  echo stopped > "$status_file"; echo stopped' \
      'else echo "not running"; fi'
  } | on_host "$1" bash -s
}

# ----------------------------------------------------------------------------
# A Ray cluster (for data/tokenize.py --ray): `ray start --block` in a tmux session per host

ray_token_file() { echo "ray/$name.token"; }  # under the remote dir; only this user can read it

# The job in host I's tmux session: the head on process 0's host, a node joining it elsewhere.
# Nodes and drivers authenticate with the cluster's token (RAY_AUTH_MODE=token).
# shellcheck disable=SC2016  # $python, $PWD, ${PIPESTATUS} are for the job's shell
ray_job_script() {
  local i=$1 role=(--head --port "$ray_port")
  ((i == 0)) || role=(--address "${addresses[0]}:$ray_port")
  printf '#!/usr/bin/env bash\n# written by launcher.sh: Ray node %s of %s, cluster %s\n' "$i" "${#ssh_targets[@]}" "$name"
  printf 'cd; cd %q\n' "$remote_dir"
  printf 'export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$PWD/%s" RAY_USAGE_STATS_ENABLED=0\n' "$(ray_token_file)"
  printf 'python=%q\n' "$python"  # as run.sh chooses it
  printf '%s\n' 'venv=${MESHFORMER_VENV:-$HOME/.venvs/meshformer}' \
    'if [[ -z $python && -x $venv/bin/python ]]; then python=$venv/bin/python; fi' 'python=${python:-python3}'
  if ((i > 0)); then
    printf 'for ((t = 0; t < %s; t++)); do (exec 3<>/dev/tcp/%s/%s) 2>/dev/null && break; sleep 1; done\n' \
      "$RAY_HEAD_WAIT_S" "${addresses[0]}" "$ray_port"
  fi
  printf '"$python" -m ray.scripts.scripts start --block --disable-usage-stats --node-ip-address %q ' "${addresses[i]}"
  printf '%q ' "${role[@]}" "${flags[@]}"
  printf '2>&1 | tee -a %q\n' "logs/$(session_of "$i").log"
  printf 'echo "exit ${PIPESTATUS[0]}" > %q\n' "logs/$(session_of "$i").status"
}

ray_start_host() {
  local i=$1
  {
    remote_prelude "$i"
    # shellcheck disable=SC2016
    printf '%s\n' 'if running; then echo "Ray node already running here (tmux session $session): --ray-stop it first"; exit 3; fi' \
      'mkdir -p logs jobs ray; (umask 077; cat > ray/.token.tmp) <<MESHFORMER_TOKEN'
    printf '%s\nMESHFORMER_TOKEN\n' "$ray_token"
    printf 'mv ray/.token.tmp %q\n' "$(ray_token_file)"
    # shellcheck disable=SC2016
    printf 'cat > jobs/$session.sh <<'\''MESHFORMER_JOB'\''\n%s\nMESHFORMER_JOB\n' "$(ray_job_script "$i")"
    # shellcheck disable=SC2016
    printf '%s\n' 'echo running > "$status_file"' \
      'tmux new-session -d -s "$session" -c "$PWD" "bash $PWD/jobs/$session.sh"' \
      'echo "started tmux session $session; log: $PWD/$log"'
  } | on_host "$i" bash -s
}

# Waits (on the head's host) until the head listens.
ray_wait_for_head() {
  on_host 0 "for ((t = 0; t < $RAY_HEAD_WAIT_S; t++)); do (exec 3<>/dev/tcp/${addresses[0]}/$ray_port) 2>/dev/null && exit 0; sleep 1; done; exit 1"
}

ray_start() {
  ray_token=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
  say "Ray cluster $name: ${#ssh_targets[@]} node(s), head ${addresses[0]}:$ray_port"
  for_all_hosts reach_host >&2 || die "some hosts cannot be used (see above); nothing was started"
  local rest=("${!ssh_targets[@]}")
  if ! for_all_hosts ray_start_host 0 || ! ray_wait_for_head; then
    for_all_hosts stop_host 0 >/dev/null || true
    die "the Ray head did not start on ${ssh_targets[0]} (its log: logs/$(session_of 0).log under --remote-dir)"
  fi
  if ((${#rest[@]} > 1)) && ! for_all_hosts ray_start_host "${rest[@]:1}"; then
    say "not every node started: stopping the cluster"
    for_all_hosts stop_host >/dev/null || true
    exit 1
  fi
  local token_path
  token_path=$remote_dir/$(ray_token_file)
  [[ $remote_dir == /* ]] || token_path="\$HOME/$token_path"
  echo "ray address: ${addresses[0]}:$ray_port"
  say "tokenize on it from any host: RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$token_path python data/tokenize.py --ray ${addresses[0]}:$ray_port ..."
  say "stop it with: $0 ${hosts_file:+--hosts $hosts_file}${tpu:+--tpu $tpu --zone $zone} --name $name --ray-stop"
}

setup_host() {
  on_host "$1" "cd && cd $remote_dir/code/$commit && ./setup_tpu.sh"
}

# ----------------------------------------------------------------------------

main() {
  while (($#)); do
    parse_option "$@"
    if ((shifted)); then shift "$shifted"; continue; fi
    case $1 in
      --status) action=status; shift ;;
      --stop) action=stop; shift ;;
      --setup) action=setup; shift ;;
      --ray-start) action=ray-start; shift ;;
      --ray-stop) action=ray-stop; shift ;;
      --ray-status) action=ray-status; shift ;;
      --ray-port) ray_port=${2:?--ray-port needs a number}; shift 2 ;;
      --watch) watch=1; shift ;;
      --max-restarts) max_restarts=${2:?--max-restarts needs a number}; shift 2 ;;
      --poll) poll_s=${2:?--poll needs seconds}; shift 2 ;;
      --wait-hosts) wait_hosts_s=${2:?--wait-hosts needs seconds}; shift 2 ;;
      --recreate) recreate=1; shift ;;
      -h|--help) usage; exit 0 ;;
      --) shift; flags+=("$@"); break ;;
      *) die "unknown option '$1' (main.py flags go after --; see --help)" ;;
    esac
  done
  check_options
  resolve_hosts
  ssh_base

  case $action in
    status|ray-status) for_all_hosts status_host; return ;;
    stop|ray-stop) find_running_hosts; for_all_hosts stop_host; return ;;
    ray-start) ray_start; return ;;
  esac
  resolve_commit
  say "run $name: ${#ssh_targets[@]} process(es), coordinator ${addresses[0]}:$port, commit ${commit:0:12}"
  for_all_hosts reach_host >&2 || die "some hosts cannot be used (see above); nothing was started"
  for_all_hosts sync_code || die "could not copy the code to every host; nothing was started"
  if [[ $action == setup ]]; then
    for_all_hosts setup_host
    return
  fi
  start_all
  if ((watch)); then
    watch_run
  else
    say "started; follow with: $0 ${hosts_file:+--hosts $hosts_file}${tpu:+--tpu $tpu --zone $zone} --name $name --status"
  fi
}

# Starts every host; if one fails, stops the ones that started and exits.
start_all() {
  if ! for_all_hosts start_host; then
    local started=() i
    for i in "${!ssh_targets[@]}"; do
      [[ " ${failed_ids[*]} " == *" $i "* ]] || started+=("$i")
    done
    if ((${#started[@]})); then
      say "not every host started: stopping the ones that did"
      for_all_hosts stop_host "${started[@]}" >/dev/null || true
    fi
    exit 1
  fi
}

# ----------------------------------------------------------------------------
# --watch: bring the run back when a host's process ends other than by finishing

host_states=()  # host_states[i]: process i's state from --status; unset when its host did not answer
poll_states() {
  local line
  host_states=()
  while IFS= read -r line; do
    [[ $line =~ \(process\ ([0-9]+)\):\ (.*)\;\ log: ]] && host_states[BASH_REMATCH[1]]=${BASH_REMATCH[2]}
  done < <(for_all_hosts status_host 2>/dev/null)
  return 0  # (a host that did not answer is left unset, not an error here)
}

# describe_state STATE: what a process's state means, in words.
describe_state() {
  case $1 in
    "exit $PREEMPTED_EXIT_CODE") echo "preempted (exit $PREEMPTED_EXIT_CODE: it saved a checkpoint and stopped)" ;;
    exit\ 13[0-9]|exit\ 14[0-9]) echo "killed by signal $((${1#exit } - 128)) ($1)" ;;
    exit\ *) echo "crashed ($1)" ;;
    "") echo "its host does not answer over ssh" ;;
    *) echo "$1" ;;
  esac
}

# scan_states: from host_states, `failure` (every process that ended other than by
# finishing, in words) and `running` (1 while any still runs); returns 1 after --stop.
scan_states() {
  local i state
  failure="" running=0
  for i in "${!ssh_targets[@]}"; do
    state=${host_states[i]:-}
    case $state in
      "exit 0") ;;
      running) running=1 ;;
      stopped) say "run $name was stopped (--stop): not restarting it"; return 1 ;;
      *) failure+="${failure:+; }process $i (${ssh_targets[i]}): $(describe_state "$state")" ;;
    esac
  done
  return 0
}

watch_run() {
  local restarts=0 failure running
  say "watching run $name: polling every ${poll_s}s, up to $max_restarts restart(s) (--max-restarts)"
  while true; do
    sleep "$poll_s"
    poll_states
    scan_states || return 1
    if [[ -n $failure ]]; then
      # One more look before acting: a process often ends moments after another (the
      # others lose their coordinator or peer), and the message names every end together.
      sleep "$poll_s"
      poll_states
      scan_states || return 1
    fi
    if [[ -z $failure ]]; then
      ((running)) && continue
      say "run $name finished on every host (exit 0) after $restarts restart(s)"
      return 0
    fi
    if ((restarts >= max_restarts)); then
      say "run $name: $failure; giving up after $restarts restart(s) (--max-restarts $max_restarts): stopping the other" \
        "hosts. To resume from the latest checkpoint, launch again with --name $name"
      stop_run
      exit 1
    fi
    restarts=$((restarts + 1))
    say "restart $restarts/$max_restarts of run $name: $failure; stopping the other hosts, waiting for every host," \
      "starting them again (the run resumes from its latest complete checkpoint)"
    stop_run
    wait_for_hosts
    restart_reason="launcher.sh --watch restart $restarts/$max_restarts: $failure"
    for_all_hosts sync_code >/dev/null || die "could not copy the code to every host for restart $restarts"
    start_all
  done
}

stop_run() {
  find_running_hosts
  ((${#running_ids[@]} == 0)) || for_all_hosts stop_host "${running_ids[@]}" >/dev/null || true
}

# Until every host answers over ssh (with --tpu: until each TPU is READY, recreating a
# preempted one with --recreate), at most --wait-hosts seconds.
wait_for_hosts() {
  local deadline=$((SECONDS + wait_hosts_s)) tpu_name state names recreated=0
  if [[ -n $tpu ]]; then
    IFS=, read -r -a names <<<"$tpu"
    for tpu_name in "${names[@]}"; do
      while state=$(tpu_state "$tpu_name") && [[ $state != READY ]]; do
        if ((recreate)) && [[ $state == PREEMPTED || $state == TERMINATED ]]; then
          recreate_tpu "$tpu_name"
          recreated=1
          continue
        fi
        ((SECONDS < deadline)) || die "TPU $tpu_name is $state, not READY, after ${wait_hosts_s}s (--wait-hosts); gave up"
        say "TPU $tpu_name is ${state:-unknown}; waiting for READY"
        sleep "$poll_s"
      done
    done
    ssh_targets=() addresses=() host_slices=()
    resolve_hosts  # a TPU created again has new addresses
  fi
  until for_all_hosts reach_host >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "not every host answers after ${wait_hosts_s}s (--wait-hosts); gave up"
    sleep "$poll_s"
  done
  if ((recreated)); then
    for_all_hosts sync_code >/dev/null || die "could not copy the code to the recreated TPU"
    for_all_hosts setup_host || die "setup_tpu.sh failed on the recreated TPU"
  fi
}

tpu_gcloud() {  # tpu_gcloud VERB NAME ARGS...: gcloud compute tpus tpu-vm VERB NAME --zone ... [--project ...]
  local verb=$1 tpu_name=$2
  local gcloud_cmd=(gcloud compute tpus tpu-vm "$verb" "$tpu_name" --zone "$zone")
  [[ -z $project ]] || gcloud_cmd+=(--project "$project")
  "${gcloud_cmd[@]}" "${@:3}"
}

tpu_state() { tpu_gcloud describe "$1" --format='value(state)'; }

recreate_tpu() {
  local tpu_name=$1 type version preemptible spot extra=()
  IFS=$'\t' read -r type version preemptible spot < <(tpu_gcloud describe "$tpu_name" \
    --format='value(acceleratorType,runtimeVersion,schedulingConfig.preemptible,schedulingConfig.spot)')
  [[ ${preemptible,,} != true ]] || extra+=(--preemptible)
  [[ ${spot,,} != true ]] || extra+=(--spot)
  say "recreating TPU $tpu_name ($type, runtime $version${extra[*]:+, ${extra[*]}}) (--recreate)"
  tpu_gcloud delete "$tpu_name" --quiet || die "could not delete TPU $tpu_name"
  tpu_gcloud create "$tpu_name" --accelerator-type "$type" --version "$version" "${extra[@]}" \
    || die "could not create TPU $tpu_name again"
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  main "$@"
fi
