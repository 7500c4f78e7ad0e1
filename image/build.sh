#!/usr/bin/env bash
# Builds the kilotun container image as an OCI archive:
#
#   sudo bash image/build.sh [--platforms amd64|arm64|armv7|all|LIST] [OUT.tar]
#
# Everything comes from Debian bookworm's archive and this repository; no base image is pulled.
#   1. The binaries: kg, kgctl and kilotun of each platform (amd64: cargo build --release, reused
#      when already built; arm64 and armv7: scripts/cross-build.sh, see below).
#   2. mmdebstrap unpacks the Debian packages the image needs, of the platform's architecture,
#      into a staging tree.
#   3. The image's root file system is assembled from that tree: only the programs the image
#      contract names (see image/README.md), the shared libraries they load (resolved with the
#      dynamic loader itself), the plugins and data they read, and each package's copyright file.
#      For arm64 and armv7 those steps run the tree's own programs under qemu-user through
#      binfmt_misc (Debian's qemu-user-static registers it).
#   4. buildah commits two layers (the Debian part, then kilotun's binaries) with every timestamp
#      set to the commit time of HEAD. One platform gives an OCI archive of that image; several
#      give one OCI image index (a multi-arch name: a runtime pulls the image of its own
#      platform), tagged kilotun:<crate version> either way.
# Two builds of the same commit, toolchain and package versions give the same image digest, per
# platform and for the index (tests/real/image.rs checks it). The archive's digest, sizes per platform
# and package list are printed at the end.
#
# Platforms: amd64 (linux/amd64, the default), arm64 (linux/arm64/v8), armv7 (linux/arm/v7, Debian
# armhf), `all` for the three, or a comma-separated list. KILOTUN_IMAGE_PLATFORMS sets the same.
#
# Environment: KILOTUN_IMAGE_NAME (default kilotun:<version>), DEBIAN_MIRROR (default the
# mirror apt already uses), SOURCE_DATE_EPOCH (default the commit time of HEAD),
# KILOTUN_IMAGE_KEEP (set: keep the work directory, to look at a failed build), KILOTUN_BIN_DIR
# (take amd64's kg, kgctl and kilotun from there instead of building them: the tests pass the
# ones `cargo test --release` built, which differ from `cargo build`'s by dev-dependency
# features), KILOTUN_BIN_DIR_ARM64 and KILOTUN_BIN_DIR_ARMV7 (the same for the other two; by
# default target/<triple>/<KILOTUN_CROSS_PROFILE, default release>/, built with
# `scripts/cross-build.sh --target arm64|armv7 --profile <that profile>` when missing).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
log() { printf '[image %s] %s\n' "$(date +%T)" "$*" >&2; }
die() {
  echo "image/build.sh: $*" >&2
  exit 1
}

platforms=${KILOTUN_IMAGE_PLATFORMS:-amd64}
out=
while [ $# -gt 0 ]; do
  case "$1" in
  --platforms) platforms=${2:?--platforms needs amd64, arm64, armv7, all or a list}; shift 2 ;;
  --platforms=*) platforms=${1#*=}; shift ;;
  -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
  -*) die "unknown option $1 (see --help)" ;;
  *) [ -z "$out" ] || die "one output archive only (got $out and $1)"; out=$1; shift ;;
  esac
done
[ "$platforms" != all ] || platforms=amd64,arm64,armv7
IFS=, read -r -a platform_list <<<"$platforms"
for p in "${platform_list[@]}"; do
  case "$p" in amd64 | arm64 | armv7) ;; *) die "unknown platform '$p' in --platforms (amd64, arm64, armv7 or all)" ;; esac
done

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
# The name Kubernetes gives the manifests' short image name kilotun:<version>.
name=${KILOTUN_IMAGE_NAME:-docker.io/library/kilotun:$version}
out=${out:-$repo/target/image/kilotun-$version.oci.tar}
mkdir -p "$(dirname "$out")"
out=$(cd "$(dirname "$out")" && pwd)/$(basename "$out")

[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap and buildah write file ownership as root)"

