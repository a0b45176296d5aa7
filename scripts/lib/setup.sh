# Shared set-up for scripts/test.sh and scripts/demo.sh: installs the Debian packages the build
# needs (only those missing; `apt-get update` at most once) and configures + builds the tree.
# Source it; it defines functions and changes nothing by itself.

KVSTASH_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
KVSTASH_BUILD_DIR="${KVSTASH_BUILD_DIR:-$KVSTASH_ROOT/build}"

# Every Debian package the build and the tests use. Keep in step with the README.
KVSTASH_PACKAGES=(
  build-essential cmake ninja-build pkg-config clang-format clang clang-tidy libclang-rt-dev python3
  libgtest-dev libgmock-dev libbenchmark-dev
  libspdlog-dev libfmt-dev libxxhash-dev libcli11-dev
  librocksdb-dev nlohmann-json3-dev fio util-linux
  libucx-dev ucx-utils libasio-dev libprotobuf-dev protobuf-compiler
  prometheus-cpp-dev libcpp-httplib-dev libssl-dev curl etcd-server
  redis-server memcached libhiredis-dev libmemcached-dev
  libzmq3-dev libmsgpack-dev python3-zmq python3-msgpack
  pybind11-dev python3-dev python3-pytest python3-numpy python3-torch python3-pip python3-setuptools
  python3-venv
)

# A step's heading, with the seconds since the script started (bash's SECONDS).
kvstash_log() { printf '\033[1m== %s (at %ds)\033[0m\n' "$*" "$SECONDS"; }

kvstash_install_deps() {
  local missing=()
  local pkg
  for pkg in "${KVSTASH_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$pkg")
    fi
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    kvstash_log "dependencies: all ${#KVSTASH_PACKAGES[@]} packages present"
    return 0
  fi
  kvstash_log "dependencies: installing ${missing[*]}"
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
      sudo=(sudo)
    else
      echo "error: missing packages (${missing[*]}) and not root, no sudo to install them" >&2
      return 1
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  # Update the package lists only when an install from the current lists fails.
  if ! "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"; then
    "${sudo[@]}" apt-get update
    "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
  fi
}

# kvstash_build [BUILD_DIR] [cmake -D options...] [-- targets...]: configures and builds.
# Every build compiles with the same flags unless its options say otherwise (a later -D wins):
# -O2 with line tables only (-g1: enough for a backtrace, a sixth less compile time than -g), so
# scripts/test.sh after scripts/demo.sh rebuilds none of the libraries the demo built.
kvstash_build() {
  local dir="$1"
  shift
  local options=("-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG") targets=()
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do options+=("$1"); shift; done
  [ "$#" -gt 0 ] && shift
  targets=("$@")
  local build_type="${KVSTASH_BUILD_TYPE:-RelWithDebInfo}"
  kvstash_log "configure ($build_type) in $dir"
  cmake -S "$KVSTASH_ROOT" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE="$build_type" "${options[@]}"
  kvstash_log "build${targets[*]:+ ${targets[*]}}"
  if [ "${#targets[@]}" -gt 0 ]; then
    cmake --build "$dir" --parallel "$(nproc)" --target "${targets[@]}"
  else
    cmake --build "$dir" --parallel "$(nproc)"
  fi
}
