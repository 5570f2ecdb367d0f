// Python bindings of SlotFile and LogFile (the native SSD backends), registered into
// tieredemb._C by register_ssd(). Rows cross as uint8 [n, row_bytes] blocks (a float32 / float16 / bfloat16
// torch tensor viewed as uint8), ids as int64 [n]; every batch call releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <type_traits>
#include <utility>

#include <memory>
#include <stdexcept>
#include <vector>

#include "log_file.h"
#include "slot_file.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace tieredemb;

namespace {

using Ids = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Bytes = nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using ConstBytes = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

void raise_status(const Status& s) {
  switch (s.code) {
    case Status::kOk: return;
    case Status::kIndexError: throw nb::index_error(s.message.c_str());
    case Status::kValueError: throw nb::value_error(s.message.c_str());
    case Status::kRuntimeError: throw std::runtime_error(s.message);
  }
}

// A native file store that may be closed from Python; every call checks that it is still open.
template <typename F>
struct PyFile {
  std::unique_ptr<F> file;
  F& get() {
    if (!file) throw std::runtime_error("the store's files are closed");
    return *file;
  }
};
using PySlotFile = PyFile<SlotFile>;
using PyLogFile = PyFile<LogFile>;

void check_block(const char* what, size_t rows, size_t cols, int64_t n, int64_t row_bytes) {
  if (static_cast<int64_t>(rows) != n || static_cast<int64_t>(cols) != row_bytes)
    throw nb::value_error((std::string(what) + ": expected uint8 [" + std::to_string(n) + ", " +
                           std::to_string(row_bytes) + "], got [" + std::to_string(rows) + ", " +
                           std::to_string(cols) + "]").c_str());
}

// The rows of a pool named by index (read_to's destination, write_from's source; `what` names
// the pool): rows of row_bytes, one index per id, each inside the pool.
void check_pool_rows(const char* what, size_t pool_rows, size_t cols, const Ids& rows, int64_t n, int64_t row_bytes) {
  const std::string name(what);
  if (static_cast<int64_t>(cols) != row_bytes)
    throw nb::value_error((name + ": rows of " + std::to_string(cols) + " bytes, the table's are " +
                           std::to_string(row_bytes)).c_str());
  if (static_cast<int64_t>(rows.shape(0)) != n)
    throw nb::value_error((name + "_rows: " + std::to_string(rows.shape(0)) + " entries for " + std::to_string(n) +
                           " ids").c_str());
  const int64_t limit = static_cast<int64_t>(pool_rows);
  for (int64_t k = 0; k < n; ++k) {
    if (rows.data()[k] < 0 || rows.data()[k] >= limit)
      throw nb::index_error((name + " row " + std::to_string(rows.data()[k]) + " out of range [0, " +
                             std::to_string(limit) + ")").c_str());
  }
}

template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> vector_to_numpy(std::vector<T>&& v) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(heap->data(), {heap->size()}, owner);
}

}  // namespace

// The methods both stores have, with the same contracts (see slot_file.h).
template <typename Py, typename Cls>
void add_common(Cls& cls) {
  using F = std::remove_reference_t<decltype(std::declval<Py&>().get())>;
  cls
      .def("read", [](Py& self, Ids ids, Bytes out) {
            F& f = self.get();
            const int64_t n = static_cast<int64_t>(ids.shape(0));
            check_block("out", out.shape(0), out.shape(1), n, f.row_bytes());
            std::vector<uint8_t> found(static_cast<size_t>(n));
            Status s;
            {
              nb::gil_scoped_release release;
              s = f.Read(ids.data(), n, out.data(), nullptr, found.data());
            }
            raise_status(s);
            return vector_to_numpy(std::move(found));
          }, "ids"_a.noconvert(), "out"_a.noconvert(),
          "fills out[k] with row ids[k] where it was written; returns found uint8 [n] (0: never written, out[k] untouched)")
      .def("read_to", [](Py& self, Ids ids, Bytes out, Ids out_rows) {
            F& f = self.get();
            const int64_t n = static_cast<int64_t>(ids.shape(0));
            check_pool_rows("out", out.shape(0), out.shape(1), out_rows, n, f.row_bytes());
            std::vector<uint8_t> found(static_cast<size_t>(n));
            Status s;
            {
              nb::gil_scoped_release release;
              s = f.Read(ids.data(), n, out.data(), out_rows.data(), found.data());
            }
            raise_status(s);
            return vector_to_numpy(std::move(found));
          }, "ids"_a.noconvert(), "out"_a.noconvert(), "out_rows"_a.noconvert(),
          "read, with row ids[k] into out[out_rows[k]] (e.g. a cache tier's pool: no staging copy)")
      .def("write", [](Py& self, Ids ids, ConstBytes rows) {
            F& f = self.get();
            const int64_t n = static_cast<int64_t>(ids.shape(0));
            check_block("rows", rows.shape(0), rows.shape(1), n, f.row_bytes());
            Status s;
            {
              nb::gil_scoped_release release;
              s = f.Write(ids.data(), n, rows.data());
            }
            raise_status(s);
          }, "ids"_a.noconvert(), "rows"_a.noconvert(), "writes rows to their slots and marks them written")
      .def("sync", [](Py& self) {
            F& f = self.get();
            Status s;
            {
              nb::gil_scoped_release release;
              s = f.Sync();
            }
            raise_status(s);
          }, "makes every returned write durable: fdatasync of the data, then of the written bitmap")
      .def("written_ids", [](Py& self, int64_t start, int64_t limit) {
            F& f = self.get();
            std::vector<int64_t> ids;
            {
              nb::gil_scoped_release release;
              ids = f.WrittenIds(start, limit);
            }
            return vector_to_numpy(std::move(ids));
          }, "start"_a, "limit"_a, "sorted written ids >= start, at most limit (< 0: all)")
      .def("num_written", [](Py& self) {
            F& f = self.get();
            nb::gil_scoped_release release;
            return f.num_written();
          })
      .def("close", [](Py& self) {
            if (!self.file) return;
            Status s;
            {
              nb::gil_scoped_release release;
              s = self.file->Close();
              self.file.reset();
            }
            raise_status(s);
          }, "closes the files (no sync); safe to call twice")
      .def_prop_ro("replayed", [](Py& self) { return self.get().replayed(); },
                   "rows the last open restored from the log past the last sync")
      .def_prop_ro("row_bytes", [](Py& self) { return self.get().row_bytes(); })
      .def_prop_ro("num_rows", [](Py& self) { return self.get().num_rows(); })
      .def_prop_ro("closed", [](Py& self) { return !self.file; });
}

