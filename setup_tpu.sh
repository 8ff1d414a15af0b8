#!/usr/bin/env bash
# Install what meshformer needs on this host; safe to run again (it then does nothing).
#
#   ./setup_tpu.sh               # here
#   ./setup_tpu.sh --check       # only say what it would do
#   ./launcher.sh --tpu NAME --zone ZONE --setup      # on every worker of a TPU VM
#   ./launcher.sh --hosts hosts.txt --setup           # on every host in the file
#
# - tmux (launcher.sh runs training in tmux sessions), with apt-get, if missing
# - a virtualenv at $MESHFORMER_VENV (default ~/.venvs/meshformer), which run.sh uses,
#   holding the pinned requirements.txt, plus on a Cloud TPU VM jax[tpu] (libtpu) and
#   tpu-info, on a host with an NVIDIA GPU jax[cuda12], at the pinned JAX version.
# Settings: PYTHON (the interpreter for the virtualenv; default: the newest python3.1x
# found), MESHFORMER_ACCELERATOR=tpu|gpu|cpu (default: detected).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=${MESHFORMER_VENV:-$HOME/.venvs/meshformer}
MIN_PYTHON=3.11  # the pinned jax/numpy need it
METADATA=http://metadata.google.internal/computeMetadata/v1/instance/attributes

say() { echo "setup_tpu: $*"; }
die() { echo "setup_tpu: error: $*" >&2; exit 1; }

as_root() { if ((EUID == 0)); then "$@"; else sudo -n "$@"; fi; }

# ----------------------------------------------------------------------------
# Which accelerator: a Cloud TPU VM answers its metadata server with an accelerator type.

detect_accelerator() {
  if [[ -n ${MESHFORMER_ACCELERATOR:-} ]]; then echo "$MESHFORMER_ACCELERATOR"; return; fi
  if compgen -G '/dev/accel*' >/dev/null || compgen -G '/dev/vfio/[0-9]*' >/dev/null \
    || curl -sf -m 2 -H 'Metadata-Flavor: Google' "$METADATA/accelerator-type" >/dev/null 2>&1; then
    echo tpu
  elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    echo gpu
  else
    echo cpu
  fi
}

pick_python() {
  local candidate
  for candidate in ${PYTHON:-python3.13 python3.12 python3.11 python3}; do
    if command -v "$candidate" >/dev/null \
      && "$candidate" -c "import sys; sys.exit(sys.version_info < tuple(map(int, '$MIN_PYTHON'.split('.'))))" 2>/dev/null; then
      command -v "$candidate"
      return
    fi
  done
  return 1
}

# ----------------------------------------------------------------------------

check_only=0
case ${1:-} in
  --check) check_only=1 ;;
  -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) die "unknown option '$1' (see --help)" ;;
esac

accelerator=$(detect_accelerator)
jax_version=$(sed -n 's/^jax==//p' "$here/requirements.txt")
[[ -n $jax_version ]] || die "requirements.txt pins no jax==VERSION"
case $accelerator in
  tpu) extras=("jax[tpu]==$jax_version" tpu-info) ;;
  gpu) extras=("jax[cuda12]==$jax_version") ;;
  cpu) extras=() ;;
  *) die "MESHFORMER_ACCELERATOR must be tpu, gpu or cpu, got '$accelerator'" ;;
esac
say "accelerator: $accelerator; virtualenv: $venv"
if ((check_only)); then
  if command -v tmux >/dev/null; then say "tmux: $(command -v tmux)"; else say "tmux: missing, would install it with apt-get"; fi
  if [[ -x $venv/bin/python ]]; then say "virtualenv exists"
  else say "would create the virtualenv with $(pick_python || echo "no python >= $MIN_PYTHON found")"; fi
  say "would run: pip install -r requirements.txt ${extras[*]}"
  exit 0
fi

if ! command -v tmux >/dev/null; then
  say "installing tmux"
  if ! { as_root apt-get update -qq && as_root apt-get install -y -qq tmux; }; then
    die "could not install tmux (no apt-get or no sudo?): install it by hand"
  fi
fi

# What is installed is recorded in the virtualenv; the same requirements again are a no-op.
wanted="$(cat "$here/requirements.txt") ${extras[*]}"
stamp=$venv/.meshformer-requirements
if [[ -x $venv/bin/python && -f $stamp && $(cat "$stamp") == "$wanted" ]]; then
  say "already set up (same requirements): nothing to do"
  exit 0
fi

if [[ ! -x $venv/bin/python ]]; then
  if ! python=$(pick_python) && [[ -z ${PYTHON:-} ]] && command -v apt-get >/dev/null; then
    say "no python >= $MIN_PYTHON here (TPU VM images ship 3.10): installing python3.11 with apt-get"
    { as_root apt-get update -qq && as_root apt-get install -y -qq python3.11 python3.11-venv >/dev/null; } || true
    python=$(pick_python) || true
  fi
  [[ -n ${python:-} ]] || die "no python >= $MIN_PYTHON found: install one (e.g. apt-get install python3.11-venv) or set PYTHON"
  say "creating the virtualenv with $python"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv" || die "could not create $venv (on Debian/Ubuntu: apt-get install python3-venv)"
fi
"$venv/bin/python" -m pip install -q -r "$here/requirements.txt" "${extras[@]}"
echo "$wanted" >"$stamp"
say "done: jax $("$venv/bin/python" -c 'import jax; print(jax.__version__)') in $venv"
