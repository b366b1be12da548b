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
/// token positions scored (`scored_tokens`, CountScoredTokens: padding,
/// each sequence's last position for next_token and ignored targets left
/// out; -1: unknown), the `input_rows` sent (B*S or T) when they differ,
/// `seconds` taken, scored tokens/s and, when `parts` > 1, how many
/// requests were sent. Lines end with '\n'.
std::string SummarizeScore(const std::vector<v1::Tensor>& outputs, int64_t scored_tokens, int64_t input_rows,
                           double seconds, int parts);

}  // namespace logprob::client
