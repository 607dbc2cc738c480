// Unguessable identifiers: per-job shared-memory names and the TCP mesh's shared secret.
#pragma once

#include <cstddef>
#include <string>

namespace smddp {

// `bytes` random bytes from the kernel (getrandom), as lowercase hex.
std::string randomHex(size_t bytes);

}  // namespace smddp
