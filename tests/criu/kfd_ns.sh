#!/usr/bin/env bash
# Run a command in a private mount namespace in which the KFD model's stand-ins
# are at the paths CRIU's amdgpu plugin uses (docs/kfd-model.md):
#   /dev                      a tmpfs holding bind mounts of the host's /dev entries, plus
#   /dev/kfd                  <- STATE/kfd
#   /dev/dri/renderD<minor>   <- STATE/renderD<minor>
#   /sys/class                a tmpfs holding bind mounts of the host's /sys/class entries, plus
#   /sys/class/kfd/kfd/topology <- TOPOLOGY (a fixture tree, tests/fixtures/topology/*)
# Nothing is created on the host's /dev or /sys: the new files live in tmpfs mounts (/dev,
# /dev/dri, /sys/class) which exist only in the namespace; a host directory reached through a
# bind mount (such as the host's own /dev/dri) is never written, and a host device file that
# is covered (such as a real /dev/kfd) is never opened.
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

private_dir() {  # DIR (absent, or a bind of the host's) becomes a tmpfs of the namespace with DIR's entries
    local dir=$1 old=$2
    if [ -d "$dir" ]; then
        mkdir -p "$old"
        mount --rbind "$dir" "$old"
        mount -t tmpfs -o mode=755 kfd-model "$dir"
        replicate "$old" "$dir"
    else
        mkdir "$dir"
    fi
}
mount_file() {  # bind SRC over DST, creating DST only when absent (an existing one is a host file: not opened)
    [ -e "$2" ] || touch "$2"
    mount --bind "$1" "$2"
}

mkdir -p "$scratch/olddev" "$scratch/oldclass"
mount --rbind /dev "$scratch/olddev"
mount -t tmpfs -o mode=755 kfd-model-dev /dev
replicate "$scratch/olddev" /dev
private_dir /dev/dri "$scratch/olddri"     # the host's /dev/dri, if any, is an rbind: never create in it
mount_file "$state/kfd" /dev/kfd
for r in "$state"/renderD*; do
    mount_file "$r" "/dev/dri/${r##*/}"
done
mount --rbind /sys/class "$scratch/oldclass"
mount -t tmpfs -o mode=755 kfd-model-class /sys/class
replicate "$scratch/oldclass" /sys/class
mkdir -p /sys/class/kfd/kfd/topology
mount --bind "$topo" /sys/class/kfd/kfd/topology
exec "$@"
