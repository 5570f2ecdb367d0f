// Python bindings of SlotFile and LogFile (the native SSD files), in ssd_backend._C. Rows cross
// as uint8 [n, row_bytes] blocks (a float32 / float16 / bfloat16 torch tensor viewed as uint8),
// ids as int64 [n]; every batch call releases the GIL, its checks included (common/bindings.h).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/bindings.h"
#include "ssd/log_file.h"
#include "ssd/slot_file.h"
#include "ssd/stream_io.h"

namespace tieredemb {

using namespace nb::literals;

namespace {

// A native file store that may be closed from Python; every call checks that it is still open.
// One call at a time (the files' contract): a call from a second thread waits for the one
// running instead of racing it (two threads writing one store crashed the process). serial()
// is taken first in every call, with the GIL released while it waits: the holder gives the
// GIL up inside its call.
template <typename F>
struct PyFile {
  std::unique_ptr<F> file;
  std::mutex mu;
  F& get() {
    if (!file) throw std::runtime_error("the store's files are closed");
    return *file;
  }
  std::unique_lock<std::mutex> serial() {
    std::unique_lock<std::mutex> lock(mu, std::try_to_lock);
    if (!lock.owns_lock()) {
      GilReleased released;
      lock.lock();
    }
    return lock;
  }
};
using PySlotFile = PyFile<SlotFile>;
using PyLogFile = PyFile<LogFile>;

// A StreamIo and the Python LogFile it reads and writes (kept alive with it).
struct PyStreamIo {
  nb::object file;
  int64_t row_bytes = 0;
  std::unique_ptr<StreamIo> io;  // (a call finds the files closed, if they are, when it runs: an error it keeps)
};

// The rows of a pool named by index (read_to's destination, write_from's source; `what` names
// the pool): rows of row_bytes, one index per id, each inside the pool. The O(n) part of the
// check runs with the GIL released: its Status is returned.
Status check_pool_rows(const std::string& what, size_t pool_rows, size_t cols, const Ids& rows, int64_t n,
                       int64_t row_bytes) {
  if (static_cast<int64_t>(cols) != row_bytes)
    return Status::ValueError(what + ": rows of " + std::to_string(cols) + " bytes, the table's are " +
                              std::to_string(row_bytes));
  if (static_cast<int64_t>(rows.shape(0)) != n)
    return Status::ValueError(what + "_rows: " + std::to_string(rows.shape(0)) + " entries for " + std::to_string(n) +
                              " ids");
  return check_slots(what + " row", rows.data(), n, static_cast<int64_t>(pool_rows));
}

// The methods both stores have, with the same contracts (see slot_file.h).
template <typename Py, typename Cls>
void add_common(Cls& cls) {
  using F = std::remove_reference_t<decltype(std::declval<Py&>().get())>;
  cls
      .def("read", [](Py& self, Ids ids, Bytes out) {
            auto serial = self.serial();
            F& f = self.get();
            const int64_t n = static_cast<int64_t>(ids.shape(0));
            raise_if_error(check_rows("out (uint8)", out.shape(0), n, out.shape(1), f.row_bytes()));
            std::vector<uint8_t> found(static_cast<size_t>(n));
            run_without_gil([&] { return f.Read(ids.data(), n, out.data(), nullptr, found.data()); });
            return to_numpy(std::move(found));
          }, "ids"_a.noconvert(), "out"_a.noconvert(),
          "fills out[k] with row ids[k] where it was written; returns found uint8 [n] (0: never written, out[k] untouched)")
      .def("read_to", [](Py& self, Ids ids, Bytes out, Ids out_rows) {
            auto serial = self.serial();
            F& f = self.get();
            const int64_t n = static_cast<int64_t>(ids.shape(0));
            std::vector<uint8_t> found(static_cast<size_t>(n));
            run_without_gil([&] {
              Status s = check_pool_rows("out", out.shape(0), out.shape(1), out_rows, n, f.row_bytes());
              return s.ok() ? f.Read(ids.data(), n, out.data(), out_rows.data(), found.data()) : s;
            });
            return to_numpy(std::move(found));
          }, "ids"_a.noconvert(), "out"_a.noconvert(), "out_rows"_a.noconvert(),
          "read, with row ids[k] into out[out_rows[k]] (e.g. a cache tier's pool: no staging copy)")
      .def("write", [](Py& self, Ids ids, ConstBytes rows) {
            auto serial = self.serial();
            F& f = self.get();
            const int64_t n = static_cast<int64_t>(ids.shape(0));
            raise_if_error(check_rows("rows (uint8)", rows.shape(0), n, rows.shape(1), f.row_bytes()));
            run_without_gil([&] { return f.Write(ids.data(), n, rows.data()); });
          }, "ids"_a.noconvert(), "rows"_a.noconvert(), "writes rows to their slots and marks them written")
      .def("sync", [](Py& self) {
            auto serial = self.serial();
            F& f = self.get();
            run_without_gil([&] { return f.Sync(); });
          }, "makes every returned write durable: fdatasync of the data, then of the written bitmap")
      .def("written_ids", [](Py& self, int64_t start, int64_t limit) {
            auto serial = self.serial();
            F& f = self.get();
            std::vector<int64_t> ids;
            {
              GilReleased released;
              ids = f.WrittenIds(start, limit);
            }
            return to_numpy(std::move(ids));
          }, "start"_a, "limit"_a, "sorted written ids >= start, at most limit (< 0: all)")
      .def("num_written", [](Py& self) {
            auto serial = self.serial();
            F& f = self.get();
            GilReleased released;
            return f.num_written();
          })
      .def("close", [](Py& self) {
            auto serial = self.serial();
            if (!self.file) return;
            run_without_gil([&] {
              Status s = self.file->Close();
              self.file.reset();
              return s;
            });
          }, "closes the files (no sync); safe to call twice")
      .def_prop_ro("replayed", [](Py& self) {
            auto serial = self.serial();
            return self.get().replayed();
          },
                   "rows the last open restored from the log past the last sync");
}

}  // namespace

void register_ssd(nb::module_& m) {
  auto slot = nb::class_<PySlotFile>(m, "SlotFile",
                         "Rows in fixed-size slots of one file (slot i at i * slot_bytes) plus a written-bitmap file")
      .def_static("open", [](const std::string& data_path, const std::string& bitmap_path, const std::string& log_path,
                             int64_t num_rows, int64_t row_bytes, int64_t slot_bytes, bool create, bool direct,
                             int io_threads) {
            auto py = std::make_unique<PySlotFile>();
            run_without_gil([&] {
              return SlotFile::Open(data_path, bitmap_path, log_path, num_rows, row_bytes, slot_bytes, create, direct,
                                    io_threads, &py->file);
            });
            return py;
          }, "data_path"_a, "bitmap_path"_a, "log_path"_a, "num_rows"_a, "row_bytes"_a, "slot_bytes"_a, "create"_a,
          "direct"_a, "io_threads"_a,
          "opens or creates the table files; RuntimeError (message starting 'corrupted:' for a file of the wrong size)");
  add_common<PySlotFile>(slot);

  auto log = nb::class_<PyLogFile>(m, "LogFile", "Rows appended to segment files, located by an in-memory index")
      .def_static("open", [](const std::string& dir, int64_t num_rows, int64_t row_bytes, int64_t segment_bytes,
                             bool create, bool direct, int io_threads) {
            auto py = std::make_unique<PyLogFile>();
            run_without_gil([&] {
              return LogFile::Open(dir, num_rows, row_bytes, segment_bytes, create, direct, io_threads, &py->file);
            });
            return py;
          }, "dir"_a, "num_rows"_a, "row_bytes"_a, "segment_bytes"_a, "create"_a, "direct"_a, "io_threads"_a,
          "opens (replaying the log) or creates the table; RuntimeError ('corrupted: ...' for damaged files)")
      .def("checkpoint", [](PyLogFile& self, const std::string& dst_dir) {
            auto serial = self.serial();
            LogFile& f = self.get();
            run_without_gil([&] { return f.Checkpoint(dst_dir); });
          }, "dst_dir"_a, "syncs, then links every segment into dst_dir (an empty directory) with a flush mark")
      .def("write_from", [](PyLogFile& self, Ids ids, ConstBytes src, Ids src_rows) {
            auto serial = self.serial();
            LogFile& f = self.get();
            const int64_t n = static_cast<int64_t>(ids.shape(0));
            run_without_gil([&] {
              Status s = check_pool_rows("src", src.shape(0), src.shape(1), src_rows, n, f.row_bytes());
              return s.ok() ? f.WriteFrom(ids.data(), n, src.data(), f.row_bytes(), src_rows.data()) : s;
            });
          }, "ids"_a.noconvert(), "src"_a.noconvert(), "src_rows"_a.noconvert(),
          "writes rows src[src_rows[k]] as the rows of ids[k] (no gather)")
      .def("take_write_times", [](PyLogFile& self) {
            auto serial = self.serial();
            LogFile::WriteTimes t;
            {
              GilReleased released;
              t = self.get().TakeWriteTimes();
            }
            nb::dict d;
            d["writes"] = t.writes;
            d["drain_seconds"] = static_cast<double>(t.drain_ns) * 1e-9;
            d["stage_seconds"] = static_cast<double>(t.stage_ns) * 1e-9;
            d["compact_seconds"] = static_cast<double>(t.compact_ns) * 1e-9;
            d["appends"] = t.appends;
            d["append_seconds"] = static_cast<double>(t.append_ns) * 1e-9;
            d["appended_bytes"] = t.appended_bytes;
            return d;
          }, "where the writes' time went since the last take_write_times(): waiting for the last append (drain), "
             "staging the record, compacting; and the writer thread's appends (seconds, and the bytes appended)")
      .def("log_stats", [](PyLogFile& self) {
            auto serial = self.serial();
            LogFile& f = self.get();
            int64_t live, log, segments, compactions, rows_compacted;
            {
              GilReleased released;
              live = f.live_bytes();
              log = f.log_bytes();
              segments = f.num_segments();
              compactions = f.compactions();
              rows_compacted = f.rows_compacted();
            }
            nb::dict d;
            d["live_bytes"] = live;
            d["log_bytes"] = log;
            d["segments"] = segments;
            d["compactions"] = compactions;
            d["rows_compacted"] = rows_compacted;
            return d;
          });
  add_common<PyLogFile>(log);

  nb::class_<PyStreamIo>(m, "StreamIo", "A GPU tier 0's reads and writes of a log store queued on a CUDA stream "
                                        "(ssd/stream_io.h)")
      .def_static("open", [](nb::object file, int64_t kinds, int64_t fresh, int64_t dirty, uint32_t mark) {
            PyLogFile& f = nb::cast<PyLogFile&>(file);
            auto serial = f.serial();
            const int64_t row_bytes = f.get().row_bytes();  // (raises if the files are closed)
            if (kinds < 1 || fresh < 0 || fresh >= kinds || dirty < 0 || dirty >= kinds)
              throw nb::value_error("fresh and dirty must be counts among the transfer's first `kinds` entries");
            auto py = std::make_unique<PyStreamIo>();
            py->file = file;
            py->row_bytes = row_bytes;
            py->io = std::make_unique<StreamIo>(&f.file, kinds, fresh, dirty, mark);
            return py;
          }, "file"_a, "kinds"_a, "fresh"_a, "dirty"_a, "mark"_a)
      .def("queue", [](PyStreamIo& self, std::optional<uintptr_t> stream, Ids xfer, int64_t n, ConstBytes out,
                       Bytes into) {
            const int64_t row_bytes = self.row_bytes;
            if (static_cast<int64_t>(out.shape(1)) != row_bytes || static_cast<int64_t>(into.shape(1)) != row_bytes)
              throw nb::value_error(("out and into must be blocks of rows of " + std::to_string(row_bytes) +
                                     " bytes").c_str());
            run_without_gil([&] {
              return self.io->Queue(!stream.has_value(), stream.value_or(0), xfer.data(),
                                    static_cast<int64_t>(xfer.shape(0)), n, out.data(),
                                    static_cast<int64_t>(out.shape(0)), into.data(),
                                    static_cast<int64_t>(into.shape(0)));
            });
          }, "stream"_a, "xfer"_a.noconvert(), "n"_a, "out"_a.noconvert(), "into"_a.noconvert(),
          "queues one residency's I/O on stream (a CUstream handle: torch.cuda.Stream.cuda_stream; None: runs it "
          "now, on this thread): the dirty victims out[0, D) "
          "written down, then the misses read into into[0, F); the counts read from xfer when it runs")
      .def("error", [](PyStreamIo& self) { return self.io->error(); },
           "the first failed call's error, '' for none (a failed call stops every later one)")
      .def("take_counts", [](PyStreamIo& self) {
            StreamIo::Counts c = self.io->TakeCounts();
            nb::dict d;
            d["writes"] = c.writes;
            d["rows_written"] = c.rows_written;
            d["reads"] = c.reads;
            d["rows_found"] = c.rows_found;
            d["rows_marked"] = c.rows_marked;
            d["calls"] = c.calls;
            return d;
          }, "what the calls did since the last take_counts(); calls: those run (done or stopped by an error)")
      .def("take_times", [](PyStreamIo& self) {
            StreamIo::Times t = self.io->TakeTimes();
            nb::dict d;
            d["write_seconds"] = static_cast<double>(t.write_ns) * 1e-9;
            d["read_seconds"] = static_cast<double>(t.read_ns) * 1e-9;
            d["calls"] = t.calls;
            return d;
          }, "the wall time the calls that did their work spent writing and reading, since the last take_times()");
}

}  // namespace tieredemb
