// The short human-readable report `logprob-client score` prints on success.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "logprob/v1/logprob.pb.h"

namespace logprob::client {

/// One line per output tensor ("name DTYPE [d0, d1, ...]"); the
/// `token_logprobs` line (F32) adds the mean and count of its non-zero
/// finite entries and the count of -inf entries. A last line gives the
/// `tokens` scored, `seconds` taken, tokens/s and, when `parts` > 1, how
/// many requests were sent. Lines end with '\n'.
std::string SummarizeScore(const std::vector<v1::Tensor>& outputs, int64_t tokens, double seconds, int parts);

}  // namespace logprob::client
