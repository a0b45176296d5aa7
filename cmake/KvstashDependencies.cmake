# Finds every third-party dependency once, as imported targets. All come from Debian packages
# (scripts/lib/setup.sh installs them); nothing is downloaded at configure or build time.
find_package(Threads REQUIRED)
find_package(PkgConfig REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
find_package(CLI11 REQUIRED)
pkg_check_modules(ROCKSDB REQUIRED IMPORTED_TARGET rocksdb)
find_package(nlohmann_json REQUIRED)

if(KVSTASH_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(KVSTASH_BUILD_BENCHMARKS)
  find_package(benchmark REQUIRED)
endif()

# Wire schema: protoc generates the code at build time; the lite runtime is all it needs.
pkg_check_modules(PROTOBUF_LITE REQUIRED IMPORTED_TARGET protobuf-lite)
find_program(KVSTASH_PROTOC protoc REQUIRED)
# UCX (ucp + ucs), standalone Asio (header only).
pkg_check_modules(UCX REQUIRED IMPORTED_TARGET ucx)
# Prometheus metrics of the node and the worker (prometheus-cpp's core: the metric families and
# the text format, written through kvstash::http's PrometheusWriter; kvstash::http serves them,
# not prometheus-cpp-pull's civetweb).
pkg_check_modules(PROMETHEUS REQUIRED IMPORTED_TARGET prometheus-cpp-core)
find_path(ASIO_INCLUDE_DIR asio.hpp REQUIRED)
# cpp-httplib (the request parsing and routing of kvstash's HTTP servers, kvstash::http; the
# worker's and etcd's HTTP clients). Debian ships it compiled (libcpp-httplib.so, built with
# CPPHTTPLIB_OPENSSL_SUPPORT, _ZLIB_SUPPORT and _BROTLI_SUPPORT) with a header whose structs
# change layout with those macros: code that includes httplib.h must compile with the package's
# own flags (pkg-config's), or it disagrees with the library about httplib::Request. kvstash
# serves and calls plain HTTP only; TLS is never set up.
pkg_check_modules(HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
# OpenSSL's libcrypto (which cpp-httplib links anyway): base64 for etcd's JSON gateway.
pkg_check_modules(LIBCRYPTO REQUIRED IMPORTED_TARGET libcrypto)
find_program(KVSTASH_UCX_PERFTEST ucx_perftest)
# The clients of the stores `kvstash bench peer` compares kvstash with (Redis, memcached).
# KV events (events/): ZMQ's sockets and msgpack-c's encoding, both C libraries.
pkg_check_modules(ZMQ REQUIRED IMPORTED_TARGET libzmq)
pkg_check_modules(MSGPACK REQUIRED IMPORTED_TARGET msgpack)
pkg_check_modules(HIREDIS REQUIRED IMPORTED_TARGET hiredis)
pkg_check_modules(LIBMEMCACHED REQUIRED IMPORTED_TARGET libmemcached)
