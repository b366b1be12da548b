#include "server/heads/begin_checks.h"

#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/finite_check.h"
#include "common/status_macros.h"
#include "common/untrusted_text.h"

namespace logprob {

absl::StatusOr<std::string> CheckBeginFields(const v1::BeginLmHeadUpdateRequest& req) {
  if (const std::string& t = req.client_token();
      !t.empty() &&
      (t.size() < 16 || t.size() > 128 ||
       t.find_first_not_of("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_-") != std::string::npos))
    return absl::InvalidArgumentError("client_token: 16..128 characters of [A-Za-z0-9_-] (a random value per update)");
  std::string sha = absl::AsciiStrToLower(req.sha256());
  if (!sha.empty() && (sha.size() != 64 || sha.find_first_not_of("0123456789abcdef") != std::string::npos))
    return absl::InvalidArgumentError(absl::StrCat("sha256 ", Printable(req.sha256()), ": 64 hex digits expected"));
  return sha;
}

absl::Status CheckBeginShape(const v1::BeginLmHeadUpdateRequest& req, const LmHeadSource& cur) {
  if (req.vocab_size() != cur.vocab_size || req.hidden_size() != cur.hidden_size || req.dtype() != cur.dtype)
    return absl::InvalidArgumentError(
        absl::StrCat("lm_head \"", req.head(), "\" is [", cur.vocab_size, ", ", cur.hidden_size, "] ",
                     DTypeName(cur.dtype), "; the update announces [", req.vocab_size(), ", ", req.hidden_size(), "] ",
                     DTypeName(req.dtype()), " (vocab_size, hidden_size and dtype must be the head's)"));
  return absl::OkStatus();
}

absl::StatusOr<LmHeadTransform> UpdatedTransform(const v1::BeginLmHeadUpdateRequest& req, const LmHeadSource& cur,
                                                 v1::Tensor* bias) {
  LmHeadTransform t = cur.transform;
  if (req.has_logit_scale()) t.logit_scale = req.logit_scale();
  if (req.has_final_logit_softcapping()) t.softcap = req.final_logit_softcapping();
  LOGPROB_RETURN_IF_ERROR(CheckLmHeadScalars(t.logit_scale, t.softcap));
  if (req.has_bias()) {
    const v1::Tensor& b = req.bias();
    if (!IsFloatDType(b.dtype()) || b.shape_size() != 1 || b.shape(0) != cur.vocab_size)
      return absl::InvalidArgumentError(absl::StrCat("bias: ", DTypeName(b.dtype()), " of ", b.shape_size(),
                                                     " dimensions; a [", cur.vocab_size,
                                                     "] F32, BF16 or F16 is needed"));
    const size_t want = static_cast<size_t>(cur.vocab_size) * DTypeSize(b.dtype());
    if (b.source_case() != v1::Tensor::kData || b.data().size() != want)
      return absl::InvalidArgumentError(
          absl::StrCat("bias: its ", want, " bytes must be inline (data); ", b.data().size(), " given"));
    if (const std::optional<int64_t> bad = FirstNonFinite(b.dtype(), b.data().data(), cur.vocab_size))
      return absl::InvalidArgumentError(absl::StrCat("bias[", *bad, "] is not finite"));
    *bias = b;
    bias->set_name("lm_head.bias");
    t.has_bias = true;
  }
  return t;
}

absl::StatusOr<v1::LmHeadUpdate> TakenVersionAnswer(const v1::BeginLmHeadUpdateRequest& req, const std::string& sha,
                                                    int64_t vocab_size, const std::shared_future<std::string>& taken) {
  // A digest still being computed is waited for (at most one hash of the head).
  const std::string held_sha = taken.valid() ? taken.get() : "";
  if (!sha.empty() && sha == held_sha) {
    v1::LmHeadUpdate done;
    done.set_head(req.head());
    done.set_version(req.version());
    done.set_vocab_size(vocab_size);
    done.set_rows_received(vocab_size);
    done.set_already_committed(true);
    return done;
  }
  return absl::AlreadyExistsError(absl::StrCat(
      "lm_head \"", req.head(), "\" already took version name \"", req.version(), "\" (sha256 ",
      held_sha.empty() ? "unknown" : held_sha, sha.empty() ? "; give it to confirm" : ", not the one given",
      "); a version name names one weight for the life of the head: choose a new version name"));
}

absl::Status CheckVersionRoom(const LmHeads& heads, const LmHeadStore& store, const std::string& head,
                              int64_t per_worker, int64_t memory_bytes, int store_files_per_head) {
  if (memory_bytes > 0 && heads.AliveBytesPerWorker() + per_worker > memory_bytes)
    return absl::ResourceExhaustedError(
        absl::StrCat("lm_head update: each worker would hold ", heads.AliveBytesPerWorker() + per_worker,
                     " bytes of lm_head versions (", heads.AliveBytesPerWorker(), " held, ", per_worker,
                     " staged), over --lm-head-memory-bytes ", memory_bytes,
                     "; lower --lm-head-retain or wait for pinned requests of old versions to end"));
  // The store's part of the memory bound: a new file only while the head's
  // files stay within it (a spare is reused, not added).
  if (store_files_per_head > 0 && !store.HasSpare(head)) {
    int64_t in_store = 0;
    for (const internal::v1::LmHeadLoad& v : heads.Alive())
      in_store += v.head().name() == head && store.IsOwn(v.source().file());
    if (in_store + 1 > store_files_per_head)
      return absl::ResourceExhaustedError(
          absl::StrCat("lm_head update: head \"", head, "\" has ", in_store,
                       " versions in the store (retained, or released and still pinned by requests in flight); another "
                       "file would exceed the memory bound's ",
                       store_files_per_head, " (--lm-head-retain + 3): retry once those requests are answered"));
  }
  return absl::OkStatus();
}

}  // namespace logprob
