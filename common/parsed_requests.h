// Methods whose request messages the service reads and parses itself:
// LogprobService's, so that bytes that are not a valid message get
// INVALID_ARGUMENT naming the method (and the message's position in a
// stream) and a request can be admitted before its body is read; the
// internal Worker service's, so that a caller is checked before its body is
// read (NewCheckedUnaryHandler). gRPC's own
// deserialisation answers a unary call INTERNAL with an empty message and
// ends a stream's reads as if the client had half-closed it, so a
// ScoreStream with a malformed message ended OK, silently.
//
// Each method is served as gRPC's "streamed" kind (MarkMethodStreamed: on
// the wire the same call as before, clients see no difference) with its
// messages read as raw bytes (RawMessage) and parsed here.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "common/malloc_tuning.h"
#include "google/protobuf/message.h"
#include "grpcpp/impl/serialization_traits.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/method_handler.h"
#include "grpcpp/support/status.h"
#include "grpcpp/support/sync_stream.h"

namespace logprob {

/// One received request message, not yet parsed (its SerializationTraits,
/// below, take gRPC's buffer as is).
struct RawMessage {
  grpc::ByteBuffer buffer;
};

/// Messages at least this large return the heap's kept freed memory over
/// its cap (TrimKeptFreedMemory) before they are parsed and once they are
/// gone, so that freed large messages do not stay resident beyond
/// --keep-freed-memory-bytes (FrontendMemoryBound's kept_freed).
inline constexpr size_t kTrimAroundBytes = size_t{1} << 20;

/// Parses `raw` (its buffer is consumed) into *msg. OK, or INVALID_ARGUMENT
/// "METHOD: WHAT is not a valid logprob.v1.TYPE message (protobuf parse
/// failed)"; `what` is e.g. "the request" or "message 3". Thread-compatible.
grpc::Status ParseRequest(RawMessage* raw, google::protobuf::Message* msg, const char* method, const std::string& what);

/// A stream of requests of type R (answers W) over a stream of raw
/// messages: Read parses each; a malformed one ends the reads (Read returns
/// false, as at the client's half-close) and status() says why. Used by the
/// handler of one call, on its thread (the method's own threads may Write).
template <class W, class R>
class ParsingReaderWriter final : public grpc::ServerReaderWriterInterface<W, R> {
 public:
  ParsingReaderWriter(grpc::ServerReaderWriterInterface<W, RawMessage>* raw, const char* method)
      : raw_(raw), method_(method) {}
  void SendInitialMetadata() override { raw_->SendInitialMetadata(); }
  bool NextMessageSize(uint32_t* sz) override { return raw_->NextMessageSize(sz); }
  bool Write(const W& msg, grpc::WriteOptions options) override { return raw_->Write(msg, options); }
  bool Read(R* msg) override {
    if (!status_.ok()) return false;
    RawMessage m;
    if (!raw_->Read(&m)) return false;
    if (m.buffer.Length() >= kTrimAroundBytes) TrimKeptFreedMemory();
    status_ = ParseRequest(&m, msg, method_, "message " + std::to_string(++read_));
    return status_.ok();
  }
  /// OK, or why the reads ended early (INVALID_ARGUMENT, ParseRequest).
  const grpc::Status& status() const { return status_; }

 private:
  grpc::ServerReaderWriterInterface<W, RawMessage>* const raw_;
  const char* const method_;
  int64_t read_ = 0;
  grpc::Status status_;
};

/// Reads the one request message of a call served on raw messages into
/// *raw: OK, or INVALID_ARGUMENT "METHOD: the call ended before its request
/// message". On the handler's thread.
template <class Resp>
grpc::Status ReadRequestMessage(grpc::ServerReaderWriter<Resp, RawMessage>* stream, const char* method,
                                RawMessage* raw) {
  if (stream->Read(raw)) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      std::string(method) + ": the call ended before its request message");
}

