#!/usr/bin/env bash
# Run a command in a private mount namespace in which the KFD model's stand-ins
# are at the paths CRIU's amdgpu plugin uses (docs/kfd-model.md):
#   /dev                      a tmpfs holding bind mounts of the host's /dev entries, plus
#   /dev/kfd                  <- STATE/kfd
#   /dev/dri/renderD<minor>   <- STATE/renderD<minor>
#   /sys/class                a tmpfs holding bind mounts of the host's /sys/class entries, plus
#   /sys/class/kfd/kfd/topology <- TOPOLOGY (a fixture tree, tests/fixtures/topology/*)
# Nothing is created on the host's /dev or /sys: the new files live in the two tmpfs mounts,
# which exist only in the namespace.
#   usage: unshare -m --propagation private tests/criu/kfd_ns.sh STATE TOPOLOGY SCRATCH cmd...
set -euo pipefail
state=$1 topo=$2 scratch=$3
shift 3
[ "$(readlink /proc/self/ns/mnt)" != "$(readlink /proc/1/ns/mnt)" ] || {
    echo "kfd_ns.sh: refusing to run in the host's mount namespace (use unshare -m)" >&2; exit 2; }

replicate() {  # replicate DIR's entries from OLD (a bind of the original) into DIR (a fresh tmpfs)
    local old=$1 dir=$2 e name
    for e in "$old"/* "$old"/.[!.]*; do
        [ -e "$e" ] || [ -L "$e" ] || continue
        name=${e##*/}
        if [ -L "$e" ]; then cp -P "$e" "$dir/$name"
        elif [ -d "$e" ]; then mkdir "$dir/$name"; mount --rbind "$e" "$dir/$name"
        else touch "$dir/$name"; mount --bind "$e" "$dir/$name"; fi
    done
}

mkdir -p "$scratch/olddev" "$scratch/oldclass"
mount --rbind /dev "$scratch/olddev"
mount -t tmpfs -o mode=755 kfd-model-dev /dev
replicate "$scratch/olddev" /dev
mkdir -p /dev/dri
touch /dev/kfd
mount --bind "$state/kfd" /dev/kfd
for r in "$state"/renderD*; do
    touch "/dev/dri/${r##*/}"
    mount --bind "$r" "/dev/dri/${r##*/}"
done
mount --rbind /sys/class "$scratch/oldclass"
mount -t tmpfs -o mode=755 kfd-model-class /sys/class
replicate "$scratch/oldclass" /sys/class
mkdir -p /sys/class/kfd/kfd/topology
mount --bind "$topo" /sys/class/kfd/kfd/topology
exec "$@"
