// Row moves between host pools of the same width, for tiers that read and write each other's
// rows in place (no staging copy). Rows are float32 [rows, width], row-major.
#pragma once

#include <cstdint>

namespace tieredemb {

// dst[dst_rows[i]] = src[src_rows[i]] for i < n.
void copy_rows(const float* src, const int64_t* src_rows, float* dst, const int64_t* dst_rows, int64_t n,
               int64_t width);

// Packs n rows of row_bytes each into dst: row k from src + src_rows[k] * src_stride (bytes;
// src_rows null: k), e.g. a pool's rows on their way into a store's record. In parallel, loading the rows ahead.
void gather_rows(const uint8_t* src, int64_t src_stride, const int64_t* src_rows, int64_t n, uint8_t* dst,
                 int64_t row_bytes);

}  // namespace tieredemb
