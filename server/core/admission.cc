#include "server/core/admission.h"

#include "absl/strings/str_cat.h"
#include "common/error_reason.h"

namespace logprob {

Admission::Ticket::~Ticket() {
  if (!owner_) return;
  absl::MutexLock lock(&owner_->mu_);
  owner_->tokens_ -= tokens_;
  owner_->bytes_ -= bytes_;
  --owner_->requests_;
  owner_->room_.SignalAll();
  if (owner_->observer_) owner_->observer_(owner_->requests_, owner_->tokens_, owner_->bytes_);
}

Admission::Ticket& Admission::Ticket::operator=(Ticket&& o) noexcept {
  if (this != &o) {
    Ticket gone(std::move(*this));
    owner_ = o.owner_;
    tokens_ = o.tokens_;
    bytes_ = o.bytes_;
    o.owner_ = nullptr;
  }
  return *this;
}

absl::Status Admission::Refusal(int64_t tokens, int64_t bytes) const {
  return WithReason(
      absl::ResourceExhaustedError(absl::StrCat(
          "server at capacity: ", requests_, " requests with ", tokens_, " tokens and ", bytes_,
          " bytes in flight; this one (", tokens, " tokens, ", bytes, " bytes) would exceed --max-queue-tokens ",
          max_tokens_, " or --max-queue-bytes ", max_bytes_, "; retry with backoff")),
      v1::AT_CAPACITY);
}

bool Admission::FitsLocked(const Ticket* held, int64_t tokens, int64_t bytes) const {
  // A request alone in flight may be (or grow) over a limit; what a ticket
  // gives back always fits.
  if (held == nullptr) return requests_ == 0 || (tokens_ + tokens <= max_tokens_ && bytes_ + bytes <= max_bytes_);
  const int64_t more_tokens = tokens - held->tokens_, more_bytes = bytes - held->bytes_;
  return requests_ <= 1 || ((more_tokens <= 0 || tokens_ + more_tokens <= max_tokens_) &&
                            (more_bytes <= 0 || bytes_ + more_bytes <= max_bytes_));
}

absl::StatusOr<Admission::Ticket> Admission::Admit(int64_t tokens, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (!FitsLocked(nullptr, tokens, bytes)) return Refusal(tokens, bytes);
  tokens_ += tokens;
  bytes_ += bytes;
  ++requests_;
  if (observer_) observer_(requests_, tokens_, bytes_);
  return Ticket(this, tokens, bytes);
}

absl::Status Admission::Resize(Ticket* ticket, int64_t tokens, int64_t bytes) {
  if (ticket->empty()) {
    absl::StatusOr<Ticket> t = Admit(tokens, bytes);
    if (!t.ok()) return t.status();
    *ticket = *std::move(t);
    return absl::OkStatus();
  }
  absl::MutexLock lock(&mu_);
  const int64_t more_tokens = tokens - ticket->tokens_, more_bytes = bytes - ticket->bytes_;
  if (!FitsLocked(ticket, tokens, bytes)) return Refusal(tokens, bytes);
  tokens_ += more_tokens;
  bytes_ += more_bytes;
  ticket->tokens_ = tokens;
  ticket->bytes_ = bytes;
  if (more_tokens < 0 || more_bytes < 0) room_.SignalAll();
  if (observer_) observer_(requests_, tokens_, bytes_);
  return absl::OkStatus();
}

absl::Status Admission::ResizeWaiting(Ticket* ticket, int64_t tokens, int64_t bytes, absl::Time deadline) {
  for (;;) {
    absl::Status st = Resize(ticket, tokens, bytes);
    if (st.code() != absl::StatusCode::kResourceExhausted) return st;
    absl::MutexLock lock(&mu_);
    // Room made between the failed Resize and this lock is seen here.
    if (!FitsLocked(ticket->empty() ? nullptr : ticket, tokens, bytes) && room_.WaitWithDeadline(&mu_, deadline))
      return st;  // timed out
  }
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
