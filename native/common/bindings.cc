// Python bindings of common/: the thread count of this module's pool, host pools, and row copies
// between pools. Registered into both extension modules (tieredemb._C and ssd_backend._C), each
// of which has its own thread pool.
#include "common/bindings.h"

#include "common/host_buffer.h"
#include "common/row_moves.h"
#include "common/thread_pool.h"

namespace tieredemb {

using namespace nb::literals;

namespace {

// Ok if rows is in [0, limit], else ValueError naming the argument.
Status check_prefix(const char* what, int64_t rows, int64_t limit) {
  if (rows >= 0 && rows <= limit) return Status::Ok();
  return Status::ValueError(std::string(what) + " " + std::to_string(rows) + " must be in [0, rows = " +
                            std::to_string(limit) + "]");
}

}  // namespace

void register_common(nb::module_& m) {
  m.def("set_num_threads", [](int n) { ThreadPool::instance().set_num_threads(n); }, "n"_a,
        nb::call_guard<GilReleased>(), "threads of this module's pool for batch loops");

  m.def("host_pool", [](int64_t rows, int64_t width, bool populate, bool huge_pages, int64_t populate_rows,
                        int64_t huge_pages_rows) {
        if (rows < 0 || width <= 0)
          throw nb::value_error(("host_pool needs rows >= 0 and width > 0, got rows " + std::to_string(rows) +
                                 ", width " + std::to_string(width)).c_str());
        raise_if_error(check_prefix("populate_rows", populate_rows, rows));
        raise_if_error(check_prefix("huge_pages_rows", huge_pages_rows, rows));
        if (static_cast<size_t>(width) > static_cast<size_t>(PTRDIFF_MAX) / sizeof(float))
          throw nb::value_error(("host_pool width " + std::to_string(width) + " is past the address space").c_str());
        const size_t row_bytes = static_cast<size_t>(width) * sizeof(float);
        if (static_cast<size_t>(rows) > static_cast<size_t>(PTRDIFF_MAX) / row_bytes)
          throw nb::value_error(("host_pool of " + std::to_string(rows) + " rows of " + std::to_string(row_bytes) +
                                 " bytes is past the address space").c_str());
        const size_t populated = static_cast<size_t>(populate ? rows : populate_rows) * row_bytes;
        const size_t huge = static_cast<size_t>(huge_pages ? rows : huge_pages_rows) * row_bytes;
        auto* buf = new HostBuffer();
        std::string err;
        {
          GilReleased released;
          err = buf->allocate(static_cast<size_t>(rows) * row_bytes, populated, huge);
        }
        if (!err.empty()) {
          delete buf;
          throw std::runtime_error(err);
        }
        nb::capsule owner(buf, [](void* p) noexcept { delete static_cast<HostBuffer*>(p); });
        return nb::ndarray<nb::numpy, float, nb::ndim<2>>(
            buf->data(), {static_cast<size_t>(rows), static_cast<size_t>(width)}, owner);
      }, "rows"_a, "width"_a, "populate"_a = false, "huge_pages"_a = false, nb::kw_only(), "populate_rows"_a = 0,
      "huge_pages_rows"_a = 0,
      "a zero-filled float32 [rows, width] array, reserved lazily (O(1) to create) except its first populate_rows "
      "rows (all rows if populate), faulted in now; its first huge_pages_rows rows (all if huge_pages) are advised "
      "to transparent huge pages");

  m.def("copy_rows", [](ConstRows src, Ids src_rows, Rows dst, Ids dst_rows) {
        if (src.shape(1) != dst.shape(1))
          throw nb::value_error(("copy_rows: src rows have " + std::to_string(src.shape(1)) + " floats, dst rows " +
                                 std::to_string(dst.shape(1))).c_str());
        const int64_t n = static_cast<int64_t>(src_rows.shape(0));
        if (static_cast<int64_t>(dst_rows.shape(0)) != n)
          throw nb::value_error(("copy_rows: " + std::to_string(n) + " src_rows but " +
                                 std::to_string(dst_rows.shape(0)) + " dst_rows").c_str());
        run_without_gil([&] {
          Status s = check_slots("copy_rows src row", src_rows.data(), n, static_cast<int64_t>(src.shape(0)));
          if (s.ok()) s = check_slots("copy_rows dst row", dst_rows.data(), n, static_cast<int64_t>(dst.shape(0)));
          if (s.ok()) copy_rows(src.data(), src_rows.data(), dst.data(), dst_rows.data(), n, src.shape(1));
          return s;
        });
      }, "src"_a.noconvert(), "src_rows"_a.noconvert(), "dst"_a.noconvert(), "dst_rows"_a.noconvert(),
      "dst[dst_rows[i]] = src[src_rows[i]]");
}

}  // namespace tieredemb