/// The body every unary handler here shares, on the handler's thread:
/// reads the one request message of `stream`, tells `arrived` its size (a
/// non-OK answer refuses it), parses it (ParseRequest), answers it with
/// `answer(const Req*, Resp*)` and writes the answer as the last message
/// (CANCELLED when the caller went away). A failure before `answer` runs
/// goes through `refused(status)`, which returns the status to send.
/// Messages of kTrimAroundBytes or more trim the heap's kept freed memory
/// before they are parsed and once they and their answer are gone.
template <class Req, class Resp, class Refused, class Arrived, class Answer>
grpc::Status ReadAndAnswer(grpc::ServerReaderWriter<Resp, RawMessage>* stream, const char* method, Refused refused,
                           Arrived arrived, Answer answer) {
  RawMessage raw;
  if (grpc::Status st = ReadRequestMessage(stream, method, &raw); !st.ok()) return refused(st);
  const size_t bytes = raw.buffer.Length();
  if (grpc::Status st = arrived(bytes); !st.ok()) return refused(st);
  const bool large = bytes >= kTrimAroundBytes;
  if (large) TrimKeptFreedMemory();
  grpc::Status st;
  {
    Req req;
    if (st = ParseRequest(&raw, &req, method, "the request"); !st.ok()) return refused(st);
    Resp resp;
    st = answer(static_cast<const Req*>(&req), &resp);
    if (st.ok() && !stream->Write(resp, grpc::WriteOptions().set_last_message()))
      st = grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
  }
  if (large) TrimKeptFreedMemory();  // the request and its answer are freed
  return st;
}

/// A handler serving the unary method `fn` of `service` (named `method`)
/// with the request parsed by ParseRequest: a malformed request, or none,
/// is answered by `service->Refused(context, method, status)` (which logs
/// and counts it, and returns the status to send) without calling `fn`.
/// Before the request's body is read, `service->Reserve(context, method,
/// &receipt)` may refuse it (a full queue: the body is never read, only
/// what HTTP/2 flow control lets the client send ahead); once it arrived,
/// `service->Received(context, method, &receipt, bytes)` may (more bytes
/// than reserved). `receipt` (a `Service::Receipt`) lives until the answer
/// is written, and is passed to `fn` when it takes one. Install it in the
/// service's constructor with `MarkMethodStreamed(index,
/// NewParsedUnaryHandler(...))` (gRPC owns it).
template <class Service, class Req, class Resp>
grpc::internal::MethodHandler* NewParsedUnaryHandler(
    Service* service, const char* method,
    std::function<grpc::Status(Service*, grpc::ServerContext*, const Req*, Resp*, typename Service::Receipt*)> fn) {
  return new grpc::internal::BidiStreamingHandler<Service, RawMessage, Resp>(
      [method, fn](Service* s, grpc::ServerContext* context, grpc::ServerReaderWriter<Resp, RawMessage>* stream) {
        typename Service::Receipt receipt;  // outlives the request's buffers (ReadAndAnswer's)
        auto refused = [&](const grpc::Status& st) { return s->Refused(context, method, st); };
        if (grpc::Status st = s->Reserve(context, method, &receipt); !st.ok()) return refused(st);
        return ReadAndAnswer<Req>(
            stream, method, refused, [&](size_t bytes) { return s->Received(context, method, &receipt, bytes); },
            [&](const Req* req, Resp* resp) { return fn(s, context, req, resp, &receipt); });
      },
      service);
}

/// A handler serving the unary method `fn` of `service` (named `method`)
/// whose caller `check` vets from the call's metadata before a byte of the
/// request's body is read (only what HTTP/2 flow control lets the client
/// send ahead): a refused caller costs no allocation of its message. Then
/// the request is read and parsed as NewParsedUnaryHandler's
/// (ReadAndAnswer; INVALID_ARGUMENT when malformed, returned as is) and
/// `fn` answers. Installed like NewParsedUnaryHandler.
template <class Service, class Req, class Resp>
grpc::internal::MethodHandler* NewCheckedUnaryHandler(Service* service, const char* method,
                                                      std::function<grpc::Status(const grpc::ServerContext&)> check,
                                                      grpc::Status (Service::*fn)(grpc::ServerContext*, const Req*,
                                                                                  Resp*)) {
  return new grpc::internal::BidiStreamingHandler<Service, RawMessage, Resp>(
      [method, check, fn](Service* s, grpc::ServerContext* context,
                          grpc::ServerReaderWriter<Resp, RawMessage>* stream) {
        if (grpc::Status st = check(*context); !st.ok()) return st;
        return ReadAndAnswer<Req>(
            stream, method, [](const grpc::Status& st) { return st; }, [](size_t) { return grpc::Status::OK; },
            [&](const Req* req, Resp* resp) { return (s->*fn)(context, req, resp); });
      },
      service);
}

