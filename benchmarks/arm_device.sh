#!/usr/bin/env bash
# The torch-free device agent on aarch64, on an x86 Linux host under qemu-user emulation.
#
#   benchmarks/arm_device.sh                 build or reuse the arm64 system, install the checkout's wheel with
#                                            its [device] extra into it, run the 2-round check (arm_device.py)
#   benchmarks/arm_device.sh --enter CMD...  run CMD inside the arm64 system (what the check runs its device with)
#
# The arm64 system is a Debian bookworm root file system (debootstrap, 4-14 min and ~330 MB the first time) kept
# OUTSIDE the checkout in $FEDSGA_EDGE_ARM_ROOTFS (default /var/cache/fedsga-edge/arm64-bookworm), with a venv
# holding the device's dependencies, so a fresh clone reuses it. Needs root (chroot, mounts), a qemu-aarch64
# binfmt handler (installed here with apt-get when missing) and Debian's mirror and PyPI for the first build.
# Exit status: 0 the aarch64 device's rounds equal the x86 device's, 1 a failure or a mismatch, 77 the check
# could not run on this machine (no root, no binfmt_misc, no qemu-user), said loudly as "arm check not run".
# docs/deploy.md ("Checking the device on aarch64") explains the three quirks handled below.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."

ROOTFS=${FEDSGA_EDGE_ARM_ROOTFS:-/var/cache/fedsga-edge/arm64-bookworm}
MIRROR=${FEDSGA_EDGE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
VENV=/opt/fedsga-edge/venv       # inside the arm64 system
INSIDE=/srv/fedsga-arm-check     # the check's work folder, inside; $ROOTFS$INSIDE on the host
PYTHON=${PYTHON:-python3}        # the host's python with the project's [train] extra (coordinator, export)

# Quirk 2: qemu-user shows the guest the host's x86 /proc/cpuinfo; onnxruntime's CPU detection reads it as an
# arm one and `import onnxruntime` segfaults. A Raspberry Pi 4's (4 Cortex-A72 cores) goes over it.
CPUINFO='processor	: %d
BogoMIPS	: 108.00
Features	: fp asimd evtstrm crc32 cpuid
CPU implementer	: 0x41
CPU architecture: 8
CPU variant	: 0x0
CPU part	: 0xd08
CPU revision	: 3

'

# Run "$@" inside the arm64 system, in a private mount namespace (its /proc, /dev, /sys and cpuinfo mounts vanish
# with it; without /sys onnxruntime's CPU probe prints errors about the processor lists).
# Quirk 3: QEMU_CPU=cortex-a72, the Pi 4's core; qemu's default CPU offers SME and numpy's kernels for it
# made onnxruntime's steps 9x slower. Quirk 1: pip inside trusts the host's CA bundle (a proxy's CA included).
# The environment is emptied but for what the device needs, so no host setting leaks in.
enter() {
  CHROOT=$(command -v chroot) unshare --mount --propagation private /bin/sh -c '
    r=$1; shift
    mount -t proc proc "$r/proc"
    mount --bind "$r/etc/fedsga-edge/cpuinfo" "$r/proc/cpuinfo"
    mount --rbind /dev "$r/dev"
    mount -o ro --rbind /sys "$r/sys"
    exec env -i QEMU_CPU=cortex-a72 "$CHROOT" "$r" /usr/bin/env -i QEMU_CPU=cortex-a72 HOME=/root LANG=C.UTF-8 \
      PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 \
      SSL_CERT_FILE=/etc/fedsga-edge/host-ca.crt PIP_CERT=/etc/fedsga-edge/host-ca.crt \
      PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 "$@"' sh "$ROOTFS" "$@"
}

not_run() {
  echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
  echo "!!! arm check not run: $*"
  echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
  exit 77
}

stamp() { echo "[arm] $1 ($((SECONDS - ${2:-0})) s)"; }

if [ "${1:-}" = "--enter" ]; then shift; enter "$@"; exit $?; fi

# -- can this machine run arm64 programs? ----------------------------------------------------------------------
[ "$(uname -s)" = Linux ] || not_run "needs Linux (chroot, binfmt_misc), this is $(uname -s)"
[ "$(id -u)" = 0 ] || not_run "needs root (chroot, mounts, debootstrap); run it as root"
command -v unshare >/dev/null && command -v chroot >/dev/null || not_run "no unshare/chroot (util-linux, coreutils)"
if [ "$(uname -m)" != aarch64 ]; then
  if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
    mount binfmt_misc -t binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null \
      || not_run "binfmt_misc cannot be mounted here (a container without it?)"
  fi
  if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || ! command -v debootstrap >/dev/null; then
    echo "[arm] installing qemu-user-static, binfmt-support and debootstrap"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static binfmt-support \
      debootstrap >/dev/null) || echo "[arm] apt-get could not install them"
    command -v update-binfmts >/dev/null && update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
  fi
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] \
    || not_run "no qemu-aarch64 binfmt handler (apt-get install qemu-user-static binfmt-support)"
  grep -q enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 || not_run "the qemu-aarch64 binfmt handler is disabled"