# What each platform is called by Debian, the GNU toolchain, the OCI image config and the
# dynamic loader; the Rust target its binaries are built for; the qemu-user binfmt entry that runs
# its programs here; and the objcopy that knows its ELF files, with the Debian package holding it.
platform_facts() {
  case "$1" in
  amd64) debarch=amd64 gnu=x86_64-linux-gnu oci_arch=amd64 oci_variant='' loader=/lib64/ld-linux-x86-64.so.2 \
    triple=x86_64-unknown-linux-gnu binfmt=qemu-x86_64 objcopy_package=binutils-x86-64-linux-gnu ;;
  arm64) debarch=arm64 gnu=aarch64-linux-gnu oci_arch=arm64 oci_variant=v8 loader=/lib/ld-linux-aarch64.so.1 \
    triple=aarch64-unknown-linux-gnu binfmt=qemu-aarch64 objcopy_package=binutils-aarch64-linux-gnu ;;
  armv7) debarch=armhf gnu=arm-linux-gnueabihf oci_arch=arm oci_variant=v7 loader=/lib/ld-linux-armhf.so.3 \
    triple=armv7-unknown-linux-gnueabihf binfmt=qemu-arm objcopy_package=binutils-arm-linux-gnueabihf ;;
  esac
  # The host's own binutils know its platform; a foreign one needs the cross objcopy.
  if [ "$debarch" = "$host_arch" ]; then
    objcopy=objcopy objcopy_package=binutils
  else
    objcopy=$gnu-objcopy
  fi
}
host_arch=$(dpkg --print-architecture 2>/dev/null || uname -m)

# The tools, from Debian, when missing.
need=()
for tool in mmdebstrap:mmdebstrap buildah:buildah skopeo:skopeo; do
  command -v "${tool%%:*}" >/dev/null || need+=("${tool#*:}")
done
for p in "${platform_list[@]}"; do
  platform_facts "$p"
  command -v "$objcopy" >/dev/null || need+=("$objcopy_package")
done
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >/dev/null
fi
# A foreign platform's programs run here under qemu-user: its binfmt_misc entry must be there
# (the F flag makes it work inside the staging chroot).
for p in "${platform_list[@]}"; do
  platform_facts "$p"
  [ "$debarch" != "$host_arch" ] || continue
  if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null ||
      die "binfmt_misc is not mounted and cannot be (mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc)"
  fi
  [ -e "/proc/sys/fs/binfmt_misc/$binfmt" ] || update-binfmts --enable "$binfmt" >/dev/null 2>&1 || true
  grep -qx enabled "/proc/sys/fs/binfmt_misc/$binfmt" 2>/dev/null ||
    die "the $p image runs its $debarch programs during the build through qemu-user, and binfmt_misc has no $binfmt entry: install the Debian package qemu-user-static (with binfmt-support)"
done

epoch=${SOURCE_DATE_EPOCH:-$(git -C "$repo" log -1 --format=%ct 2>/dev/null || echo 0)}
# The Debian mirror this machine's apt uses (DEBIAN_MIRROR or KILOTUN_DEBIAN_MIRROR overrides it).
# shellcheck source=scripts/debian-mirror.sh
source "$repo/scripts/debian-mirror.sh"
mirror=$(require_mirror "${DEBIAN_MIRROR:-${KILOTUN_DEBIAN_MIRROR:-}}")

