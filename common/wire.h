// The wire codec: one FlatBuffers header frame (schemas/isthmus.fbs, an Envelope) plus raw
// payload frames holding tensor bytes. This file owns the checks every received message
// passes before anything acts on it (verifier, sizes, shapes, dtypes, finiteness) and the
// zero-copy send path for payloads. Used by the server, the client library and isthmusctl.
// Not thread-safe per socket (ZeroMQ sockets belong to one thread).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "common/status.h"
#include "common/tensor.h"
#include "isthmus_generated.h"

namespace isthmus {

// Limits a receiver enforces. Defaults suit a shard; the server's config overrides them.
struct WireLimits {
  size_t max_header_bytes = 1 << 20;               // one Envelope
  uint64_t max_payload_bytes = uint64_t{1} << 30;  // all payload frames of one message
  uint32_t max_tensors = 100000;                   // TensorMeta entries in one message
  uint32_t max_name_bytes = 512;                   // tensor and job names
  uint32_t max_dims = 8;
};

// A received message: the header frame, then the payload frames.
struct Frames {
  zmq::message_t header;
  std::vector<zmq::message_t> payload;
  std::string user_id;  // the sender's User-Id (its CURVE public key), when ZAP set one
  uint64_t PayloadBytes() const;
};

// Bytes of one payload frame to send. `keepalive` owns the memory until ZeroMQ is done
// with it (the frame is sent without copying); a null keepalive means the bytes are
// copied into the frame before SendMessage returns.
struct PayloadRef {
  const void* data = nullptr;
  size_t size = 0;
  std::shared_ptr<const void> keepalive;
};

// Receives one multipart message. `routing_id` receives the first frame when the socket
// is a ROUTER (pass nullptr otherwise). Returns Timeout if nothing arrived (non-blocking
// sockets / rcvtimeo), InvalidArgument if the message has no header frame.
Result<Frames> ReceiveMessage(zmq::socket_t& socket, zmq::message_t* routing_id);

// Sends header (a finished FlatBufferBuilder) and payload frames; `routing_id` first when
// given. Frames travel without copies where PayloadRef::keepalive is set.
Status SendMessage(zmq::socket_t& socket, const zmq::message_t* routing_id,
                   const flatbuffers::FlatBufferBuilder& header,
                   const std::vector<PayloadRef>& payload);

// What a message costs on the wire, for links that must count honestly (docs/SYNC.md,
// "Counting bytes"). ZMTP 3 frames a message frame with 1 flags byte and a 1- or 8-byte
// length; under CURVE every frame travels inside a MESSAGE command ("\x07MESSAGE", an
// 8-byte nonce, a 16-byte MAC and a flags byte around the data), itself a ZMTP frame.
uint64_t ZmtpFrameWireBytes(uint64_t frame_bytes, bool curve);
// The frames of one message: the header, then the payload frames.
uint64_t ZmtpMessageWireBytes(uint64_t header_bytes, const std::vector<uint64_t>& payload_bytes,
                              bool curve);
// One connection's handshake as the connecting side sends it and as the accepting side
// answers: the 64-byte greeting each way, then CurveZMQ's HELLO (200 bytes) and INITIATE
// (257 bytes + the metadata ZeroMQ 4.3 sends: Socket-Type) from the client, WELCOME (168)
// and READY (30 + metadata) from the server; or the NULL mechanism's READY each way.
uint64_t HandshakeWireBytes(bool client_side, bool curve);
// An estimate of the TCP/IPv4/Ethernet header bytes under `wire_bytes` sent in `messages`
// messages on an established connection: 66 bytes per segment of up to 1448 bytes, plus
// one 66-byte acknowledgement per message from the other side. A connection's setup and
// teardown add kTcpConnectionBytesEstimate.
uint64_t TcpIpBytesEstimate(uint64_t wire_bytes, uint64_t messages);
inline constexpr uint64_t kTcpConnectionBytesEstimate = 74 + 74 + 66 + 4 * 66;

// The Envelope schema_version this build speaks (schemas/isthmus.fbs). A receiver refuses
// any other version: a message whose meaning may differ is never acted on.
inline constexpr uint32_t kSchemaVersion = 1;

// Runs the FlatBuffers verifier and size limit on a header frame (which must be 8-byte
// aligned, as ReceiveMessage returns every header) and refuses an Envelope
// whose schema_version is not kSchemaVersion (InvalidArgument naming both versions).
// `request_id`, when given, receives the Envelope's request id as soon as the frame has
// verified, so a refusal of its version can still be answered to the right request. The
// returned pointer points into `header` and lives as long as it.
Result<const wire::Envelope*> ParseEnvelope(const zmq::message_t& header, const WireLimits& limits,
                                            uint64_t* request_id = nullptr);

// Checks a list of tensor descriptions against the payload frames: names present, short,
// unique; dtype F32; dims within limits and non-negative; element count x 4 == nbytes ==
// the frame's size; every frame referenced exactly once; total within limits; and, when
// `check_finite`, every value finite. The first failure is returned as InvalidArgument
// (or ResourceExhausted for limits) naming the tensor.
// With `accept_encoded`, a tensor of dtype Codec passes with any non-empty frame of the
// length its header gives (its decoder validates the bytes); otherwise only F32 does.
// `streamed` (a push's PushRequest.streamed): the indices, strictly ascending, of F32
// tensors that have no frame here (their bytes come in parts); their nbytes must be their
// size, and count towards the total; `check_finite` does not see them.
Status ValidateTensors(const flatbuffers::Vector<flatbuffers::Offset<wire::TensorMeta>>* metas,
                       const std::vector<zmq::message_t>& payload, const WireLimits& limits,
                       bool check_finite, bool accept_encoded = false,
                       const flatbuffers::Vector<uint32_t>* streamed = nullptr);

// True if every one of the n floats is finite.
bool AllFinite(const float* data, size_t n);

// The dims of a received shape vector (safe for vectors at any alignment), and the shape
// of a TensorMeta.
std::vector<int64_t> ShapeFrom(const flatbuffers::Vector<int64_t>* dims);
std::vector<int64_t> ShapeOf(const wire::TensorMeta* meta);

// Status <-> wire error code (one to one).
wire::ErrorCode ToWireCode(Code code);
Code FromWireCode(wire::ErrorCode code);

// Finishes `fbb` as an Envelope of this schema version around `body`.
void FinishEnvelope(flatbuffers::FlatBufferBuilder& fbb, uint64_t request_id, wire::Body type,
                    flatbuffers::Offset<void> body);

// A finished Envelope holding an ErrorReply for `status`.
void BuildErrorReply(flatbuffers::FlatBufferBuilder& fbb, uint64_t request_id,
                     const Status& status);

// Returns the Status an Envelope carries if its body is an ErrorReply, OK otherwise.
Status ErrorFromEnvelope(const wire::Envelope* env);

}  // namespace isthmus