void register_ssd(nb::module_& m) {
  auto slot = nb::class_<PySlotFile>(m, "SlotFile",
                         "Rows in fixed-size slots of one file (slot i at i * slot_bytes) plus a written-bitmap file")
      .def_static("open", [](const std::string& data_path, const std::string& bitmap_path, const std::string& log_path,
                             int64_t num_rows, int64_t row_bytes, int64_t slot_bytes, bool create, bool direct,
                             int io_threads) {
            auto py = std::make_unique<PySlotFile>();
            Status s;
            {
              nb::gil_scoped_release release;
              s = SlotFile::Open(data_path, bitmap_path, log_path, num_rows, row_bytes, slot_bytes, create, direct,
                                 io_threads, &py->file);
            }
            raise_status(s);
            return py;
          }, "data_path"_a, "bitmap_path"_a, "log_path"_a, "num_rows"_a, "row_bytes"_a, "slot_bytes"_a, "create"_a,
          "direct"_a, "io_threads"_a,
          "opens or creates the table files; RuntimeError (message starting 'corrupted:' for a file of the wrong size)")
      .def_prop_ro("slot_bytes", [](PySlotFile& self) { return self.get().slot_bytes(); })
      .def_prop_ro("direct", [](PySlotFile& self) { return self.get().direct(); })
      .def_prop_ro("io_threads", [](PySlotFile& self) { return self.get().io_threads(); });
  add_common<PySlotFile>(slot);

  auto log = nb::class_<PyLogFile>(m, "LogFile", "Rows appended to segment files, located by an in-memory index")
      .def_static("open", [](const std::string& dir, int64_t num_rows, int64_t row_bytes, int64_t segment_bytes,
                             bool create, bool direct, int io_threads) {
            auto py = std::make_unique<PyLogFile>();
            Status s;
            {
              nb::gil_scoped_release release;
              s = LogFile::Open(dir, num_rows, row_bytes, segment_bytes, create, direct, io_threads, &py->file);
            }
            raise_status(s);
            return py;
          }, "dir"_a, "num_rows"_a, "row_bytes"_a, "segment_bytes"_a, "create"_a, "direct"_a, "io_threads"_a,
          "opens (replaying the log) or creates the table; RuntimeError ('corrupted: ...' for damaged files)")
      .def("checkpoint", [](PyLogFile& self, const std::string& dst_dir) {
            LogFile& f = self.get();
            Status s;
            {
              nb::gil_scoped_release release;
              s = f.Checkpoint(dst_dir);
            }
            raise_status(s);
          }, "dst_dir"_a, "syncs, then links every segment into dst_dir (an empty directory) with a flush mark")
      .def("write_from", [](PyLogFile& self, Ids ids, ConstBytes src, Ids src_rows) {
            LogFile& f = self.get();
            const int64_t n = static_cast<int64_t>(ids.shape(0));
            check_pool_rows("src", src.shape(0), src.shape(1), src_rows, n, f.row_bytes());
            Status s;
            {
              nb::gil_scoped_release release;
              s = f.WriteFrom(ids.data(), n, src.data(), f.row_bytes(), src_rows.data());
            }
            raise_status(s);
          }, "ids"_a.noconvert(), "src"_a.noconvert(), "src_rows"_a.noconvert(),
          "writes rows src[src_rows[k]] as the rows of ids[k] (no gather)")
      .def("log_stats", [](PyLogFile& self) {
            LogFile& f = self.get();
            nb::dict d;
            d["live_bytes"] = f.live_bytes();
            d["log_bytes"] = f.log_bytes();
            d["segments"] = f.num_segments();
            d["compactions"] = f.compactions();
            d["rows_compacted"] = f.rows_compacted();
            return d;
          });
  add_common<PyLogFile>(log);
}
