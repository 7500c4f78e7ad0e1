#!/usr/bin/env bash
# Builds the kilotun container image as an OCI archive: sudo bash image/build.sh [OUT.tar]
#
# Everything comes from Debian bookworm's archive and this repository; no base image is pulled.
#   1. cargo builds kg, kgctl and kilotun (release; reused when already built).
#   2. mmdebstrap unpacks the Debian packages the image needs into a staging tree.
#   3. The image's root file system is assembled from that tree: only the programs the image
#      contract names (see image/README.md), the shared libraries they load (resolved with the
#      dynamic loader itself), the plugins and data they read, and each package's copyright file.
#   4. buildah commits two layers (the Debian part, then kilotun's binaries) with every timestamp
#      set to the commit time of HEAD, and writes an OCI archive tagged kilotun:<crate version>.
# Two builds of the same commit, toolchain and package versions give the same image digest
# (tests/image.rs checks it). The archive's digest, sizes and package list are printed at the end.
#
# Environment: KILOTUN_IMAGE_NAME (default kilotun:<version>), DEBIAN_MIRROR (default the
# mirror apt already uses), SOURCE_DATE_EPOCH (default the commit time of HEAD),
# KILOTUN_IMAGE_KEEP (set: keep the work directory, to look at a failed build), KILOTUN_BIN_DIR
# (take kg, kgctl and kilotun from there instead of building them: the tests pass the ones
# `cargo test --release` built, which differ from `cargo build`'s by dev-dependency features).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
# The name Kubernetes gives the manifests' short image name kilotun:<version>.
name=${KILOTUN_IMAGE_NAME:-docker.io/library/kilotun:$version}
out=${1:-$repo/target/image/kilotun-$version.oci.tar}
mkdir -p "$(dirname "$out")"
out=$(cd "$(dirname "$out")" && pwd)/$(basename "$out")

if [ "$(id -u)" != 0 ]; then
  echo "image/build.sh: needs root (mmdebstrap and buildah write file ownership as root)" >&2
  exit 1
fi
log() { printf '[image %s] %s\n' "$(date +%T)" "$*" >&2; }

# The tools, from Debian, when missing.
need=()
for tool in mmdebstrap:mmdebstrap buildah:buildah skopeo:skopeo; do
  command -v "${tool%%:*}" >/dev/null || need+=("${tool#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >/dev/null
fi

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

# 1. The binaries.
if [ -n "${KILOTUN_BIN_DIR:-}" ]; then
  bins=$KILOTUN_BIN_DIR
  log "binaries from $bins"
else
  log "cargo build --release (kg, kgctl, kilotun)"
  cargo build --release --locked --bin kg --bin kgctl --bin kilotun >&2
  bins=$repo/target/release
fi
# Set only now: some crates' build scripts watch it, and the binaries should be the ones
# `cargo test --release` already built.
export SOURCE_DATE_EPOCH=$epoch

# 2. Debian's packages, unpacked (no maintainer scripts run; the assembly below does their part).
packages=libc6,libgcc-s1,busybox,iptables,graphviz,fonts-dejavu-core,containernetworking-plugins
log "mmdebstrap bookworm from $mirror: $packages"
mmdebstrap --quiet --variant=extract --skip=cleanup/apt/cache --include="$packages" bookworm "$work/stage" "$mirror" >&2
stage=$work/stage

# 3. The root file system.
root=$work/root
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
    chroot "$stage" /lib64/ld-linux-x86-64.so.2 --list "$file" |
      sed -n 's/.*=> \(\/[^ ]*\) .*/\1/p; s/^[[:space:]]*\(\/[^ ]*\) (0x.*/\1/p' |
      while read -r lib; do
        take "$lib"
      done
  done
}

# The file-system skeleton.
(
  cd "$root"
  mkdir -p bin sbin usr/bin usr/sbin usr/local/bin usr/lib/x86_64-linux-gnu usr/lib64 etc tmp root var/lib/kilo run/wireguard opt/cni/bin \
    usr/share/kilotun
  ln -s usr/lib lib
  ln -s usr/lib64 lib64
  ln -s ../run var/run
  chmod 1777 tmp
  chmod 0700 root var/lib/kilo
)
take /lib64/ld-linux-x86-64.so.2

# A shell and the few commands the install-cni init container and an operator's `kubectl exec`
# use, from busybox.
take /bin/busybox
take_libraries /bin/busybox
for applet in sh cp mv rm ln ls cat echo mkdir chmod grep sed head tail wc env ps test true false sleep; do
  ln -s busybox "$root/bin/$applet"
done

# iptables with both back ends, and the extensions they load.
take /usr/sbin/xtables-legacy-multi /usr/sbin/xtables-nft-multi /usr/lib/x86_64-linux-gnu/xtables
for family in iptables ip6tables; do
  for suffix in "" -save -restore; do
    take "/usr/sbin/$family-legacy$suffix" "/usr/sbin/$family-nft$suffix"
    # The plain names pick the back end the host's rules are in, as kg does.
    ln -s iptables-wrapper "$root/usr/sbin/$family$suffix"
  done
