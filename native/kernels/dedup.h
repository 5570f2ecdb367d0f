// Dedup of a batch's ids: the first step of every lookup (ids -> unique ids -> tier slots).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"

namespace tieredemb {

// Replaces ids by the first occurrence of each distinct id: unique[U] in order of first
// occurrence, inverse[N] with ids[i] == unique[inverse[i]]. Returns IndexError for the first id
// outside [0, num_embeddings), having written nothing.
Status dedup(const int64_t* ids, int64_t n, int64_t num_embeddings, std::vector<int64_t>* unique,
             int64_t* inverse);

}  // namespace tieredemb
