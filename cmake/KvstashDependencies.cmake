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
