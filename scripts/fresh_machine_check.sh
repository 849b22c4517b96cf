#!/usr/bin/env bash
# What a newcomer sees on a fresh Debian 13 machine, for real: a clean Debian 13 root
# (debootstrap; Debian's own python3 3.13 with python3-venv and ca-certificates, no 3.11), this
# checkout's committed files as `git archive HEAD` gives them, and the README's two commands run
# inside it by an ordinary user: `bash scripts/run.sh`, then `bash scripts/test.sh`. Writes
# WORK_DIR/report.txt (exit codes, minutes, the set-up lines, the comparison's table, the test
# counts) and the full logs beside it.
#   sudo bash scripts/fresh_machine_check.sh [WORK_DIR]      (default /var/tmp/dp-bench-fresh)
#   STEPS="run" ... runs only the first command (default: "run test")
# A manual check, not part of CI: it needs root, debootstrap (apt-get install debootstrap), the
# Debian mirror (taken from this machine's apt sources) and PyPI (the chroot gets this machine's
# resolv.conf and CA certificates); the main environment alone downloads several GB (torch's
# CUDA wheels, as PyPI gives them to every newcomer). WORK_DIR/debian13-base, the debootstrap
# result, is kept and copied for each check: the root the commands run in is always a new copy.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(realpath -m "${1:-/var/tmp/dp-bench-fresh}")"
steps="${STEPS:-run test}"
((EUID == 0)) || { echo "fresh_machine_check: needs root (debootstrap, chroot, mount)" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "fresh_machine_check: apt-get install debootstrap" >&2; exit 2; }
mkdir -p "$work"
base="$work/debian13-base" root="$work/root" report="$work/report.txt"

mirror() {  # this machine's Debian mirror: the first deb.debian.org-style URI of its apt sources
  local uri
  uri="$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list |
    grep -oE '(https?|file)://[^ ]+' | grep -v -- '-security' | grep -m1 '/debian/\?$' || true)"
  echo "${uri:-http://deb.debian.org/debian}"
}

if [[ ! -f "$base.complete" ]]; then
  rm -rf "$base"
  echo "[fresh] debootstrap trixie from $(mirror) into $base"
  debootstrap --include=python3,python3-venv,ca-certificates trixie "$base" "$(mirror)" \
    >"$work/debootstrap.log" 2>&1 || { echo "[fresh] debootstrap failed: $work/debootstrap.log" >&2; exit 1; }
  touch "$base.complete"
fi

unmount() { grep -q " $root/" /proc/mounts && umount -R "$root"/{proc,sys,dev} 2>/dev/null; true; }
unmount
if grep -q " $root/" /proc/mounts; then echo "fresh_machine_check: $root still has mounts" >&2; exit 1; fi
rm -rf --one-file-system "$root"
mkdir "$root" && cp -a "$base/." "$root/"  # the contents: a base that is a link stays untouched
trap unmount EXIT
cp /etc/resolv.conf "$root/etc/resolv.conf"
# the machine's name resolves, as Debian's installer writes it (the chroot shares this machine's
# hostname; without it gloo warns on every torch-ddp run and JAX's multi-process CPU backend fails)
echo "127.0.1.1 $(hostname)" >>"$root/etc/hosts"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
chroot "$root" useradd -m newcomer
git -C "$here" archive --prefix=dp-bench/ HEAD | tar -x -C "$root/home/newcomer"
chroot "$root" chown -R newcomer: /home/newcomer/dp-bench
mount -t proc proc "$root/proc"
mount -t sysfs sys "$root/sys"
mount --rbind /dev "$root/dev" && mount --make-rslave "$root/dev"  # /dev/shm: torch's workers

as_newcomer() {  # a login-like shell of the new user in the checkout: nothing of this machine's
  chroot "$root" runuser -u newcomer -- env -i HOME=/home/newcomer LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/bin:/usr/bin:/bin bash -c "cd ~/dp-bench && $1"
}

{
  echo "fresh_machine_check $(date -u +%FT%TZ): $(git -C "$here" rev-parse --short HEAD) on $(. "$root/etc/os-release"; echo "$PRETTY_NAME")"
  echo "python3: $(as_newcomer 'python3 --version'); python3.11: $(as_newcomer 'command -v python3.11 || echo none'); uv: $(as_newcomer 'command -v uv || echo none')"
} | tee "$report"
for step in $steps; do
  log="$work/$step.log"
  start=$(date +%s)
  echo "[fresh] bash scripts/$step.sh (log: $log)"
  rc=0
  as_newcomer "bash scripts/$step.sh" >"$log" 2>&1 || rc=$?
  minutes=$(awk -v s=$(( $(date +%s) - start )) 'BEGIN { printf "%.1f", s / 60 }')
  {
    echo
    echo "== bash scripts/$step.sh: exit $rc in $minutes minutes"
    grep -E '^\[(setup|test)\]|^compare: |^setup_plan: ' "$log" || true
    if [[ "$step" == run ]]; then
      table="$(ls -d "$root"/home/newcomer/dp-bench/results/*/ 2>/dev/null | tail -1)results.md"
      [[ -f "$table" ]] && sed '/^## /q' "$table"  # the comparison table and its notes
    else
      grep -E '^(=+ .* in [0-9.]+s.* =+|FAILED |ERROR |Success: |Found [0-9]+ error)' "$log" || true
    fi
    echo "-- last lines of the log:"
    tail -n 5 "$log"
  } | tee -a "$report"
done
echo "[fresh] report: $report"
