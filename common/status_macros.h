// Early returns on errors: LOGPROB_RETURN_IF_ERROR and
// LOGPROB_ASSIGN_OR_RETURN.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

/// Evaluates `expr` (an absl::Status, or a grpc::Status in a function that
/// returns one) once and returns it from the enclosing function when it is
/// not OK.
#define LOGPROB_RETURN_IF_ERROR(expr)                                                 \
  do {                                                                                \
    if (auto logprob_status_ = (expr); !logprob_status_.ok()) return logprob_status_; \
  } while (0)

/// `LOGPROB_ASSIGN_OR_RETURN(lhs, rexpr);` evaluates `rexpr` (an
/// absl::StatusOr<T>) once; returns its status from the enclosing function
/// when it is not OK, else moves its value into `lhs` (a declaration such
/// as `auto x` or an existing variable). Not inside an unbraced if/else.
#define LOGPROB_ASSIGN_OR_RETURN(lhs, rexpr) \
  LOGPROB_ASSIGN_OR_RETURN_IMPL_(LOGPROB_STATUS_CONCAT_(logprob_statusor_, __LINE__), lhs, rexpr)

#define LOGPROB_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                   \
  if (!statusor.ok()) return std::move(statusor).status();   \
  lhs = std::move(*statusor)
#define LOGPROB_STATUS_CONCAT_(a, b) LOGPROB_STATUS_CONCAT_INNER_(a, b)
#define LOGPROB_STATUS_CONCAT_INNER_(a, b) a##b