/// NewParsedUnaryHandler for a method that does not take the receipt.
template <class Service, class Req, class Resp>
grpc::internal::MethodHandler* NewParsedUnaryHandler(Service* service, const char* method,
                                                     grpc::Status (Service::*fn)(grpc::ServerContext*, const Req*,
                                                                                 Resp*)) {
  return NewParsedUnaryHandler<Service, Req, Resp>(
      service, method,
      [fn](Service* s, grpc::ServerContext* context, const Req* req, Resp* resp, typename Service::Receipt*) {
        return (s->*fn)(context, req, resp);
      });
}

/// A handler serving the server-streaming method `fn` of `service` (named
/// `method`): its one request parsed as NewParsedUnaryHandler's (malformed:
/// INVALID_ARGUMENT through `service->Refused`), then `fn` writes its
/// answers. Installed like NewParsedUnaryHandler.
template <class Service, class Req, class Resp>
grpc::internal::MethodHandler* NewParsedServerStreamingHandler(
    Service* service, const char* method,
    grpc::Status (Service::*fn)(grpc::ServerContext*, const Req*, grpc::internal::WriterInterface<Resp>*)) {
  return new grpc::internal::BidiStreamingHandler<Service, RawMessage, Resp>(
      [method, fn](Service* s, grpc::ServerContext* context, grpc::ServerReaderWriter<Resp, RawMessage>* stream) {
        RawMessage raw;
        if (grpc::Status st = ReadRequestMessage(stream, method, &raw); !st.ok())
          return s->Refused(context, method, st);
        Req req;
        if (grpc::Status st = ParseRequest(&raw, &req, method, "the request"); !st.ok())
          return s->Refused(context, method, st);
        return (s->*fn)(context, &req, stream);
      },
      service);
}

/// A handler serving the bidi-streaming method `fn` of `service` (named
/// `method`) on a ParsingReaderWriter (no Receive check: a stream's
/// messages are admitted one by one as they are scored): when a message is malformed, the
/// call ends with its INVALID_ARGUMENT (passed through
/// `service->Refused(context, method, status)`) once `fn` returns, whatever
/// `fn` answered. Installed like NewParsedUnaryHandler.
template <class Service, class Req, class Resp>
grpc::internal::MethodHandler* NewParsedBidiHandler(
    Service* service, const char* method,
    grpc::Status (Service::*fn)(grpc::ServerContext*, grpc::ServerReaderWriterInterface<Resp, Req>*)) {
  return new grpc::internal::BidiStreamingHandler<Service, RawMessage, Resp>(
      [method, fn](Service* s, grpc::ServerContext* context, grpc::ServerReaderWriter<Resp, RawMessage>* stream) {
        ParsingReaderWriter<Resp, Req> parsing(stream, method);
        grpc::Status st = (s->*fn)(context, &parsing);
        if (!parsing.status().ok()) return s->Refused(context, method, parsing.status());
        return st;
      },
      service);
}

}  // namespace logprob

namespace grpc {

/// RawMessage travels as the bytes gRPC received (server side only).
template <>
class SerializationTraits<logprob::RawMessage, void> {
 public:
  static Status Serialize(const logprob::RawMessage& m, ByteBuffer* buffer, bool* own_buffer) {
    *buffer = m.buffer;
    *own_buffer = true;
    return Status::OK;
  }
  static Status Deserialize(ByteBuffer* buffer, logprob::RawMessage* m) {
    m->buffer.Swap(buffer);
    buffer->Clear();
    return Status::OK;
  }
};

}  // namespace grpc
