#include "client/lm_head_command.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/grpc_status.h"
#include "common/lm_head_source.h"
#include "logprob/v1/logprob.grpc.pb.h"

namespace logprob::client {
namespace {

constexpr int64_t kCallBytes = int64_t{64} << 20;  // rows per PutLmHeadRows call, default
constexpr size_t kPieceBytes = size_t{4} << 20;    // bytes per TensorPiece

int Failed(const std::string& what, const grpc::Status& s) {
  std::cerr << "error: " << what << ": " << absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code()))
            << ": " << s.error_message() << std::endl;
  return kExitFailure;
}

// The head's logit transform as GetServerInfo reports it: "bias,
// logit_scale 0.125, final_logit_softcapping 30", or "none". A server from
// before transforms leaves logit_scale 0: read as 1.
std::string HeadTransformText(const v1::LmHeadInfo& h) {
  std::vector<std::string> parts;
  if (h.has_bias()) parts.push_back("bias");
  if (h.logit_scale() != 0 && h.logit_scale() != 1) parts.push_back(absl::StrCat("logit_scale ", h.logit_scale()));
  if (h.final_logit_softcapping() != 0)
    parts.push_back(absl::StrCat("final_logit_softcapping ", h.final_logit_softcapping()));
  return parts.empty() ? "none" : absl::StrJoin(parts, ", ");
}

}  // namespace

int RunHeads(const LmHeadArgs& args) {
  std::shared_ptr<grpc::Channel> channel = OpenChannel(args.server, args.channel);
  if (!channel) return kExitBadInput;
  auto stub = v1::LogprobService::NewStub(channel);
  absl::StatusOr<v1::ServerInfo> info = FetchServerInfo(*stub, args.timeout_seconds);
  if (!info.ok()) {
    PrintError(info.status());
    return kExitFailure;
  }
  if (info->lm_heads().empty()) std::cout << args.server << ": no lm_head (started without --lm-head)" << std::endl;
  for (const v1::LmHeadInfo& h : info->lm_heads())
    std::cout << h.name() << "  version " << h.version() << "  retained [" << absl::StrJoin(h.retained_versions(), ", ")
              << "]  [" << h.vocab_size() << ", " << h.hidden_size() << "] " << DTypeName(h.dtype()) << "  "
              << h.precision() << "  sha256 " << (h.sha256().empty() ? "(computing)" : h.sha256()) << "  " << h.source()
              << "  transform " << HeadTransformText(h) << std::endl;
  std::cout << "updates " << (info->lm_head_updates() ? "allowed" : "off (--allow-lm-head-updates)") << std::endl;
  return kExitOk;
}

