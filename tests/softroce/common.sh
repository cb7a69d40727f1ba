# Shared by the Soft-RoCE scripts (sourced, not run): Debian packages, the
# cached kernel, the initramfs helpers and the qemu command line.
#
# The caller sets `deadline` (in $SECONDS) before sourcing; everything that
# can wait is bounded by it through `left`.

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
left() { local l=$((deadline - SECONDS)); if ((l < 5)); then echo "softroce: out of time" >&2; exit 124; fi; echo "$l"; }
say() { echo "softroce: $*" >&2; }

cache="${SOFTROCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rdma_device/softroce}"
mkdir -p "$cache"
sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi

# Installs the Debian packages the VM scripts need (only missing ones).
ensure_packages() {
    local pkgs=(qemu-system-x86 busybox-static rdma-core ibverbs-utils ibverbs-providers
                libibverbs-dev librdmacm-dev rdmacm-utils iproute2 kmod cpio gzip
                libclang-dev pkg-config) missing=() p
    for p in "${pkgs[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if ((${#missing[@]})); then
        say "installing ${missing[*]}"
        timeout "$(left)" $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive timeout "$(left)" $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

# Fetches (never installs) the kernel package linux-image-amd64 depends on
# into the cache; sets kdir, kver, vmlinuz and qemu_tcg (the command).
ensure_kernel() {
    local kpkg="${SOFTROCE_KERNEL_PKG:-}"
    if [ -z "$kpkg" ]; then
        kpkg="$(apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -n1)"
    fi
    if [ -z "$kpkg" ]; then
        timeout "$(left)" $sudo apt-get update -qq
        kpkg="$(apt-cache depends linux-image-amd64 | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -n1)"
    fi
    [ -n "$kpkg" ] || { say "cannot find the package linux-image-amd64 depends on"; exit 1; }
    kdir="$cache/$kpkg"
    if [ ! -f "$kdir/.ready" ]; then
        say "fetching $kpkg"
        rm -rf "$kdir" && mkdir -p "$kdir/root"
        (cd "$kdir" && timeout "$(left)" apt-get download -q "$kpkg" >/dev/null)
        dpkg-deb -x "$kdir"/*.deb "$kdir/root"
        rm -f "$kdir"/*.deb
        kver="$(ls "$kdir/root/lib/modules" | head -n1)"
        depmod -b "$kdir/root" "$kver"
        touch "$kdir/.ready"
    fi
    kver="$(ls "$kdir/root/lib/modules" | head -n1)"
    vmlinuz="$kdir/root/boot/vmlinuz-$kver"
    [ -f "$vmlinuz" ] || { say "no kernel image in $kpkg"; exit 1; }
    # qemu under TCG (a stock kernel hangs under this host's KVM); callers
    # add memory, initrd, NICs, shares and -append "$kargs ...".
    qemu_tcg=(qemu-system-x86_64 -accel tcg,thread=multi -cpu max -smp 2
              -nographic -no-reboot -kernel "$vmlinuz")
    kargs='console=ttyS0 quiet panic=-1'
}

# A fresh initramfs staging directory with busybox; sets stage (removed on
# exit) and resets the module list.
new_stage() {
    stage="$(mktemp -d "${TMPDIR:-/tmp}/softroce.XXXXXX")"
    trap 'rm -rf "$stage"' EXIT
    mkdir -p "$stage"/{bin,sbin,tests,proc,sys,dev,tmp,etc/libibverbs.d,lib/modules}
    cp "$(command -v busybox)" "$stage/bin/busybox"
    mods_order=()
}

# Copy a file and every library ldd lists for it, at the same paths.
copy_with_libs() {
    local f="$1" dst="$2"
    mkdir -p "$(dirname "$stage$dst")"
    cp -L "$f" "$stage$dst"
    ldd "$f" 2>/dev/null | grep -o '/[^ ]*' | while read -r lib; do
        [ -e "$stage$lib" ] && continue
        mkdir -p "$stage$(dirname "$lib")"
        cp -L "$lib" "$stage$lib"
    done
}

# The rdma/ibv tools, libgcc_s (glibc dlopens it for thread exit; ldd does
# not list it) and the rxe provider with its .driver file.
stage_rdma_userland() {
    local tool gcc_s provider
    for tool in ibv_devices ibv_devinfo rdma; do
        copy_with_libs "$(command -v $tool)" "/bin/$tool"
    done
    gcc_s="$(ldconfig -p | sed -n 's/.*libgcc_s.so.1 (libc6,x86-64) => \(.*\)/\1/p' | head -n1)"
    copy_with_libs "$gcc_s" "$gcc_s"
    provider="$(ls /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so | head -n1)"
    copy_with_libs "$provider" "$provider"
    cp /etc/libibverbs.d/rxe.driver "$stage/etc/libibverbs.d/"
}

# Adds a module and its dependencies (from modules.dep) to the initramfs in
# load order, decompressed so busybox insmod can load it.
add_mod() {
    local name="$1" path dep
    path="$(grep -E "(^|/)$name\.ko(\.[a-z]+)?:" "$kdir/root/lib/modules/$kver/modules.dep" | head -n1 | cut -d: -f1)"
    [ -n "$path" ] || { say "module $name not in $kdir"; exit 1; }
    for dep in $(grep -E "^$path:" "$kdir/root/lib/modules/$kver/modules.dep" | cut -d: -f2); do
        add_mod "$(basename "$dep" | sed 's/\.ko.*//')"
    done
    local m
    for m in "${mods_order[@]:-}"; do [ "$m" = "$name" ] && return 0; done
    mods_order+=("$name")
    local src="$kdir/root/lib/modules/$kver/$path" out="$stage/lib/modules/$name.ko"
    case "$src" in
        *.xz) xz -dc "$src" >"$out" ;;
        *.zst) zstd -qdc "$src" >"$out" ;;
        *.gz) gzip -dc "$src" >"$out" ;;
        *) cp "$src" "$out" ;;
    esac
}

