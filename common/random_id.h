// Random ids: update ids, client tokens, session and file names.
#pragma once

#include <string>

namespace logprob {

/// `bytes` bytes from the kernel's CSPRNG (getrandom, retried on EINTR) in
/// lower-case hex: 2 * `bytes` characters, unguessable (an update id is the
/// capability to put to the update). Aborts when the kernel gives no
/// random bytes rather than return a guessable id. Thread-safe.
std::string RandomId(int bytes = 16);

}  // namespace logprob