int RunUpdateLmHead(const LmHeadArgs& args) {
  absl::StatusOr<LmHeadSource> src = ResolveLmHead(args.tensor.empty() ? args.input : args.input + ":" + args.tensor);
  if (!src.ok()) {
    std::cerr << "error: --input " << args.input << ": " << src.status().message() << std::endl;
    return kExitBadInput;
  }
  std::shared_ptr<grpc::Channel> channel = OpenChannel(args.server, args.channel);
  if (!channel) return kExitBadInput;
  auto stub = v1::LogprobService::NewStub(channel);
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t V = src->vocab_size, H = src->hidden_size;
  const int64_t row_bytes = H * static_cast<int64_t>(DTypeSize(src->dtype));
  v1::BeginLmHeadUpdateRequest begin;
  begin.set_head(args.head);
  begin.set_version(args.version);
  begin.set_vocab_size(V);
  begin.set_hidden_size(H);
  begin.set_dtype(src->dtype);
  begin.set_sha256(args.sha256);
  // The checkpoint's transform goes with it: its bias (else the head keeps
  // its own), and the scalars a folder's config.json states (a bare file
  // states none: the head keeps its own).
  if (src->transform.has_bias) {
    std::vector<float> bias(static_cast<size_t>(V));
    if (absl::Status st = ReadLmHeadBias(*src, 0, V, bias.data()); !st.ok()) {
      std::cerr << "error: --input " << args.input << ": " << st.message() << std::endl;
      return kExitBadInput;
    }
    v1::Tensor* b = begin.mutable_bias();
    b->set_name(src->bias.tensor);
    b->set_dtype(v1::F32);
    b->add_shape(V);
    b->set_data(bias.data(), bias.size() * sizeof(float));
  }
  if (!src->config_file.empty()) {
    begin.set_logit_scale(src->transform.logit_scale);
    begin.set_final_logit_softcapping(src->transform.softcap);
  }
  v1::LmHeadUpdate update;
  {
    grpc::ClientContext ctx;
    SetTimeout(&ctx, args.timeout_seconds);
    if (grpc::Status s = stub->BeginLmHeadUpdate(&ctx, begin, &update); !s.ok()) return Failed("begin", s);
  }
  if (update.already_committed()) {
    std::cout << args.head << " version " << args.version << " (already committed)" << std::endl;
    return kExitOk;
  }
  auto abort = [&](const std::string& what, const grpc::Status& s) {
    grpc::ClientContext ctx;
    SetTimeout(&ctx, 30);
    v1::LmHeadUpdateRef ref;
    ref.set_update_id(update.update_id());
    v1::LmHeadUpdate ignored;
    (void)stub->AbortLmHeadUpdate(&ctx, ref, &ignored);
    return Failed(what, s);
  };
  std::cerr << "update-lm-head: " << args.head << " -> " << args.version << ": " << src->tensor << " [" << V << ", "
            << H << "] " << DTypeName(src->dtype) << " from " << src->file << std::endl;
  const int64_t per_call = args.rows_per_call > 0 ? args.rows_per_call : std::max<int64_t>(1, kCallBytes / row_bytes);
  std::vector<char> rows;
  for (int64_t r0 = 0; r0 < V; r0 += per_call) {
    const int64_t r1 = std::min(V, r0 + per_call);
    rows.resize(static_cast<size_t>((r1 - r0) * row_bytes));
    if (absl::Status st = ReadLmHeadRows(*src, r0, r1, rows.data()); !st.ok())
      return abort("reading --input", grpc::Status(grpc::StatusCode::DATA_LOSS, std::string(st.message())));
    grpc::ClientContext ctx;
    SetTimeout(&ctx, args.timeout_seconds);
    v1::LmHeadUpdate progress;
    auto writer = stub->PutLmHeadRows(&ctx, &progress);
    v1::LmHeadRowsPart first;
    v1::LmHeadRows* head = first.mutable_rows();
    head->set_update_id(update.update_id());
    head->set_row_begin(r0);
    v1::Tensor* t = head->mutable_rows();
    t->set_name("rows");
    t->set_dtype(src->dtype);
    t->add_shape(r1 - r0);
    t->add_shape(H);
    bool ok = writer->Write(first);
    for (size_t off = 0; ok && off < rows.size(); off += kPieceBytes) {
      v1::LmHeadRowsPart piece;
      piece.mutable_piece()->set_offset(static_cast<int64_t>(off));
      piece.mutable_piece()->set_data(rows.data() + off, std::min(kPieceBytes, rows.size() - off));
      ok = writer->Write(piece);
    }
    writer->WritesDone();
    if (grpc::Status s = writer->Finish(); !s.ok()) return abort(absl::StrCat("rows [", r0, ", ", r1, ")"), s);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cerr << "update-lm-head: " << progress.rows_received() << "/" << V << " rows ("
              << (progress.rows_received() * row_bytes >> 20) << " MiB, " << secs << " s)" << std::endl;
  }
  v1::LmHeadInfo committed;
  {
    grpc::ClientContext ctx;
    SetTimeout(&ctx, args.timeout_seconds);
    v1::LmHeadUpdateRef ref;
    ref.set_update_id(update.update_id());
    if (grpc::Status s = stub->CommitLmHeadUpdate(&ctx, ref, &committed); !s.ok()) return Failed("commit", s);
  }
  std::cerr << "update-lm-head: committed in "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s" << std::endl;
  // Without --sha256 the server hashes the rows after the commit: `heads` lists it once done.
  std::cout << committed.name() << " version " << committed.version() << " sha256 "
            << (committed.sha256().empty() ? "(computing; see heads)" : committed.sha256()) << std::endl;
  return kExitOk;
}

}  // namespace logprob::client
