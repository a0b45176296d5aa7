// Clang thread-safety annotations (checked with -Wthread-safety when building with clang;
// empty elsewhere). See https://clang.llvm.org/docs/ThreadSafetyAnalysis.html.
#pragma once

#if defined(__clang__)
#define KVSTASH_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define KVSTASH_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) KVSTASH_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY KVSTASH_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) KVSTASH_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) KVSTASH_THREAD_ANNOTATION(pt_guarded_by(x))
#define REQUIRES(...) KVSTASH_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define ACQUIRE(...) KVSTASH_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) KVSTASH_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define EXCLUDES(...) KVSTASH_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) KVSTASH_THREAD_ANNOTATION(assert_capability(x))
#define NO_THREAD_SAFETY_ANALYSIS KVSTASH_THREAD_ANNOTATION(no_thread_safety_analysis)