work=$(mktemp -d /tmp/kilotun-image.XXXXXX)
cleanup() {
  if [ -n "${KILOTUN_IMAGE_KEEP:-}" ]; then
    echo "image/build.sh: kept $work" >&2
    return
  fi
  buildah --root "$work/storage" --runroot "$work/run" --storage-driver vfs rm -a >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
b() { buildah --root "$work/storage" --runroot "$work/run" --storage-driver vfs "$@"; }

# 1. The binaries of a platform: prints the directory holding its kg, kgctl and kilotun.
binaries_of() {
  local p=$1 dir profile
  case "$p" in
  amd64)
    if [ -n "${KILOTUN_BIN_DIR:-}" ]; then
      echo "$KILOTUN_BIN_DIR"
      return
    fi
    log "cargo build --release (kg, kgctl, kilotun)"
    cargo build --release --locked --bin kg --bin kgctl --bin kilotun >&2
    echo "$repo/target/release"
    ;;
  arm64 | armv7)
    local var=KILOTUN_BIN_DIR_${p^^}
    if [ -n "${!var:-}" ]; then
      echo "${!var}"
      return
    fi
    profile=${KILOTUN_CROSS_PROFILE:-release}
    platform_facts "$p"
    dir=$repo/target/$triple/$profile
    if [ ! -x "$dir/kg" ] || [ ! -x "$dir/kgctl" ] || [ ! -x "$dir/kilotun" ]; then
      log "scripts/cross-build.sh --target $p --profile $profile"
      bash "$repo/scripts/cross-build.sh" --target "$p" --profile "$profile" >&2
    fi
    echo "$dir"
    ;;
  esac
}

