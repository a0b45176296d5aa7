// Test helper: writes blocks into an SSD tier, printing "committed N" after each Put returns
// and then waiting for a line on standard input before the next, so that a test knows to the
// block what was committed when it kills the writer with SIGKILL in the middle of a Put.
//   ssd_writer DIR BLOCK_BYTES CAPACITY_BLOCKS FIRST_KEY
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "block_pattern.h"
#include "kvstash/common/logging.h"
#include "kvstash/store/ssd_tier.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s DIR BLOCK_BYTES CAPACITY_BLOCKS FIRST_KEY\n", argv[0]);
    return 2;
  }
  kvstash::SetLogLevel("warn").IgnoreError();
  kvstash::store::SsdTierOptions options;
  options.dir = argv[1];
  options.block_bytes = std::strtoull(argv[2], nullptr, 10);
  options.capacity_bytes = std::strtoull(argv[3], nullptr, 10) * options.block_bytes;
  const uint64_t first = std::strtoull(argv[4], nullptr, 10);
  auto tier = kvstash::store::SsdTier::Create(options);
  if (!tier.ok()) {
    std::fprintf(stderr, "%s\n", tier.status().ToString().c_str());
    return 1;
  }
  std::vector<std::byte> block(options.block_bytes);
  for (uint64_t k = first;; ++k) {
    kvstash::testing::FillPattern(k, block);
    const kvstash::BlockKey key{kvstash::BlockHash{k, 0}, 0, 0};
    kvstash::Status s = (*tier)->Put(key, block);
    if (!s.ok()) {
      std::fprintf(stderr, "put %llu: %s\n", static_cast<unsigned long long>(k),
                   s.ToString().c_str());
      return 1;
    }
    std::printf("committed %llu\n", static_cast<unsigned long long>(k));
    std::fflush(stdout);
    int c;
    while ((c = std::getchar()) != '\n') {
      if (c == EOF) return 0;
    }
  }
}