# Writes modules.order and packs the stage into $1 (gzip cpio newc).
pack_initrd() {
    printf '%s\n' "${mods_order[@]}" >"$stage/modules.order"
    (cd "$stage" && find . | cpio -o -H newc --quiet | gzip -1 >"$1")
}

# An initramfs that boots into this host's own root file system, shared
# read-only over 9p (virtio), with fresh tmpfs on /tmp, /run, /dev/shm and
# the guest's own /proc, /sys, /dev: the guest runs the host's binaries (the
# venv's Python with TensorFlow, the cargo test binaries) against its own
# kernel and its own rxe0. The guest's settings come from the kernel command
# line (the kernel hands unknown name=value words to /init as environment):
#   RDEV_NET  "dev=addr/len,..." for the NICs, each gets rxeN ("eth0=10.0.2.15/24")
#   RDEV_RUN  a script on the host file system, run as root in the chroot
# Markers on the console: "=== SOFTROCE-READY" before RDEV_RUN, and
# "=== SOFTROCE-EXIT-CODE n" after it.
build_hostroot_initrd() {
    local out="$1" m
    new_stage
    stage_rdma_userland
    for m in virtio_pci virtio_net crc32_generic rdma_rxe rdma_ucm 9pnet_virtio 9p; do add_mod "$m"; done
    mkdir -p "$stage/host"
    cat >"$stage/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/sbin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do insmod /lib/modules/$m.ko || echo "insmod $m failed"; done
ip link set lo up
i=0
for w in $(echo "$RDEV_NET" | tr ',' ' '); do
    dev="${w%%=*}"; addr="${w#*=}"
    ip link set "$dev" up; ip addr add "$addr" dev "$dev"
    rdma link add "rxe$i" type rxe netdev "$dev" || echo "rdma link add on $dev failed"
    i=$((i + 1))
done
rdma link show
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 hostroot /host || echo "9p mount failed"
mount -t proc proc /host/proc; mount -t sysfs sys /host/sys; mount -t devtmpfs dev /host/dev
mkdir -p /host/dev/shm  # devtmpfs has no shm directory
mount -t tmpfs tmp /host/tmp; mount -t tmpfs run /host/run; mount -t tmpfs shm /host/dev/shm
ulimit -l unlimited
echo "=== SOFTROCE-READY $(cut -d' ' -f1 /proc/uptime)"
rc=0
HOME=/tmp PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin chroot /host /bin/bash "$RDEV_RUN" || rc=$?
echo "=== SOFTROCE-EXIT-CODE $rc"
poweroff -f
INIT
    chmod +x "$stage/init"
    pack_initrd "$out"
}

# qemu arguments sharing the host's root read-only with build_hostroot_initrd.
hostroot_share=(-virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap)
