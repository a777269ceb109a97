#!/usr/bin/env bash
# Print the path of a free-threaded CPython 3.13 (configured with --disable-gil), building it
# first when PREFIX does not hold a working one.
#
#   tools/free-threaded-python.sh [PREFIX]           default PREFIX: ~/.cache/feedline/python3.13t
#   tools/free-threaded-python.sh --fetch-only DIR   download and unpack the source into DIR only
#
# PyPI has no interpreters and Debian 12 packages none without the GIL, and this project's
# machines reach only package registries, not python.org: the source is the upstream tarball
# that Debian's source package of python3.13 carries (Debian 13 first, then newer suites),
# fetched with apt-get through a private apt state (the machine's apt sources are not touched).
# It is built as upstream builds it, without Debian's patches: about 13 minutes on 2 cores.
# Build dependencies missing from the machine are installed with apt-get (root or sudo).
# Progress goes to stderr; the interpreter's path is the only line on stdout.
set -euo pipefail

say() { echo "free-threaded-python: $*" >&2; }
die() {
    say "$*"
    exit 1
}

fetch_only=""
if [ "${1:-}" = "--fetch-only" ]; then
    fetch_only="${2:?--fetch-only needs a folder}"
    set -- # nothing else
fi
prefix="${1:-$HOME/.cache/feedline/python3.13t}"
python="$prefix/bin/python3.13t"
suites="${FEEDLINE_FT_SUITES:-trixie forky sid}"

# A usable interpreter: the GIL off, and the modules that a half-finished install would lack.
usable() {
    "$1" -c 'import sys, ssl, sqlite3, ctypes, lzma, bz2, zlib, venv; sys.exit(sys._is_gil_enabled())' \
        >/dev/null 2>&1
}

as_root() {
    if [ "$(id -u)" = 0 ]; then
        "$@"
    elif command -v sudo >/dev/null; then
        sudo "$@"
    else
        die "needs root (or sudo) for: $*"
    fi
}

debian_mirror() {
    local m="${FEEDLINE_DEBIAN_MIRROR:-}"
    [ -n "$m" ] || m=$(awk '$1 == "URIs:" && $2 ~ /debian\/?$/ {print $2; exit}' \
        /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
    [ -n "$m" ] || m=$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++)
        if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' /etc/apt/sources.list 2>/dev/null || true)
    echo "${m:-http://deb.debian.org/debian}"
}

# Download python3.13's source package into $1 and unpack its upstream tarball there;
# print the source tree's path.
fetch_source() {
    local dir=$1 mirror suite version tarball log
    mirror=$(debian_mirror)
    local state="$dir/apt-state"
    mkdir -p "$state/lists/partial" "$state/parts"
    local apt=(-o "Dir::Etc::SourceList=$state/sources.list" -o "Dir::Etc::SourceParts=$state/parts"
        -o "Dir::State::Lists=$state/lists" -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
        -o "APT::Sandbox::User=root" -qq)
    for suite in $suites; do
        echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main" \
            >"$state/sources.list"
        log="$dir/apt-$suite.log"
        if ! apt-get "${apt[@]}" --error-on=any update >"$log" 2>&1; then
            say "no source index of $suite from $mirror: $(grep -m 1 '^[EW]:' "$log")"
            continue
        fi
        # The index can name versions whose files the mirror no longer has: newest first.
        for version in $(apt-cache "${apt[@]}" showsrc python3.13 2>/dev/null |
            awk '$1 == "Version:" {print $2}' | sort -Vru); do
            if (cd "$dir" && apt-get "${apt[@]}" source --download-only "python3.13=$version") \
                >>"$log" 2>&1; then
                tarball=$(ls "$dir"/python3.13_*.orig.tar.xz)
                tar -xf "$tarball" -C "$dir"
                say "source: python3.13 $version of Debian $suite"
                ls -d "$dir"/Python-3.13.*/
                return 0
            fi
            say "python3.13 $version of $suite could not be downloaded"
        done
        say "no python3.13 source package in $suite"
    done
    die "no python3.13 source could be downloaded from $mirror (suites: $suites); see $dir/apt-*.log"
}

if [ -n "$fetch_only" ]; then
    mkdir -p "$fetch_only"
    fetch_source "$(cd "$fetch_only" && pwd)"
    exit 0
fi

if usable "$python"; then
    echo "$python"
    exit 0
fi

# One build at a time per prefix; whoever waited finds the interpreter made.
mkdir -p "$(dirname "$prefix")"
exec 9>"$prefix.lock"
flock 9
if usable "$python"; then
    echo "$python"
    exit 0
fi
[ -e "$python" ] && say "$python is not a complete free-threaded build: building it again"

packages=(build-essential pkg-config xz-utils libssl-dev zlib1g-dev libffi-dev libbz2-dev
    liblzma-dev libsqlite3-dev libreadline-dev libncurses-dev uuid-dev libgdbm-dev)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    as_root apt-get update -qq >/dev/null
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/feedline-ft.XXXXXX")
src=$(fetch_source "$work")
step() {  # $1: what, then the command; its output goes to $work/$1.log
    local log="$work/$1.log"
    say "$1 ($(date +%T))"
    if ! (cd "$src" && "${@:2}") >"$log" 2>&1; then
        tail -n 30 "$log" >&2
        die "$1 failed: the whole log is $log"
    fi
}
say "building into $prefix (about 13 minutes on 2 cores)"
step configure ./configure --disable-gil --prefix="$prefix" --with-ensurepip=install
step make make -j"$(nproc)"
step install make install
usable "$python" || die "$python was installed but is not a complete free-threaded build"
rm -rf "$work"
say "done ($(date +%T))"
echo "$python"
