#include "worker/gradients/head_gradient_steps.h"

#include <algorithm>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace logprob {

namespace {

/// Bytes of a step's sums: rows x H floats, plus rows with a bias; -1 on
/// overflow or a bad shape.
int64_t StepBytes(int64_t rows, int64_t hidden_size, bool bias) {
  if (rows <= 0 || hidden_size <= 0) return -1;
  const int64_t per_row = hidden_size + (bias ? 1 : 0);
  if (rows > INT64_MAX / per_row / static_cast<int64_t>(sizeof(float))) return -1;
  return rows * per_row * static_cast<int64_t>(sizeof(float));
}

/// The payload NothingAdded sets.
constexpr char kNothingAdded[] = "logprob.gradient-step.nothing-added";

}  // namespace

absl::Status HeadGradientSteps::NothingAdded(absl::Status error) {
  error.SetPayload(kNothingAdded, absl::Cord("1"));
  return error;
}

absl::Status HeadGradientSteps::EndedLocked(const std::string& step) const {
  const auto it = ended_.find(step);
  if (it == ended_.end()) return absl::OkStatus();
  if (it->second == "closed")
    return absl::AlreadyExistsError(absl::StrCat("gradient step '", step,
                                                 "' was closed (its sums fetched): a step key is used once; name "
                                                 "the next step with a new key"));
  return absl::FailedPreconditionError(absl::StrCat("gradient step '", step, "' was dropped (", it->second,
                                                    "): its sums are lost; run the step again under a new key"));
}

void HeadGradientSteps::EndLocked(const std::string& step, const std::string& why) {
  const auto it = steps_.find(step);
  if (it != steps_.end()) {
    bytes_ -= it->second->bytes;
    steps_.erase(it);
  }
  if (ended_.emplace(step, why).second) {
    ended_order_.push_back(step);
    if (ended_order_.size() > kClosedKeys) {
      ended_.erase(ended_order_.front());
      ended_order_.pop_front();
    }
  } else {
    ended_[step] = why;
  }
}

int HeadGradientSteps::SweepLocked(absl::Time now) {
  std::vector<std::string> idle;
  for (const auto& [key, step] : steps_)
    if (now - step->last_used > options_.idle_timeout) idle.push_back(key);
  for (const std::string& key : idle)
    EndLocked(key, absl::StrCat("idle for more than ", absl::FormatDuration(options_.idle_timeout)));
  return static_cast<int>(idle.size());
}

int HeadGradientSteps::Sweep(absl::Time now) {
  absl::MutexLock lock(&mu_);
  return SweepLocked(now);
}