fi
command -v debootstrap >/dev/null || [ -x "$ROOTFS/usr/bin/python3" ] \
  || not_run "no debootstrap to build the arm64 system"

# -- the arm64 system: reused when present, built when absent --------------------------------------------------
t=$SECONDS
if [ ! -x "$ROOTFS/usr/bin/python3" ]; then
  echo "[arm] building the arm64 system in $ROOTFS (debootstrap, 4-14 min)"
  rm -rf "$ROOTFS.partial" && mkdir -p "$(dirname "$ROOTFS")"
  debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$ROOTFS.partial" "$MIRROR" > "$(dirname "$ROOTFS")/debootstrap.log" 2>&1 \
    || { tail -20 "$(dirname "$ROOTFS")/debootstrap.log"; echo "[arm] debootstrap failed (log above)"; exit 1; }
  mv "$ROOTFS.partial" "$ROOTFS"
  stamp "built the arm64 system" "$t"
else
  stamp "reusing the arm64 system in $ROOTFS" "$t"
fi
mkdir -p "$ROOTFS/etc/fedsga-edge"
for i in 0 1 2 3; do printf "$CPUINFO" "$i"; done > "$ROOTFS/etc/fedsga-edge/cpuinfo"
printf 'Hardware\t: BCM2835\nModel\t\t: Raspberry Pi 4 Model B (emulated)\n' >> "$ROOTFS/etc/fedsga-edge/cpuinfo"
cp -L "${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}" "$ROOTFS/etc/fedsga-edge/host-ca.crt"
cp -L /etc/resolv.conf "$ROOTFS/etc/resolv.conf" 2>/dev/null || true
machine=$(enter uname -m 2>&1 | head -1 || true)
[ "$machine" = aarch64 ] || not_run "programs in the arm64 system do not run as aarch64 ($machine)"

# -- the checkout's wheel with its [device] extra, no torch ----------------------------------------------------
t=$SECONDS
rm -rf "$ROOTFS$INSIDE" && mkdir -p "$ROOTFS$INSIDE/dist"
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$build"   # the committed and staged files only
[ -z "$(git status --porcelain --untracked-files=no)" ] || echo "[arm] note: the wheel has the working tree's changes"
(cd "$build" && "$PYTHON" -m pip wheel -q --no-deps -w "$ROOTFS$INSIDE/dist" .) >/dev/null
whl=$(cd "$ROOTFS$INSIDE/dist" && ls fedsga_edge-*.whl)
stamp "built $whl" "$t"
t=$SECONDS
[ -x "$ROOTFS$VENV/bin/python" ] || enter python3 -m venv "$VENV"
enter "$VENV/bin/pip" install -q "$INSIDE/dist/$whl[device]"              # the dependencies: once per system
enter "$VENV/bin/pip" install -q --no-deps --force-reinstall "$INSIDE/dist/$whl"   # this checkout's code
if enter "$VENV/bin/python" -c 'import torch' 2>/dev/null; then echo "[arm] torch is in the device's venv"; exit 1; fi
versions=$(enter "$VENV/bin/python" -c 'import onnxruntime as o, numpy as n, sys
print(f"python {sys.version.split()[0]}, onnxruntime {o.__version__}, numpy {n.__version__}")')
stamp "installed $whl[device] in the arm64 venv ($versions)" "$t"

# -- the 2-round check ----------------------------------------------------------------------------------------
t=$SECONDS
"$PYTHON" benchmarks/arm_device.py --work "$ROOTFS$INSIDE" --inside "$INSIDE" --venv "$VENV" --enter "$SELF --enter"
stamp "the aarch64 check passed" "$t"
