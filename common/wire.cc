// Receive/send of header + payload frames, and the checks on everything received.
#include "common/wire.h"

#include <cmath>
#include <cstring>
#include <set>
#include <string_view>

namespace isthmus {

uint64_t Frames::PayloadBytes() const {
  uint64_t n = 0;
  for (const auto& f : payload) n += f.size();
  return n;
}

Result<Frames> ReceiveMessage(zmq::socket_t& socket, zmq::message_t* routing_id) {
  std::vector<zmq::message_t> parts;
  try {
    while (true) {
      zmq::message_t part;
      auto got =
          socket.recv(part, parts.empty() ? zmq::recv_flags::dontwait : zmq::recv_flags::none);
      if (!got) {
        if (parts.empty()) return Status::Timeout("no message");
        break;
      }
      bool more = part.more();
      parts.push_back(std::move(part));
      if (!more) break;
    }
  } catch (const zmq::error_t& e) {
    return Status::Unavailable(std::string("receive failed: ") + e.what());
  }
  size_t first = 0;
  if (routing_id != nullptr) {
    *routing_id = std::move(parts[0]);
    first = 1;
  }
  if (parts.size() <= first) return Status::InvalidArgument("message has no header frame");
  Frames frames;
  frames.header = std::move(parts[first]);
  // The sender's CURVE key (ZAP's User-Id), read before a copy below would drop it.
  if (const char* uid = zmq_msg_gets(frames.header.handle(), "User-Id")) frames.user_id = uid;
  // ZeroMQ may hand over a frame that points into its receive buffer at any offset; the
  // header's FlatBuffers fields need their natural alignment (8 bytes), so a misaligned
  // header is copied once into storage of its own.
  if (reinterpret_cast<uintptr_t>(frames.header.data()) % 8 != 0) {
    frames.header = zmq::message_t(frames.header.data(), frames.header.size());
  }
  for (size_t i = first + 1; i < parts.size(); ++i) frames.payload.push_back(std::move(parts[i]));
  return frames;
}

namespace {
void ReleaseKeepalive(void* /*data*/, void* hint) {
  delete static_cast<std::shared_ptr<const void>*>(hint);
}
}  // namespace

Status SendMessage(zmq::socket_t& socket, const zmq::message_t* routing_id,
                   const flatbuffers::FlatBufferBuilder& header,
                   const std::vector<PayloadRef>& payload) {
  try {
    // A socket with a send timeout (peer links use 0: never block the event loop) may
    // refuse the first frame; once it is taken, ZeroMQ takes the rest of the message.
    const char* would_block = "send would block: no connection can take the message now";
    if (routing_id != nullptr) {
      zmq::message_t id(routing_id->data(), routing_id->size());
      if (!socket.send(id, zmq::send_flags::sndmore)) return Status::Unavailable(would_block);
    }
    zmq::message_t head(header.GetBufferPointer(), header.GetSize());
    if (!socket.send(head, payload.empty() ? zmq::send_flags::none : zmq::send_flags::sndmore)) {
      return Status::Unavailable(would_block);
    }
    for (size_t i = 0; i < payload.size(); ++i) {
      const auto& p = payload[i];
      zmq::message_t frame;
      if (p.keepalive && p.size > 0) {
        auto* hint = new std::shared_ptr<const void>(p.keepalive);
        frame = zmq::message_t(const_cast<void*>(p.data), p.size, ReleaseKeepalive, hint);
      } else {
        frame = zmq::message_t(p.data, p.size);
      }
      socket.send(frame, i + 1 < payload.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
  } catch (const zmq::error_t& e) {
    return Status::Unavailable(std::string("send failed: ") + e.what());
  }
  return Status::Ok();
}

Result<const wire::Envelope*> ParseEnvelope(const zmq::message_t& header, const WireLimits& limits,
                                            uint64_t* request_id) {
  if (header.size() > limits.max_header_bytes) {
    return Status::ResourceExhausted("header frame of " + std::to_string(header.size()) +
                                     " bytes exceeds the limit of " +
                                     std::to_string(limits.max_header_bytes));
  }
  auto* bytes = static_cast<const uint8_t*>(header.data());
  if (reinterpret_cast<uintptr_t>(bytes) % 8 != 0) {
    // ReceiveMessage aligns every header it hands out; reading fields here would be
    // undefined behaviour.
    return Status::InvalidArgument("header frame is not 8-byte aligned");
  }
  flatbuffers::Verifier::Options opts;
  opts.max_tables = 4 * static_cast<flatbuffers::uoffset_t>(limits.max_tensors) + 1024;
  flatbuffers::Verifier verifier(bytes, header.size(), opts);
  if (header.size() < 8 || !wire::EnvelopeBufferHasIdentifier(bytes) ||
      !wire::VerifyEnvelopeBuffer(verifier)) {
    return Status::InvalidArgument("header frame is not a valid isthmus Envelope (" +
                                   std::to_string(header.size()) + " bytes failed verification)");
  }
  const wire::Envelope* env = wire::GetEnvelope(bytes);
  if (request_id != nullptr) *request_id = env->request_id();
  if (env->schema_version() != kSchemaVersion) {
    return Status::InvalidArgument(
        "message has schema_version " + std::to_string(env->schema_version()) +
        " but this isthmus speaks schema_version " + std::to_string(kSchemaVersion) +
        ": run the same isthmus release on both ends");
  }
  // The verifier accepts a union type whose value is absent; handlers may not.
  if (env->body_type() == wire::Body::NONE || env->body() == nullptr) {
    return Status::InvalidArgument("envelope has no body");
  }
  return env;
}

bool AllFinite(const float* data, size_t n) {
  // Branch-free accumulate: x - x is 0 for finite x and NaN otherwise.
  float acc = 0.0f;
  for (size_t i = 0; i < n; ++i) acc += data[i] - data[i];
  return acc == 0.0f;
}

std::vector<int64_t> ShapeFrom(const flatbuffers::Vector<int64_t>* dims) {
  std::vector<int64_t> shape;
  if (dims == nullptr) return shape;
  // The verifier checks the alignment of a vector's length, not of its 8-byte elements:
  // a hostile header can place them anywhere, so each is copied out byte-wise.
  const uint8_t* at = dims->Data();
  shape.resize(dims->size());
  for (size_t i = 0; i < shape.size(); ++i) {
    int64_t d;
    std::memcpy(&d, at + i * sizeof(d), sizeof(d));
    shape[i] = flatbuffers::EndianScalar(d);
  }
  return shape;
}

std::vector<int64_t> ShapeOf(const wire::TensorMeta* meta) { return ShapeFrom(meta->shape()); }

Status ValidateTensors(const flatbuffers::Vector<flatbuffers::Offset<wire::TensorMeta>>* metas,
                       const std::vector<zmq::message_t>& payload, const WireLimits& limits,
                       bool check_finite, bool accept_encoded,
                       const flatbuffers::Vector<uint32_t>* streamed) {
  size_t count = metas == nullptr ? 0 : metas->size();
  if (count > limits.max_tensors) {
    return Status::ResourceExhausted(std::to_string(count) + " tensors in one message exceed " +
                                     "the limit of " + std::to_string(limits.max_tensors));
  }
  std::vector<bool> in_parts(count, false);
  const size_t streamed_count = streamed == nullptr ? 0 : streamed->size();
  uint64_t total = 0;
  for (size_t k = 0; k < streamed_count; ++k) {
    const uint32_t i = streamed->Get(k);
    if (i >= count || (k > 0 && i <= streamed->Get(k - 1))) {
      return Status::InvalidArgument(
          "the streamed tensors' indices must name tensors of the request, in ascending order");
    }
    in_parts[i] = true;
    total += metas->Get(i)->nbytes();
  }
  if (count != payload.size() + streamed_count) {
    return Status::InvalidArgument(std::to_string(count - streamed_count) +
                                   " tensors described with frames but " +
                                   std::to_string(payload.size()) + " payload frames sent");
  }
  for (const auto& f : payload) total += f.size();
  if (total > limits.max_payload_bytes) {
    return Status::ResourceExhausted("payload of " + std::to_string(total) +
                                     " bytes exceeds the limit of " +
                                     std::to_string(limits.max_payload_bytes));
  }
  std::set<std::string_view> names;
  std::vector<bool> used(payload.size(), false);
  for (size_t i = 0; i < count; ++i) {
    const wire::TensorMeta* m = metas->Get(i);
    std::string_view name = m->name()->string_view();
    std::string label = "tensor #" + std::to_string(i);
    if (name.empty() || name.size() > limits.max_name_bytes) {
      return Status::InvalidArgument(label + " has an empty or over-long name");
    }
    label = "tensor '" + std::string(name) + "'";
    if (!names.insert(name).second) return Status::InvalidArgument(label + " appears twice");
    const bool encoded = m->dtype() == wire::DType::Codec;
    if (m->dtype() != wire::DType::F32 && !(encoded && accept_encoded)) {
      return Status::InvalidArgument(
          label + " has dtype " + std::to_string(static_cast<int>(m->dtype())) +
          (accept_encoded ? "; only F32 and Codec are accepted" : "; only F32 is accepted"));
    }
    auto shape = ShapeOf(m);
    if (shape.size() > limits.max_dims) {
      return Status::InvalidArgument(label + " has " + std::to_string(shape.size()) +
                                     " dims, more than " + std::to_string(limits.max_dims));
    }
    int64_t numel = NumElements(shape);
    if (numel < 0) return Status::InvalidArgument(label + " has a negative or huge shape");
    if (in_parts[i]) {
      const uint64_t expect = static_cast<uint64_t>(numel) * sizeof(float);
      if (encoded || expect == 0 || m->nbytes() != expect) {
        return Status::InvalidArgument(label + " comes in parts, which takes F32 values of " +
                                       "its shape's size (" + std::to_string(expect) +
                                       " bytes, header says " + std::to_string(m->nbytes()) + ")");
      }
      continue;
    }
    if (m->frame() >= payload.size() || used[m->frame()]) {
      return Status::InvalidArgument(label + " names payload frame " + std::to_string(m->frame()) +
                                     " which is missing or used twice");
    }
    used[m->frame()] = true;
    const zmq::message_t& frame = payload[m->frame()];
    if (encoded) {
      if (m->nbytes() == 0 || frame.size() != m->nbytes()) {
        return Status::InvalidArgument(label + ": an encoded tensor's header says " +
                                       std::to_string(m->nbytes()) + " bytes, its frame has " +
                                       std::to_string(frame.size()));
      }
      continue;
    }
    uint64_t expect = static_cast<uint64_t>(numel) * sizeof(float);
    if (m->nbytes() != expect || frame.size() != expect) {
      return Status::InvalidArgument(label + ": shape needs " + std::to_string(expect) +
                                     " bytes, header says " + std::to_string(m->nbytes()) +
                                     ", frame has " + std::to_string(frame.size()));
    }
    if (check_finite) {
      // Frames may be unaligned for float; copy through memcpy-safe chunks.
      const auto* bytes = static_cast<const uint8_t*>(frame.data());
      if (reinterpret_cast<uintptr_t>(bytes) % alignof(float) == 0) {
        if (!AllFinite(reinterpret_cast<const float*>(bytes), numel)) {
          return Status::InvalidArgument(label + " contains NaN or infinite values");
        }
      } else {
        float buf[1024];
        for (int64_t off = 0; off < numel; off += 1024) {
          int64_t n = std::min<int64_t>(1024, numel - off);
          std::memcpy(buf, bytes + off * 4, n * 4);
          if (!AllFinite(buf, n)) {
            return Status::InvalidArgument(label + " contains NaN or infinite values");
          }
        }
      }
    }
  }
  return Status::Ok();
}

wire::ErrorCode ToWireCode(Code code) { return static_cast<wire::ErrorCode>(code); }
Code FromWireCode(wire::ErrorCode code) {
  auto v = static_cast<uint8_t>(code);
  return v <= static_cast<uint8_t>(Code::kResourceExhausted) ? static_cast<Code>(v)
                                                             : Code::kInternal;
}

void FinishEnvelope(flatbuffers::FlatBufferBuilder& fbb, uint64_t request_id, wire::Body type,
                    flatbuffers::Offset<void> body) {
  wire::FinishEnvelopeBuffer(fbb,
                             wire::CreateEnvelope(fbb, kSchemaVersion, request_id, type, body));
}

void BuildErrorReply(flatbuffers::FlatBufferBuilder& fbb, uint64_t request_id,
                     const Status& status) {
  auto msg = fbb.CreateString(status.message());
  auto err = wire::CreateErrorReply(fbb, ToWireCode(status.code()), msg);
  FinishEnvelope(fbb, request_id, wire::Body::ErrorReply, err.Union());
}

Status ErrorFromEnvelope(const wire::Envelope* env) {
  if (env->body_type() != wire::Body::ErrorReply) return Status::Ok();
  const auto* err = env->body_as_ErrorReply();
  Code code = FromWireCode(err->code());
  if (code == Code::kOk) code = Code::kInternal;
  return Status(code, err->message() ? err->message()->str() : "");
}

uint64_t ZmtpFrameWireBytes(uint64_t frame_bytes, bool curve) {
  // flags + (1 or 8 length bytes) + body; a body of up to 255 bytes takes the short length.
  auto framed = [](uint64_t body) { return 1 + (body <= 255 ? 1 : 8) + body; };
  if (!curve) return framed(frame_bytes);
  constexpr uint64_t kMessageBox = 8 + 8 + 16 + 1;  // "\x07MESSAGE", nonce, MAC, flags
  return framed(kMessageBox + frame_bytes);
}

uint64_t ZmtpMessageWireBytes(uint64_t header_bytes, const std::vector<uint64_t>& payload_bytes,
                              bool curve) {
  uint64_t n = ZmtpFrameWireBytes(header_bytes, curve);
  for (uint64_t p : payload_bytes) n += ZmtpFrameWireBytes(p, curve);
  return n;
}

uint64_t HandshakeWireBytes(bool client_side, bool curve) {
  constexpr uint64_t kGreeting = 64;
  // "Socket-Type" property: name length (1) + name (11) + value length (4) + value (6).
  constexpr uint64_t kMetadata = 1 + 11 + 4 + 6;
  auto command = [](uint64_t body) { return 1 + (body <= 255 ? 1 : 8) + body; };
  if (!curve) return kGreeting + command(6 + kMetadata);  // READY
  if (client_side) return kGreeting + command(200) + command(257 + kMetadata);
  return kGreeting + command(168) + command(30 + kMetadata);
}

uint64_t TcpIpBytesEstimate(uint64_t wire_bytes, uint64_t messages) {
  constexpr uint64_t kMss = 1448, kHeaders = 66;  // Ethernet 14 + IPv4 20 + TCP 32
  const uint64_t segments = (wire_bytes + kMss - 1) / kMss;
  return (segments + messages) * kHeaders;
}

}  // namespace isthmus
