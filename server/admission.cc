#include "server/admission.h"

#include "absl/strings/str_cat.h"
#include "common/error_reason.h"

namespace logprob {

Admission::Ticket::~Ticket() {
  if (!owner_) return;
  absl::MutexLock lock(&owner_->mu_);
  owner_->tokens_ -= tokens_;
  owner_->bytes_ -= bytes_;
  --owner_->requests_;
  if (owner_->observer_) owner_->observer_(owner_->requests_, owner_->tokens_);
}

absl::StatusOr<Admission::Ticket> Admission::Admit(int64_t tokens, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (requests_ > 0 && (tokens_ + tokens > max_tokens_ || bytes_ + bytes > max_bytes_))
    return WithReason(
        absl::ResourceExhaustedError(absl::StrCat(
            "server at capacity: ", requests_, " requests with ", tokens_, " tokens and ", bytes_,
            " bytes in flight; this one (", tokens, " tokens, ", bytes, " bytes) would exceed --max-queue-tokens ",
            max_tokens_, " or --max-queue-bytes ", max_bytes_, "; retry with backoff")),
        v1::AT_CAPACITY);
  tokens_ += tokens;
  bytes_ += bytes;
  ++requests_;
  if (observer_) observer_(requests_, tokens_);
  return Ticket(this, tokens, bytes);
}

bool Admission::Fits(int64_t bytes) const {
  absl::MutexLock lock(&mu_);
  return requests_ == 0 || bytes_ + bytes <= max_bytes_;
}

int64_t Admission::tokens() const {
  absl::MutexLock lock(&mu_);
  return tokens_;
}
int64_t Admission::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}
int64_t Admission::requests() const {
  absl::MutexLock lock(&mu_);
  return requests_;
}

}  // namespace logprob