# 2-4 for one platform: commits its image as kilotun-<platform> in the work storage and prints
# that name.
build_platform() {
  local p=$1 bins stage root bin_root
  platform_facts "$p"
  bins=$(binaries_of "$p")
  # Set only now: some crates' build scripts watch it, and the binaries should be the ones
  # `cargo test --release` already built.
  export SOURCE_DATE_EPOCH=$epoch

  # 2. Debian's packages, unpacked (no maintainer scripts run; the assembly below does their part).
  local packages=libc6,libgcc-s1,busybox,iptables,nftables,graphviz,fonts-dejavu-core,containernetworking-plugins
  log "$p: mmdebstrap bookworm $debarch from $mirror: $packages"
  stage=$work/$p/stage
  mkdir -p "$work/$p"
  mmdebstrap --quiet --variant=extract --architectures="$debarch" --skip=cleanup/apt/cache \
    --include="$packages" bookworm "$stage" "$mirror" >&2

  # 3. The root file system.
  root=$work/$p/root
  mkdir -p "$root"
  # Resolves a path inside the stage, following its symlinks there (not on this host).
  stage_realpath() { chroot "$stage" /bin/busybox readlink -f "$1"; }
  # Copies a path from the stage into the root, keeping symlinks as they are, and the file a
  # symlink points to as well.
  take() {
    local path target
    for path in "$@"; do
      mkdir -p "$root$(dirname "$path")"
      cp -a "$stage$path" "$root$path"
      if [ -L "$stage$path" ]; then
        target=$(stage_realpath "$path")
        if [ ! -e "$root$target" ]; then take "$target"; fi
      fi
    done
  }
  # Copies the shared libraries ELF files load, as the stage's own dynamic loader resolves them:
  # the real file, and the name it is loaded by when that is a symlink.
  take_libraries() {
    local file lib
    for file in "$@"; do
      chroot "$stage" "$loader" --list "$file" |
        sed -n 's/.*=> \(\/[^ ]*\) .*/\1/p; s/^[[:space:]]*\(\/[^ ]*\) (0x.*/\1/p' |
        while read -r lib; do
          take "$lib"
        done
    done
  }

  # The file-system skeleton.
  (
    cd "$root"
    mkdir -p bin sbin usr/bin usr/sbin usr/local/bin "usr/lib/$gnu" etc tmp root var/lib/kilo run/wireguard opt/cni/bin \
      usr/share/kilotun
    ln -s usr/lib lib
    if [ "$p" = amd64 ]; then
      mkdir -p usr/lib64
      ln -s usr/lib64 lib64
    fi
    ln -s ../run var/run
    chmod 1777 tmp
    chmod 0700 root var/lib/kilo
  )
  take "$loader"

  # A shell and the few commands the install-cni init container and an operator's `kubectl exec`
  # use, from busybox.
  take /bin/busybox
  take_libraries /bin/busybox
  local applet
  for applet in sh cp mv rm ln ls cat echo mkdir chmod grep sed head tail wc env ps test true false sleep; do
    ln -s busybox "$root/bin/$applet"
  done

  # iptables with both back ends, and the extensions they load.
  take /usr/sbin/xtables-legacy-multi /usr/sbin/xtables-nft-multi "/usr/lib/$gnu/xtables"
  local family suffix
  for family in iptables ip6tables; do
    for suffix in "" -save -restore; do
      take "/usr/sbin/$family-legacy$suffix" "/usr/sbin/$family-nft$suffix"
      # The plain names pick the back end the host's rules are in, as kg does.
      ln -s iptables-wrapper "$root/usr/sbin/$family$suffix"
    done
  done
  install -m 0755 "$repo/image/iptables-wrapper" "$root/usr/sbin/iptables-wrapper"
  # shellcheck disable=SC2046 # one argument per extension.
  take_libraries /usr/sbin/xtables-legacy-multi /usr/sbin/xtables-nft-multi \
    $(cd "$stage" && ls "usr/lib/$gnu"/xtables/*.so | sed 's|^|/|')
  take /etc/ethertypes /etc/protocols /etc/services
  # nft: kg's firewall where the host's rules are in nf_tables (--firewall=auto).
  take /usr/sbin/nft
  take_libraries /usr/sbin/nft

  # Graphviz: dot, the layouts kg's /graph offers (dot, and circo/neato/twopi/fdp from the neato
  # plugin), SVG and DOT output from the core plugin, PNG through cairo, and one font.
  local graphviz_plugins="core dot_layout neato_layout pango" plugin
  take /usr/bin/dot
  for plugin in $graphviz_plugins; do
    take "/usr/lib/$gnu/graphviz/libgvplugin_$plugin.so.6" "/usr/lib/$gnu/graphviz/libgvplugin_$plugin.so.6.0.0"
  done
  # shellcheck disable=SC2046 # one argument per plugin.
  take_libraries /usr/bin/dot \
    $(for plugin in $graphviz_plugins; do echo "/usr/lib/$gnu/graphviz/libgvplugin_$plugin.so.6"; done)
  # Graphviz finds its plugins through a registry that `dot -c` writes (graphviz's own postinst).
  chroot "$root" /usr/bin/dot -c
  take /etc/fonts /usr/share/fontconfig /usr/share/fonts/truetype/dejavu

  # The CNI plugins the manifests' conflist names, where the install-cni init container copies from.
  for plugin in bridge host-local loopback portmap; do
    cp -a "$stage/usr/lib/cni/$plugin" "$root/opt/cni/bin/$plugin"
  done

  # Minimal identity and name-service files.
  printf 'root:x:0:0:root:/root:/bin/sh\n' >"$root/etc/passwd"
  printf 'root:x:0:\n' >"$root/etc/group"
  printf 'hosts: files dns\nnetworks: files\nprotocols: files\nservices: files\n' >"$root/etc/nsswitch.conf"

  # kilotun's binaries go in their own layer, below; each must be of this platform.
  bin_root=$work/$p/bin-root
  mkdir -p "$bin_root/usr/local/bin"
  local bin
  for bin in kg kgctl kilotun; do
    [ -f "$bins/$bin" ] || die "$p: $bins/$bin is missing"
    "$objcopy" --strip-all "$bins/$bin" "$bin_root/usr/local/bin/$bin" ||
      die "$p: $objcopy cannot read $bins/$bin: is it a $debarch binary?"
  done
  # Their libraries (libc6 and libgcc-s1 only: they were built against bookworm's) go in the base
  # layer.
  mkdir -p "$stage/tmp/kilotun"
  cp "$bin_root"/usr/local/bin/* "$stage/tmp/kilotun/"
  take_libraries /tmp/kilotun/kg /tmp/kilotun/kgctl /tmp/kilotun/kilotun

  # The license of every Debian package that contributed a file, and the list of those packages
  # with their versions (the extract variant leaves no dpkg database; the .debs tell).
  find "$root" \( -type f -o -type l \) -printf '/%P\n' | sed 's|^/lib/|/usr/lib/|' | sort -u >"$work/$p/files"
  local deb pkg
  for deb in "$stage"/var/cache/apt/archives/*.deb; do
    pkg=$(dpkg-deb -f "$deb" Package)
    dpkg-deb -c "$deb" | awk '{print $6}' | sed 's|^\.||; s|^/lib/|/usr/lib/|' | sort -u >"$work/$p/contents"
    if [ -n "$(comm -12 "$work/$p/files" "$work/$p/contents" | head -1)" ]; then
      echo "$pkg $(dpkg-deb -f "$deb" Version)"
      if [ -f "$stage/usr/share/doc/$pkg/copyright" ]; then take "/usr/share/doc/$pkg/copyright"; fi
    fi
  done | sort >"$root/usr/share/kilotun/debian-packages.txt"

  # Every file's timestamp set to SOURCE_DATE_EPOCH, so the layer bytes do not depend on when the
  # build ran.
  find "$root" "$bin_root" -exec touch --no-dereference --date="@$SOURCE_DATE_EPOCH" {} +

  # 4. The image.
  log "$p: buildah: base layer"
  local ctr
  ctr=$(b from --quiet scratch)
  b copy --quiet "$ctr" "$root/" / >/dev/null
  b commit --quiet --timestamp "$SOURCE_DATE_EPOCH" --format oci "$ctr" "kilotun-base-$p" >/dev/null
  log "$p: buildah: kilotun layer"
  ctr=$(b from --quiet "kilotun-base-$p")
  b copy --quiet "$ctr" "$bin_root/" / >/dev/null
  b config \
    --entrypoint '["/usr/local/bin/kg"]' --cmd '' \
    --env PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin \
    --os linux --arch "$oci_arch" ${oci_variant:+--variant "$oci_variant"} \
    --label "org.opencontainers.image.title=kilotun" \
    --label "org.opencontainers.image.description=Kilo's node agent (kg) with a userspace WireGuard engine" \
    --label "org.opencontainers.image.version=$version" \
    --label "org.opencontainers.image.revision=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)" \
    --label "org.opencontainers.image.licenses=Apache-2.0" \
    "$ctr"
  b commit --quiet --timestamp "$SOURCE_DATE_EPOCH" --format oci "$ctr" "kilotun-$p" >/dev/null
  unpacked[$p]=$(($(du -sk "$root" | cut -f1) + $(du -sk "$bin_root" | cut -f1)))
  # The stage is large (every unpacked .deb): gone once the image is committed.
  rm -rf "$stage"
}

declare -A unpacked
for p in "${platform_list[@]}"; do
  build_platform "$p"
done

rm -f "$out"
if [ ${#platform_list[@]} = 1 ]; then
  b tag "kilotun-${platform_list[0]}" "$name"
  b push --quiet "$name" "oci-archive:$work/plain.tar:$name"
else
  # One index naming each platform's image, pushed with the images.
  b manifest create "$name" >/dev/null
  for p in "${platform_list[@]}"; do
    platform_facts "$p"
    b manifest add --os linux --arch "$oci_arch" ${oci_variant:+--variant "$oci_variant"} \
      "$name" "containers-storage:localhost/kilotun-$p" >/dev/null
  done
  b manifest push --quiet --all "$name" "oci-archive:$work/plain.tar:$name"
fi

# containerd (`ctr images import`, which `kind load image-archive` and `k3s ctr` run) names an
# imported OCI image after the index's io.containerd.image.name annotation, and drops a full
# name in org.opencontainers.image.ref.name unless told a prefix: add the former, then pack
# the archive again in a fixed order with fixed times and owners.
mkdir "$work/archive"
tar -xf "$work/plain.tar" -C "$work/archive"
grep -q '"annotations":{"org.opencontainers.image.ref.name"' "$work/archive/index.json" ||
  die "unexpected index.json from buildah: $(cat "$work/archive/index.json")"
sed -i "s|\"annotations\":{|\"annotations\":{\"io.containerd.image.name\":\"$name\",|" "$work/archive/index.json"
tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner --format=posix \
  --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
  -cf "$out" -C "$work/archive" .

digest=$(skopeo inspect --raw "oci-archive:$out" | sha256sum | cut -d' ' -f1)
log "image $name ($platforms): digest sha256:$digest, archive $(($(stat -c %s "$out") / 1024)) KiB"
for p in "${platform_list[@]}"; do
  log "  $p: unpacked ${unpacked[$p]} KiB"
done
echo "$out"
