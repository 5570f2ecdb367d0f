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

// The same for a batch made of segments of disjoint id ranges (a collection's tables, one after
// another): segment k is ids[starts[k], starts[k + 1]) and holds ids in [row_ends[k - 1],
// row_ends[k]) (row_ends[-1] = 0; row_ends ascending, the last <= num_embeddings). Then no id
// appears in two segments, so each is deduplicated alone, in parallel, with a table sized for
// it, and the result is dedup()'s: the segments' unique ids one after another are the batch's
// in order of first occurrence. Returns ValueError for bad starts or row_ends and IndexError
// for the first id outside its segment's range, having written nothing.
Status dedup_segments(const int64_t* ids, int64_t n, int64_t num_embeddings, const int64_t* starts,
                      const int64_t* row_ends, int64_t segments, std::vector<int64_t>* unique, int64_t* inverse);

}  // namespace tieredemb
