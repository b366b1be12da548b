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
#include "common/lm_head_source.h"
#include "common/lm_head_update_driver.h"
#include "common/lm_head_update_grpc.h"
#include "logprob/v1/logprob.grpc.pb.h"

namespace logprob::client {
namespace {

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
  LmHeadUpdateDriverOptions options;
  options.rows_per_put = args.rows_per_call;
  // A put stays inside the server's request limit, as a split request does.
  if (absl::StatusOr<v1::ServerInfo> info = FetchServerInfo(*stub, args.timeout_seconds);
      info.ok() && info->max_request_bytes() > 0)
    options.put_bytes = std::min<int64_t>(
        options.put_bytes, static_cast<int64_t>(kRequestFill * static_cast<double>(info->max_request_bytes())));
  options.on_put = [&](const v1::LmHeadUpdate& progress) {
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cerr << "update-lm-head: " << progress.rows_received() << "/" << V << " rows ("
              << (progress.rows_received() * row_bytes >> 20) << " MiB, " << secs << " s)" << std::endl;
  };
  LmHeadRowSource rows;
  rows.read = [&](int64_t r0, int64_t r1, char* dst, const std::function<void(int64_t)>&) -> absl::Status {
    if (absl::Status st = ReadLmHeadRows(*src, r0, r1, dst); !st.ok())
      return absl::DataLossError(absl::StrCat("reading --input ", args.input, ": ", st.message()));
    return absl::OkStatus();
  };
  std::cerr << "update-lm-head: " << args.head << " -> " << args.version << ": " << src->tensor << " [" << V << ", "
            << H << "] " << DTypeName(src->dtype) << " from " << src->file << std::endl;
  GrpcLmHeadUpdateCalls calls(channel, std::chrono::milliseconds(static_cast<int64_t>(args.timeout_seconds * 1000)));
  absl::StatusOr<LmHeadUpdateOutcome> outcome = DriveLmHeadUpdate(calls, begin, rows, options);
  if (!outcome.ok()) {
    PrintError(outcome.status());
    return kExitFailure;
  }
  if (outcome->already_committed) {
    std::cout << args.head << " version " << args.version << " (already committed)" << std::endl;
    return kExitOk;
  }
  std::cerr << "update-lm-head: committed in "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s" << std::endl;
  // Without --sha256 the server hashes the rows after the commit: `heads` lists it once done.
  const v1::LmHeadInfo& committed = outcome->committed;
  std::cout << committed.name() << " version " << committed.version() << " sha256 "
            << (committed.sha256().empty() ? "(computing; see heads)" : committed.sha256()) << std::endl;
  return kExitOk;
}

}  // namespace logprob::client
