// logprob-client's lm_head commands: `heads` lists the server's lm_heads,
// `update-lm-head` replaces one with the weight of a checkpoint (the
// server's update protocol: proto/logprob/v1/logprob.proto "lm_head
// updates"; docs/lm-head-updates.md).
#pragma once

#include <cstdint>
#include <string>

#include "client/commands.h"

namespace logprob::client {

/// Arguments of `heads` and `update-lm-head`.
struct LmHeadArgs {
  std::string server;  // HOST:PORT
  ChannelOptions channel;
  // update-lm-head:
  std::string head;           // --head NAME
  std::string version;        // --version V
  std::string input;          // --input PATH: .safetensors file, index or checkpoint directory
  std::string tensor;         // --tensor NAME (default lm_head.weight, then the tied embedding)
  std::string sha256;         // --sha256 HEX: checked by the server at commit
  int64_t rows_per_call = 0;  // --rows-per-call N (0: kDefaultUpdatePutBytes of rows, at most 90% of max_request_bytes)
  double timeout_seconds = 0;  // --timeout: deadline of each call (0: none)
};

/// `heads`: prints one line per lm_head (name, current version, retained
/// versions, shape, dtype, sha256). Exit kExitOk, or kExitFailure with the
/// server's error on stderr.
int RunHeads(const LmHeadArgs& args);

/// `update-lm-head`: reads the checkpoint's lm_head (common/lm_head_source.h,
/// the server's own rules: tied embeddings, sharded index), opens an update
/// of `head` to `version`, sends the rows in calls of rows_per_call rows
/// (progress on stderr), commits, and prints the committed version: the
/// update driver's steps and retries (common/lm_head_update_driver.h). On
/// any error after opening it aborts the update. Exit kExitOk, kExitBadInput
/// (unreadable checkpoint), kExitFailure (the server refused).
int RunUpdateLmHead(const LmHeadArgs& args);

}  // namespace logprob::client
