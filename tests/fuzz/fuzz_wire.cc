// Fuzz target: a received message's header and payload, as every receiver checks them
// (ParseEnvelope, then ValidateTensors for bodies that carry tensors). Input layout: a
// 2-byte little-endian header length, the header, then the payload split into frames at
// the lengths (1 byte each, up to 4) that follow the header.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace isthmus;
  if (size < 2) return 0;
  const size_t header_len = std::min<size_t>(size - 2, data[0] | (data[1] << 8));
  zmq::message_t header(data + 2, header_len);
  size_t at = 2 + header_len;
  std::vector<zmq::message_t> frames;
  const size_t nframes = at < size ? data[at++] % 5 : 0;
  for (size_t i = 0; i < nframes && at < size; ++i) {
    const size_t len = std::min<size_t>(size - at - 1, data[at] * 4u);
    frames.emplace_back(data + at + 1, len);
    at += 1 + len;
  }
  WireLimits limits;
  limits.max_payload_bytes = 1 << 20;
  uint64_t request_id = 0;
  auto env = ParseEnvelope(header, limits, &request_id);
  if (!env.ok()) return 0;
  const wire::Envelope* e = *env;
  if (e->body_type() == wire::Body::PushRequest) {
    (void)ValidateTensors(e->body_as_PushRequest()->tensors(), frames, limits, true);
  } else if (e->body_type() == wire::Body::JobCreate) {
    (void)ValidateTensors(e->body_as_JobCreate()->tensors(), frames, limits, true);
  }
  return 0;
}