done
install -m 0755 "$repo/image/iptables-wrapper" "$root/usr/sbin/iptables-wrapper"
take_libraries /usr/sbin/xtables-legacy-multi /usr/sbin/xtables-nft-multi \
  $(cd "$stage" && ls usr/lib/x86_64-linux-gnu/xtables/*.so | sed 's|^|/|')
take /etc/ethertypes /etc/protocols /etc/services

# Graphviz: dot, the layouts kg's /graph offers (dot, and circo/neato/twopi/fdp from the neato
# plugin), SVG and DOT output from the core plugin, PNG through cairo, and one font.
graphviz_plugins="core dot_layout neato_layout pango"
take /usr/bin/dot
for plugin in $graphviz_plugins; do
  take "/usr/lib/x86_64-linux-gnu/graphviz/libgvplugin_$plugin.so.6" \
    "/usr/lib/x86_64-linux-gnu/graphviz/libgvplugin_$plugin.so.6.0.0"
done
take_libraries /usr/bin/dot \
  $(for plugin in $graphviz_plugins; do echo "/usr/lib/x86_64-linux-gnu/graphviz/libgvplugin_$plugin.so.6"; done)
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

# kilotun's binaries go in their own layer, below.
bin_root=$work/bin-root
mkdir -p "$bin_root/usr/local/bin"
for bin in kg kgctl kilotun; do
  objcopy --strip-all "$bins/$bin" "$bin_root/usr/local/bin/$bin"
done
# Their libraries (libc6 and libgcc-s1 only: they were built on bookworm) go in the base layer.
mkdir -p "$stage/tmp/kilotun"
cp "$bin_root"/usr/local/bin/* "$stage/tmp/kilotun/"
take_libraries /tmp/kilotun/kg /tmp/kilotun/kgctl /tmp/kilotun/kilotun

# The license of every Debian package that contributed a file, and the list of those packages
# with their versions (the extract variant leaves no dpkg database; the .debs tell).
find "$root" \( -type f -o -type l \) -printf '/%P\n' | sed 's|^/lib/|/usr/lib/|' | sort -u >"$work/files"
for deb in "$stage"/var/cache/apt/archives/*.deb; do
  pkg=$(dpkg-deb -f "$deb" Package)
  dpkg-deb -c "$deb" | awk '{print $6}' | sed 's|^\.||; s|^/lib/|/usr/lib/|' | sort -u >"$work/contents"
  if [ -n "$(comm -12 "$work/files" "$work/contents" | head -1)" ]; then
    echo "$pkg $(dpkg-deb -f "$deb" Version)"
    if [ -f "$stage/usr/share/doc/$pkg/copyright" ]; then take "/usr/share/doc/$pkg/copyright"; fi
  fi
done | sort >"$root/usr/share/kilotun/debian-packages.txt"

# Every file's timestamp set to SOURCE_DATE_EPOCH, so the layer bytes do not depend on when the
# build ran.
find "$root" "$bin_root" -exec touch --no-dereference --date="@$SOURCE_DATE_EPOCH" {} +

# 4. The image.
b() { buildah --root "$work/storage" --runroot "$work/run" --storage-driver vfs "$@"; }
log "buildah: base layer"
ctr=$(b from --quiet scratch)
b copy --quiet "$ctr" "$root/" / >/dev/null
b commit --quiet --timestamp "$SOURCE_DATE_EPOCH" --format oci "$ctr" kilotun-base >/dev/null
log "buildah: kilotun layer"
ctr=$(b from --quiet kilotun-base)
b copy --quiet "$ctr" "$bin_root/" / >/dev/null
b config \
  --entrypoint '["/usr/local/bin/kg"]' --cmd '' \
  --env PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin \
  --os linux --arch amd64 \
  --label "org.opencontainers.image.title=kilotun" \
  --label "org.opencontainers.image.description=Kilo's node agent (kg) with a userspace WireGuard engine" \
  --label "org.opencontainers.image.version=$version" \
  --label "org.opencontainers.image.revision=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)" \
  --label "org.opencontainers.image.licenses=Apache-2.0" \
  "$ctr"
b commit --quiet --timestamp "$SOURCE_DATE_EPOCH" --format oci "$ctr" "$name" >/dev/null
rm -f "$out"
b push --quiet "$name" "oci-archive:$work/plain.tar:$name"

# containerd (`ctr images import`, which `kind load image-archive` and `k3s ctr` run) names an
# imported OCI image after the index's io.containerd.image.name annotation, and drops a full
# name in org.opencontainers.image.ref.name unless told a prefix: add the former, then pack
# the archive again in a fixed order with fixed times and owners.
mkdir "$work/archive"
tar -xf "$work/plain.tar" -C "$work/archive"
grep -q '"annotations":{"org.opencontainers.image.ref.name"' "$work/archive/index.json" || {
  echo "image/build.sh: unexpected index.json from buildah: $(cat "$work/archive/index.json")" >&2
  exit 1
}
sed -i "s|\"annotations\":{|\"annotations\":{\"io.containerd.image.name\":\"$name\",|" "$work/archive/index.json"
tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner --format=posix \
  --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
  -cf "$out" -C "$work/archive" .

digest=$(skopeo inspect --format '{{.Digest}}' "oci-archive:$out")
unpacked=$(( $(du -sk "$root" | cut -f1) + $(du -sk "$bin_root" | cut -f1) ))
log "image $name: digest $digest, archive $(( $(stat -c %s "$out") / 1024 )) KiB, unpacked ${unpacked} KiB"
echo "$out"