absl::Status HeadGradientSteps::Accumulate(const std::string& step, const std::string& head, const std::string& version,
                                           int64_t rows, int64_t hidden_size, bool bias, int64_t tokens,
                                           const std::function<absl::Status(HeadGradientSums&)>& add, absl::Time now) {
  if (step.empty()) return absl::InvalidArgumentError("gradient step: the key is empty");
  const int64_t bytes = StepBytes(rows, hidden_size, bias);
  if (bytes < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("gradient step '", step, "': bad slice shape [", rows, ", ", hidden_size, "]"));
  std::shared_ptr<Step> held;
  {
    absl::MutexLock lock(&mu_);
    SweepLocked(now);
    if (absl::Status ended = EndedLocked(step); !ended.ok()) return ended;
    auto it = steps_.find(step);
    if (it == steps_.end()) {
      if (bytes_ + bytes > options_.max_bytes)
        return absl::ResourceExhaustedError(absl::StrCat("gradient step '", step, "': its sums (", bytes,
                                                         " bytes) do not fit: ", steps_.size(), " open step(s) hold ",
                                                         bytes_, " of the worker's ", options_.max_bytes,
                                                         " bytes; fetch and close finished steps (they expire after ",
                                                         absl::FormatDuration(options_.idle_timeout), " idle)"));
      auto fresh = std::make_shared<Step>();
      fresh->bytes = bytes;
      {
        absl::MutexLock step_lock(&fresh->mu);
        HeadGradientSums& s = fresh->sums;
        s.head = head;
        s.version = version;
        s.rows = rows;
        s.hidden_size = hidden_size;
        // The [rows, H] sums are allocated under the step's own lock
        // (Step::Zeroed), not while every step waits on this one.
        s.has_bias = bias;
        if (bias) s.bias.assign(static_cast<size_t>(rows), 0.0f);
      }
      bytes_ += bytes;
      it = steps_.emplace(step, std::move(fresh)).first;
    }
    it->second->last_used = now;
    held = it->second;
  }
  absl::Status added;
  {
    absl::MutexLock step_lock(&held->mu);
    HeadGradientSums& s = held->sums;
    if (s.head != head || s.version != version)
      return absl::FailedPreconditionError(absl::StrCat("gradient step '", step, "' accumulates head '", s.head,
                                                        "' version '", s.version, "'; this backward is for head '",
                                                        head, "' version '", version,
                                                        "': every backward of a step uses the same head version"));
    if (s.rows != rows || s.hidden_size != hidden_size || s.bias.empty() == bias)
      return absl::InvalidArgumentError(absl::StrCat("gradient step '", step, "': slice [", rows, ", ", hidden_size,
                                                     bias ? "] with a bias" : "]", " is not the step's [", s.rows, ", ",
                                                     s.hidden_size, s.bias.empty() ? "]" : "] with a bias"));
    added = add(held->Zeroed());
    if (added.ok()) {
      ++s.micro_batches;
      s.tokens += tokens;
    }
  }
  if (!added.ok() && !added.GetPayload(kNothingAdded).has_value()) {
    absl::MutexLock lock(&mu_);
    // Only the step this call held (a sweep may have ended it meanwhile).
    const auto it = steps_.find(step);
    if (it != steps_.end() && it->second == held)
      EndLocked(step, absl::StrCat("a backward failed while adding to it: ", added.message()));
  }
  return added;
}

absl::StatusOr<HeadGradientSums> HeadGradientSteps::Read(const std::string& step, int64_t row_begin, int64_t row_end,
                                                         absl::Time now) {
  std::shared_ptr<Step> held;
  {
    absl::MutexLock lock(&mu_);
    SweepLocked(now);
    if (absl::Status ended = EndedLocked(step); !ended.ok()) return ended;
    const auto it = steps_.find(step);
    if (it == steps_.end())
      return absl::NotFoundError(absl::StrCat("gradient step '", step, "': no backward has added to it"));
    it->second->last_used = now;
    held = it->second;
  }
  absl::MutexLock step_lock(&held->mu);
  const HeadGradientSums& s = held->Zeroed();
  if (row_begin < 0 || row_end < row_begin || row_end > s.rows)
    return absl::OutOfRangeError(absl::StrCat("gradient step '", step, "': rows [", row_begin, ", ", row_end,
                                              ") are outside the slice's ", s.rows));
  HeadGradientSums out;
  out.head = s.head;
  out.version = s.version;
  out.rows = s.rows;
  out.hidden_size = s.hidden_size;
  out.has_bias = s.has_bias;
  out.micro_batches = s.micro_batches;
  out.tokens = s.tokens;
  out.weight.assign(s.weight.begin() + row_begin * s.hidden_size, s.weight.begin() + row_end * s.hidden_size);
  if (!s.bias.empty()) out.bias.assign(s.bias.begin() + row_begin, s.bias.begin() + row_end);
  return out;
}

absl::Status HeadGradientSteps::Close(const std::string& step) {
  if (step.empty()) return absl::InvalidArgumentError("gradient step: the key is empty");
  absl::MutexLock lock(&mu_);
  if (ended_.count(step)) return absl::OkStatus();
  EndLocked(step, "closed");
  return absl::OkStatus();
}

int64_t HeadGradientSteps::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

size_t HeadGradientSteps::open_steps() const {
  absl::MutexLock lock(&mu_);
  return steps_.size();
}

}  // namespace logprob
