// What ThreadSanitizer cannot see, said where it matters. libzmq is not instrumented
// (deploy/sanitizers/tsan.supp): TSan sees a received message's bytes written by ZeroMQ's
// I/O thread and read by the socket's thread with no ordering between them, except when
// the socket's thread waited on the pipe's signal before the message (an eventfd, which
// TSan does model). A request answered before the next comes always waits; messages
// streaming in back to back (a push's parts) do not, and every read of their bytes is
// reported, one report per element, which at a megabyte a part stalls the process in
// TSan's report bookkeeping rather than reaching the suppression. IgnoreReceivedReads
// marks the reads of such bytes on this thread, for its scope, as ones TSan does not
// check. Outside TSan builds it is nothing.
#pragma once

#if defined(__SANITIZE_THREAD__)
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
#endif

namespace isthmus {

class IgnoreReceivedReads {
 public:
#if defined(__SANITIZE_THREAD__)
  IgnoreReceivedReads() { AnnotateIgnoreReadsBegin(__FILE__, __LINE__); }
  ~IgnoreReceivedReads() { AnnotateIgnoreReadsEnd(__FILE__, __LINE__); }
#else
  IgnoreReceivedReads() = default;
#endif
  IgnoreReceivedReads(const IgnoreReceivedReads&) = delete;
  IgnoreReceivedReads& operator=(const IgnoreReceivedReads&) = delete;
};

}  // namespace isthmus
