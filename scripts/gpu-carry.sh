#!/usr/bin/env bash
# Prepares carry/ (ignored by git) for a machine with a GPU and PyTorch 2.x
# but no package registry: what scaletrain needs beyond libtorch, taken from
# Debian. Header-only libraries are copied with their CMake package files;
# compiled ones travel as Debian's source tarballs and are built there by
# scripts/check-gpu.sh with libtorch's C++ ABI flag (a Debian binary built
# for the other std::string ABI would not link). Run here, as root, then hand
# carry/ to the device tool (`carry: ["carry"]`, at most 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
out=carry
rm -rf "$out"
mkdir -p "$out/prefix/include" "$out/prefix/share/cmake" "$out/src"

# Header-only: nlohmann-json, CLI11 (with their relocatable CMake files), and
# the Gloo headers ProcessGroupGloo.hpp includes (not in PyTorch's wheel).
cp -r /usr/include/nlohmann /usr/include/CLI /usr/include/gloo "$out/prefix/include/"
cp -r /usr/share/cmake/nlohmann_json /usr/share/cmake/CLI11 "$out/prefix/share/cmake/"
# GoogleTest's sources (Debian's googletest package).
cp -r /usr/src/googletest "$out/src/googletest"

# Sources of the compiled libraries, from Debian's archive (deb-src through a
# private apt directory, so the machine's own apt setup is left alone).
apt_dir=$(mktemp -d)
trap 'rm -rf "$apt_dir"' EXIT
mkdir -p "$apt_dir/sources.list.d" "$apt_dir/lists/partial"
cat > "$apt_dir/sources.list.d/debian-src.sources" <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
apt_opts=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$apt_dir/sources.list.d"
          -o "Dir::State::Lists=$apt_dir/lists" -o "Debug::NoLocking=1")
apt-get "${apt_opts[@]}" update -qq
(cd "$apt_dir" && apt-get "${apt_opts[@]}" source --download-only -qq yaml-cpp pcre2 utf8proc zlib libzstd)
for pkg in yaml-cpp pcre2 utf8proc zlib libzstd; do
  tarball=$(ls "$apt_dir"/${pkg}_*.orig.tar.* | head -1)
  cp "$tarball" "$out/src/"
done
du -sh "$out"
size=$(du -sm "$out" | cut -f1)
if ((size > 60)); then echo "carry/ is ${size} MiB: more than the device tool moves" >&2; exit 1; fi
ls "$out/src"
