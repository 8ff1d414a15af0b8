#!/usr/bin/env bash
# Debug a run interactively on every host at once, in a local tmux session:
#   window "run":     one pane per host, running the command in the foreground over ssh.
#                     The panes are synchronized: what you type (Ctrl-C too) goes to all.
#   window "monitor": one pane per host: tpu-info on a TPU VM, nvidia-smi on a GPU host,
#                     top elsewhere.
#
#   ./debug_tpu.sh --tpu NAME --zone ZONE [-- main.py flags...]     # run.sh on every worker
#   ./debug_tpu.sh --hosts hosts.txt --cmd 'python -c "import jax; print(jax.device_count())"'
#
# Hosts, ssh and code options are launcher.sh's (--hosts, --tpu, --zone, --project,
# --port, --remote-dir, --python, --ssh-*; see ./launcher.sh --help): the code is copied
# the same way, and the default command is the one launcher.sh would start, with its
# output on screen instead of in tmux sessions on the hosts. Also:
#   --cmd COMMAND    a shell command to run on every host instead, in --remote-dir, with
#                    $CODE (the code directory), $PROCESS_ID, $NUM_PROCESSES, $COORDINATOR
#   --session NAME   the local tmux session (default: debug-RUN)
#   --detach         create the session without attaching to it
set -euo pipefail

# shellcheck source=launcher.sh
source "$(dirname "${BASH_SOURCE[0]}")/launcher.sh"

MONITOR_EVERY_S=2

debug_main() {
  local cmd="" session="" detach=0
  action=debug
  while (($#)); do
    parse_option "$@"
    if ((shifted)); then shift "$shifted"; continue; fi
    case $1 in
      --cmd) cmd=${2:?--cmd needs a command}; shift 2 ;;
      --session) session=${2:?--session needs a name}; shift 2 ;;
      --detach) detach=1; shift ;;
      -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
      --) shift; flags+=("$@"); break ;;
      *) die "unknown option '$1' (main.py flags go after --; see --help)" ;;
    esac
  done
  check_options
  session=${session:-debug-$name}
  [[ $session =~ ^[A-Za-z0-9_-]+$ ]] || die "--session may only hold letters, digits, _ and -"
  command -v tmux >/dev/null || die "tmux is not installed here"
  ! tmux has-session -t "=$session" 2>/dev/null || die "tmux session $session exists already: tmux kill-session -t $session"
  resolve_hosts
  ssh_base
  resolve_commit
  for_all_hosts reach_host >&2 || die "some hosts cannot be reached (see above)"
  for_all_hosts sync_code || die "could not copy the code to every host"

  # One pane per host and window, tiled after each split so that any number fits. Panes
  # are addressed by id (%N), which does not depend on the user's pane-base-index.
  local i n=${#ssh_targets[@]} window panes pane_cmd
  for window in run monitor; do
    panes=()
    for ((i = 0; i < n; i++)); do
      pane_cmd=("${ssh_cmd[@]}" -t "${ssh_targets[i]}" "$(remote_command "$window" "$i" "$cmd")")
      if ((i == 0)) && [[ $window == run ]]; then
        # options set in the same tmux call take effect before a quick command can end
        panes+=("$(tmux new-session -d -P -F '#{pane_id}' -s "$session" -n run -x 240 -y 70 "${pane_cmd[@]}" \; \
          set-option -w -t "$session:run" remain-on-exit on)")
      elif ((i == 0)); then
        panes+=("$(tmux new-window -d -P -F '#{pane_id}' -t "$session:" -n monitor "${pane_cmd[@]}" \; \
          set-option -w -t "$session:monitor" remain-on-exit on)")
      else
        panes+=("$(tmux split-window -d -P -F '#{pane_id}' -t "${panes[i - 1]}" "${pane_cmd[@]}" \; \
          select-layout -t "$session:$window" tiled)")
      fi
    done
    tmux set-option -w -t "$session:$window" pane-border-status top
    for ((i = 0; i < n; i++)); do
      tmux select-pane -t "${panes[i]}" -T "${ssh_targets[i]} (process $i)"
    done
  done
  tmux set-option -w -t "$session:run" synchronize-panes on
  tmux select-window -t "$session:run"

  if ((detach)) || [[ ! -t 0 ]]; then
    say "tmux session $session: $n host(s); attach with: tmux attach -t $session"
  elif [[ -n ${TMUX:-} ]]; then
    tmux switch-client -t "$session"
  else
    tmux attach -t "$session"
  fi
}

# The command line that process I's pane runs on its host (parsed by the remote shell).
remote_command() {
  local window=$1 i=$2 cmd=$3 n=${#ssh_targets[@]}
  local code=code/$commit coordinator=${addresses[0]}:$port
  printf 'cd; cd %q; ' "$remote_dir"
  if [[ $window == monitor ]]; then
    # tpu-info usually lives in the virtualenv that setup_tpu.sh made
    # shellcheck disable=SC2016  # $HOME and $PATH are the host's
    printf 'PATH=$HOME/.venvs/meshformer/bin:$PATH; '
    printf 'if command -v tpu-info >/dev/null; then while tpu-info; do sleep %s; clear; done; ' "$MONITOR_EVERY_S"
    printf 'elif command -v nvidia-smi >/dev/null; then nvidia-smi -l %s; else top -d %s; fi' "$MONITOR_EVERY_S" "$MONITOR_EVERY_S"
  elif [[ -n $cmd ]]; then
    printf 'export CODE=%q PROCESS_ID=%q NUM_PROCESSES=%q COORDINATOR=%q; %s' "$code" "$i" "$n" "$coordinator" "$cmd"
  else
    [[ -z $python ]] || printf 'PYTHON=%q ' "$python"
    [[ ! -f $LAUNCHER_DIR/.env ]] || printf 'MESHFORMER_ENV_FILE=.env '
    printf '%q ' "$code/run.sh" --coordinator "$coordinator" --num-processes "$n" --process-id "$i" -- "${flags[@]}"
  fi
}

debug_main "$@"
