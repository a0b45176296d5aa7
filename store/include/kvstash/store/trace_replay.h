// Replays a policy trace through a BlockManager, one transcript line per operation, so that
// anyone can check the manager against a reference implementation (`kvstash trace`).
#pragma once

#include <istream>
#include <ostream>

#include "kvstash/common/status.h"

namespace kvstash::store {

// Reads a trace from `in` and writes its transcript to `out` as it goes.
//
// The language: header lines `policy lru|arc|aflru`, `capacity N`, and optionally `threshold N`
// (reuse filter, default 1) and `tracker N` (default 64000), all before the first operation.
// Then one operation per line over keys K (unsigned 64-bit decimal; group 0, namespace 0):
//   lookup K...      per key 1 (hit), 0 (miss) or ? (retry)
//   prefix K...      maximal-prefix result, or ?
//   window W K...    sliding-window result for a window of W >= 1 blocks, or ?
//   store K...       store=K,K evict=K,K  or  refused
//   commit K... / abort K...            ok
//   load K... / unload K...             ok  or  error <reason>
//   touch K...       ok  (a use of the keys)
//   refresh K...     ok  (a touch that is not a new use: AF-LRU counts none)
//   events           stored:K,K removed:K,K ... in order, or -
//   state            lru K:R ...  or  arc p=P t1=K:R,... t2=... b1=K,... b2=...  or
//                    aflru clock=C c1=K:R@T,... c2=... c3=... ghosts=N (T: the last touch)
//   reset            ok
// `#` starts a comment; blank lines are skipped.
//
// Returns InvalidArgument "line N: ..." at the first malformed line (unknown op, bad number,
// missing header, header after an operation), having written the transcript up to it.
Status ReplayTrace(std::istream& in, std::ostream& out);

}  // namespace kvstash::store
